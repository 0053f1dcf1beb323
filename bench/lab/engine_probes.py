"""Measurement helpers of bench/lab/bench_engine.py: timers, profiler kernel counts and kernel
times, batch-1 matmul bandwidth, and the transformers peer (same shape, random weights)."""
from __future__ import annotations

import gc
import statistics
import time
from collections import Counter

import torch


def slow_steps(step_ms: list[float], factor: float = 1.25) -> list[tuple[int, float]]:
    """(index, ms) of the steps slower than factor x the median step."""
    if not step_ms:
        return []
    limit = factor * statistics.median(step_ms)
    return [(i, round(ms, 2)) for i, ms in enumerate(step_ms) if ms > limit]


class GcWatch:
    """Python garbage collections while the block runs: count per generation and seconds
    spent in them (a full collection of a process holding torch and Triton can take ms, which
    lands in whichever engine step triggers it)."""

    def __enter__(self) -> GcWatch:
        self.counts, self.seconds, self._t0 = [0, 0, 0], 0.0, 0.0
        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._cb)

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.counts[info["generation"]] += 1
            self.seconds += time.perf_counter() - self._t0

    def report(self) -> dict:
        return {"collections_by_generation": self.counts, "ms": round(1e3 * self.seconds, 3)}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_ms(fn, dev: torch.device, reps: int = 20, warmup: int = 3) -> float:
    """Median milliseconds per call (CUDA events on a GPU, perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    sync(dev)
    times = []
    for _ in range(reps):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


def count_kernels(fn, dev: torch.device) -> dict:
    """CUDA kernels one call of fn runs, by the torch profiler (memcpy/memset excluded)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync(dev)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        sync(dev)
    gpu = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
    kernels = [n for n in gpu if not n.startswith(("Memcpy", "Memset"))]
    launches = [e.name for e in prof.events() if "LaunchKernel" in e.name]
    graph_launches = sum("GraphLaunch" in e.name for e in prof.events())
    if dev.type != "cuda":
        return {"kernels": None, "note": "no CUDA device: nothing to count"}
    return {"kernels": len(kernels), "copies": len(gpu) - len(kernels),
            "host_launch_calls": len(launches), "graph_launches": graph_launches,
            "by_name": dict(Counter(n[:80] for n in kernels).most_common())}


def kernel_times(fn, dev: torch.device) -> dict:
    """Device time by kernel over one call of fn (profiler), grouped into cuBLAS GEMMs, their
    split-K reduces, each Triton kernel and the rest; 'gaps' = wall time - kernel time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if dev.type != "cuda":
        return {}
    wall_ms = time_ms(fn, dev, reps=10)  # before profiling: CUPTI slows later launches
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        sync(dev)
    groups: Counter = Counter()
    critical: Counter = Counter()
    events = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA
                     and not e.name.startswith(("Memcpy", "Memset"))),
                    key=lambda e: e.time_range.start)
    done = events[0].time_range.start if events else 0
    for e in events:
        name = e.name
        key = ("cublas_splitK_reduce" if "splitKreduce" in name else
               "cublas_gemm" if name.startswith(("nvjet", "sm90", "cutlass", "ampere")) or
               "gemm" in name.lower() else name if name.startswith("_") else "torch_other")
        groups[key] += e.time_range.end - e.time_range.start
        # critical path: the wall time by which this kernel moved the finish line (under
        # PDL kernels overlap, so their durations add up to more than the wall time)
        critical[key] += max(0, e.time_range.end - done)
        done = max(done, e.time_range.end)
    busy = sum(groups.values()) / 1e3
    return {"wall_ms": wall_ms, "kernel_ms": busy, "gaps_ms": wall_ms - busy,
            "by_group_ms": {k: v / 1e3 for k, v in groups.most_common()},
            "critical_path_ms": {k: v / 1e3 for k, v in critical.most_common()},
            "critical_note": "per group, the wall time by which its kernels pushed the end of "
                             "the step (kernels sorted by start): where the step's time goes"}


def gemv_bandwidth(model, dev: torch.device) -> list[dict]:
    """Batch-1 matmuls of each weight shape over all layers (every layer's own weight, so L2
    cannot serve them), replayed as a CUDA graph: achieved GB/s of weight reads."""
    if dev.type != "cuda":
        return []
    layers = model.layers
    dtype = next(model.parameters()).dtype
    shapes = {"qkv_proj": [l.self_attn.qkv_proj.weight for l in layers],
              "o_proj": [l.self_attn.o_proj.weight for l in layers],
              "gate_up_proj": [l.mlp.gate_up_proj.weight for l in layers],
              "down_proj": [l.mlp.down_proj.weight for l in layers],
              "lm_head": [model.lm_head.weight]}
    from pdserve.kernels.ops import gemv

    prologues = {"qkv_proj": "norm", "gate_up_proj": "norm", "down_proj": "silu"}
    rows = []
    with torch.inference_mode():
        for name, weights in shapes.items():
            K = weights[0].shape[1]
            x = torch.randn(1, K, device=dev, dtype=dtype)
            pro = prologues.get(name, "none")
            xin = torch.randn(1, 2 * K, device=dev, dtype=dtype) if pro == "silu" else x
            kw = ({"residual": x, "norm_weight": torch.ones(K, device=dev, dtype=dtype)}
                  if pro == "norm" else {})
            row = {"weight": name, "shape": list(weights[0].shape), "count": len(weights),
                   "pdserve_prologue": pro}
            for label, fn in (("cublas", lambda w: torch.nn.functional.linear(x, w)),
                              ("pdserve_gemv", lambda w: gemv(xin, w, pro, **kw))):
                ms = _graph_ms(lambda: [fn(w) for w in weights], dev)
                nbytes = sum(w.numel() * w.element_size() for w in weights)
                row[f"{label}_us_each"] = 1e3 * ms / len(weights)
                row[f"{label}_GBps"] = nbytes / ms / 1e6
            rows.append(row)
    return rows


def _graph_ms(run, dev: torch.device) -> float:
    """Median ms of a CUDA-graph replay of run()."""
    run()
    sync(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return time_ms(graph.replay, dev)


# -- transformers peer ---------------------------------------------------------------------

def hf_model(cfg, dev: torch.device, dtype: torch.dtype):
    import transformers

    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope = {"rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": s.factor,
                "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings}
    kw = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
              intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
              num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
              head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
              tie_word_embeddings=cfg.tie_word_embeddings,
              max_position_embeddings=cfg.max_position_embeddings, rope_parameters=rope)
    if cfg.arch == "qwen3":
        config, cls = transformers.Qwen3Config(**kw), transformers.Qwen3ForCausalLM
    else:
        config, cls = transformers.LlamaConfig(**kw), transformers.LlamaForCausalLM
    with torch.device(dev):  # random init straight on the device
        return cls._from_config(config, dtype=dtype).eval()


@torch.inference_mode()
def hf_forward_loop(model, ids: torch.Tensor, n: int, dev: torch.device) -> dict:
    """Greedy decoding with transformers' own forward and KV cache, no generate(): separates
    generate()'s per-step overhead from the model's."""
    out = model(ids, use_cache=True, logits_to_keep=1)
    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    past = out.past_key_values
    sync(dev)
    t = time.perf_counter()
    for _ in range(n):
        out = model(tok, past_key_values=past, use_cache=True)
        past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    sync(dev)
    dt = time.perf_counter() - t
    return {"batch": ids.shape[0], "steps": n, "step_ms": 1e3 * dt / n,
            "tok_s": ids.shape[0] * n / dt}


def run_hf(plan, dev: torch.device) -> dict:
    """transformers' generate() at plan.hf_batches (batch 1: plan.hf_prompt tokens, else
    plan.batch_context), its bare forward loop at batch 1, and TTFT of the longest prompt."""
    from pdserve.engine.model.presets import get_preset

    cfg = get_preset(plan.preset)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    t0 = time.perf_counter()
    model = hf_model(cfg, dev, dtype)
    out = {"build_s": time.perf_counter() - t0, "attn_implementation":
           model.config._attn_implementation, "mode": "eager PyTorch (no torch.compile), "
           "generate() greedy with min_new_tokens = max_new_tokens", "runs": []}
    out["param_devices"] = sorted({str(p.device) for p in model.parameters()})
    out["param_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    log(f"transformers model built ({out['attn_implementation']}, {out['param_dtypes']})")

    @torch.inference_mode()
    def gen_s(ids: torch.Tensor, n: int) -> float:
        t = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                       min_new_tokens=n, do_sample=False, pad_token_id=0)
        sync(dev)
        return time.perf_counter() - t

    for b in plan.hf_batches:
        length = plan.hf_prompt if b == 1 else plan.batch_context
        ids = torch.tensor(random_prompts(b, length, cfg.vocab_size, 500 + b), device=dev)
        gen_s(ids, 2)  # warm-up
        t1, tn = gen_s(ids, 1), gen_s(ids, plan.hf_tokens)
        row = {"batch": b, "prompt": length, "new_tokens": plan.hf_tokens, "ttft_s": t1,
               "decode_tok_s": b * (plan.hf_tokens - 1) / (tn - t1)}
        out["runs"].append(row)
        log(f"transformers batch {b}: {row['decode_tok_s']:.1f} tok/s")
    ids = torch.tensor(random_prompts(1, plan.hf_prompt, cfg.vocab_size, 501), device=dev)
    hf_forward_loop(model, ids, 2, dev)  # warm-up
    out["forward_loop_batch1"] = hf_forward_loop(model, ids, plan.hf_tokens, dev)
    log(f"transformers forward loop batch 1: {out['forward_loop_batch1']['tok_s']:.1f} tok/s")
    length = max(plan.ttft_lens)
    ids = torch.tensor(random_prompts(1, length, cfg.vocab_size, 600), device=dev)
    out["ttft"] = {"prompt": length, "ttft_s": min(gen_s(ids, 1) for _ in range(2))}
    log(f"transformers TTFT {length}: {out['ttft']['ttft_s']:.3f} s")
    return out

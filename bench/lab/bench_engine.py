"""Engine benchmark on one GPU (issue 5): the device's ceilings, then pdserve's fast path.

    python -m bench.lab.bench_engine --out bench/results/engine_h100_<date>.json
    python -m bench.lab.bench_engine --tiny --out /tmp/engine_tiny.json     # CPU smoke test

In one run: device-to-device copy bandwidth (bytes read + written / time), a read-only
bandwidth estimate (a sum over a large tensor) and the bf16 matmul rate; then, for a
Qwen3-8B-shaped model with random bf16 weights built on the GPU, the engine with Triton
kernels and CUDA graphs: batch-1 decode tok/s against the weight-read roofline, TTFT for 1K
and 10K-token prompts, decode throughput at 16/64/256 sequences with 1K contexts against the
bandwidth bound (weights + KV read per step), kernels launched per decoder layer per decode
step (torch profiler), and transformers' generate() on the same shape as the peer.

To show where the gap to the roofline goes it also records the batch-1 step's device time by
kernel group, each weight shape's batch-1 matmul bandwidth, and transformers' bare forward
loop beside its generate() (helpers in bench/lab/engine_probes.py).

Engine figures are end to end (scheduler, input prep, sampling: what a user gets); "gpu_only"
figures time the captured decode graph + LM head + argmax alone, so the gap is host overhead.
The --tiny mode runs the same code on tiny-qwen3 (CPU, Triton interpreter, no graphs).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from pdserve.kernels.triton_mode import select_triton_mode  # noqa: E402

select_triton_mode()  # first: compiled (GPU) or interpreted (CPU) Triton
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.exec.cuda_graphs import DecodeGraphs
from pdserve.engine.llm import build_engine

from bench.lab.engine_probes import (
    GcWatch,
    count_kernels,
    gemv_bandwidth,
    kernel_times,
    log,
    random_prompts,
    run_hf,
    slow_steps,
    time_ms,
)


@dataclass(frozen=True)
class Plan:
    preset: str = "qwen3-8b"
    device: str = "cuda"
    decode_prompt: int = 512
    decode_tokens: int = 256
    ttft_lens: tuple[int, ...] = (1024, 10240)
    ttft_reps: int = 3
    batch_sizes: tuple[int, ...] = (16, 64, 256)
    batch_context: int = 1024
    batch_tokens: int = 64  # full-batch decode steps wanted after every prompt is in
    hf_batches: tuple[int, ...] = (1, 64)
    hf_prompt: int = 512  # batch 1; bigger batches use batch_context
    hf_tokens: int = 32
    max_model_len: int = 12288
    max_num_batched_tokens: int = 16384
    block_size: int = 16
    copy_bytes: int = 1 << 30
    matmul_n: int = 8192


TINY = Plan(preset="tiny-qwen3", device="cpu", decode_prompt=16, decode_tokens=6,
            ttft_lens=(32, 96), ttft_reps=1, batch_sizes=(2, 4), batch_context=24,
            batch_tokens=3, hf_batches=(1, 4), hf_prompt=16, hf_tokens=4, max_model_len=256,
            max_num_batched_tokens=64, copy_bytes=1 << 24, matmul_n=256)


# -- device ceilings ---------------------------------------------------------------------------

def device_rates(plan: Plan, dev: torch.device) -> dict:
    n = plan.copy_bytes // 4
    x = torch.randn(n, device=dev)  # random data: zeros can run faster than real data
    y = torch.empty_like(x)
    copy_ms = time_ms(lambda: y.copy_(x), dev)
    read_ms = time_ms(lambda: x.sum(), dev)
    del x, y
    m = plan.matmul_n
    a = torch.randn(m, m, device=dev, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=dev, dtype=torch.bfloat16)
    mm_ms = time_ms(lambda: a @ b, dev, reps=10)
    return {"copy_GBps": 2 * plan.copy_bytes / copy_ms / 1e6,
            "copy_note": f"device-to-device copy of {plan.copy_bytes >> 20} MiB of fp32 randn; "
                         "bytes read + written / median time",
            "read_GBps": plan.copy_bytes / read_ms / 1e6,
            "read_note": "torch.sum over the same tensor (read-only estimate)",
            "matmul_bf16_TFLOPs": 2 * m ** 3 / mm_ms / 1e9, "matmul_shape": [m, m, m]}


# -- driving the engine ------------------------------------------------------------------------

def drive(engine, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """Run prompts to completion; one record per step: seconds, tokens out, and whether every
    request already had its first token before the step (a pure decode step of the batch)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(p, params)[0] for p in prompts]
    started: set[str] = set()
    steps = []
    t = time.perf_counter()
    while engine.has_unfinished():
        all_in = len(started) == len(rids)
        outs = engine.step()  # ends in the sampler's host copy: the GPU work is done
        now = time.perf_counter()
        tokens = sum(len(o.new_token_ids) for o in outs)
        started.update(o.request_id for o in outs if o.new_token_ids)
        steps.append({"s": now - t, "tokens": tokens, "decode": all_in})
        t = now
    return steps


def fill_static(graphs: DecodeGraphs, batch: int, context: int, vocab: int) -> None:
    """Point the graph inputs at `batch` sequences of `context` tokens (distinct blocks that
    earlier runs filled with real KV), each writing its next token's slot."""
    bs, nb = graphs.block_size, -(-context // graphs.block_size)
    dev = graphs.device
    rows = torch.arange(batch, device=dev)[:, None] * nb
    graphs.block_tables[:batch, :nb] = (rows + torch.arange(nb, device=dev)).int()
    graphs.seq_lens[:batch] = context
    graphs.slot_mapping[:batch] = (rows[:, 0] + (context - 1) // bs) * bs + (context - 1) % bs
    graphs.positions[:batch] = context - 1
    graphs.input_ids[:batch] = torch.randint(0, vocab, (batch,), device=dev)
    graphs.slot_mapping[batch:].fill_(-1)
    graphs.seq_lens[batch:].fill_(0)


def graph_for(graphs: DecodeGraphs, batch: int, context: int):
    """The captured (graph, hidden, prenorm) that a step of `batch` sequences at `context`
    tokens replays (the short-context one where it fits), or None when none is captured."""
    if batch not in graphs.graphs:
        return None
    return graphs.entry(batch, -(-context // graphs.block_size))


def gpu_step_ms(engine, graphs: DecodeGraphs, batch: int, context: int) -> tuple[float, str]:
    """Device time of one decode step at `batch` x `context`: the captured graph (or, without
    one, the same forward run eagerly) + LM head + argmax."""
    model = engine.runner.model
    fill_static(graphs, batch, context, model.config.vocab_size)
    captured = graph_for(graphs, batch, context)

    def step() -> None:
        if captured is not None:
            captured[0].replay()
            hidden = captured[1]
        else:
            hidden = graphs.forward_eager(batch)[0]
        model.compute_logits(hidden[:batch]).argmax(-1)

    with torch.inference_mode():
        return time_ms(step, graphs.device), "graph" if captured is not None else "eager"


def kv_bytes_per_token(cfg, dtype_bytes: int) -> int:
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * dtype_bytes


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one decode step reads: every parameter once (a tied head once), except
    an untied embedding, of which a step reads one row per token."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.config.tie_word_embeddings:
        emb = model.embed_tokens.weight
        total -= emb.numel() * emb.element_size()
    return total


# -- measurements ------------------------------------------------------------------------------

def bench_decode_batch1(engine, graphs, plan: Plan, bw: float, wbytes: int, kvb: int) -> dict:
    vocab = engine.config.model.vocab_size
    drive(engine, random_prompts(1, plan.decode_prompt, vocab, 1), 8)  # warm-up
    engine.stats.host_s.clear()
    steps0 = engine.stats.steps
    with GcWatch() as gcw:
        steps = drive(engine, random_prompts(1, plan.decode_prompt, vocab, 2),
                      plan.decode_tokens + 1)
    n_steps = max(1, engine.stats.steps - steps0)
    host_ms = {k: round(1e3 * v / n_steps, 4) for k, v in engine.stats.host_s.items()}
    dec = [s for s in steps if s["decode"]]
    tok_s = sum(s["tokens"] for s in dec) / sum(s["s"] for s in dec)
    mid_ctx = plan.decode_prompt + plan.decode_tokens // 2
    gpu_ms, how = gpu_step_ms(engine, graphs, 1, mid_ctx)
    roofline = bw * 1e9 / wbytes
    roofline_kv = bw * 1e9 / (wbytes + mid_ctx * kvb)
    return {"prompt": plan.decode_prompt, "decode_tokens": len(dec), "tok_s": tok_s,
            "step_ms_median": 1e3 * statistics.median(s["s"] for s in dec),
            "slow_steps_ms": [ms for _, ms in slow_steps([1e3 * s["s"] for s in dec])],
            "gc": gcw.report(),
            "gpu_only_step_ms": gpu_ms, "gpu_only_tok_s": 1e3 / gpu_ms, "gpu_only_mode": how,
            "roofline_tok_s": roofline, "pct_of_roofline": 100 * tok_s / roofline,
            "gpu_only_pct_of_roofline": 100e3 / gpu_ms / roofline,
            "roofline_with_kv_tok_s": roofline_kv,
            "roofline_note": "weight bytes per token / measured copy bandwidth; _with_kv adds "
                             "the KV bytes of the mean context", "target_tok_s": 180,
            "step_phases_ms": host_ms,
            "overlap": _overlap_counts(engine),
            "step_phases_note": "mean host time per engine step by phase (EngineStats.host_s); "
                                "'sample' includes waiting for the GPU to finish the step"}


def _overlap_counts(engine) -> dict:
    """Decode steps served by a forward launched before the host read the last tokens."""
    ahead = engine.runner.ahead
    if ahead is None:
        return {"enabled": False}
    return {"enabled": True, "hits": ahead.hits, "discards": ahead.discards}


def bench_ttft(engine, plan: Plan, flops_per_token: float, attn_flops, tflops: float) -> list:
    vocab = engine.config.model.vocab_size
    rows = []
    for i, length in enumerate(plan.ttft_lens):
        drive(engine, random_prompts(1, length, vocab, 100 + i), 1)  # warm-up (compiles)
        times = []
        for r in range(plan.ttft_reps):
            t0 = time.perf_counter()
            drive(engine, random_prompts(1, length, vocab, 200 + 10 * i + r), 1)
            times.append(time.perf_counter() - t0)
        floor = (flops_per_token * length + attn_flops(length)) / (tflops * 1e12)
        rows.append({"prompt": length, "ttft_s": statistics.median(times), "all_s": times,
                     "matmul_floor_s": floor})
        log(f"TTFT {length}: {statistics.median(times):.3f} s (matmul floor {floor:.3f} s)")
    return rows


def bench_throughput(engine, graphs, plan: Plan, bw: float, wbytes: int, kvb: int) -> list:
    vocab = engine.config.model.vocab_size
    rows = []
    for n in plan.batch_sizes:
        prefill_steps = -(-n * plan.batch_context // plan.max_num_batched_tokens)
        steps = drive(engine, random_prompts(n, plan.batch_context, vocab, 300 + n),
                      plan.batch_tokens + prefill_steps + 1)
        full = [s for s in steps if s["decode"] and s["tokens"] == n]
        tok_s = sum(s["tokens"] for s in full) / sum(s["s"] for s in full)
        ctx = plan.batch_context + prefill_steps + plan.batch_tokens // 2  # mean context
        step_bytes = wbytes + n * ctx * kvb
        bound = n * bw * 1e9 / step_bytes
        gpu_ms, how = gpu_step_ms(engine, graphs, n, ctx)
        rows.append({"batch": n, "context": plan.batch_context, "mean_context": ctx,
                     "full_decode_steps": len(full), "tok_s": tok_s,
                     "step_ms_median": 1e3 * statistics.median(s["s"] for s in full),
                     "bytes_per_step": step_bytes, "bound_tok_s": bound,
                     "pct_of_bound": 100 * tok_s / bound, "gpu_only_step_ms": gpu_ms,
                     "gpu_only_tok_s": n * 1e3 / gpu_ms, "gpu_only_pct_of_bound":
                         100 * n * 1e3 / gpu_ms / bound, "gpu_only_mode": how})
        log(f"batch {n}: {tok_s:.0f} tok/s = {100 * tok_s / bound:.0f}% of bound "
            f"{bound:.0f} (gpu only {n * 1e3 / gpu_ms:.0f})")
    return rows


def bench_kernel_counts(engine, graphs: DecodeGraphs, plan: Plan) -> dict:
    model = engine.runner.model
    cfg, dev = model.config, graphs.device
    ctx = plan.decode_prompt
    fill_static(graphs, 1, ctx, cfg.vocab_size)
    meta = graphs.meta(1)
    with torch.inference_mode():
        x = torch.randn(1, cfg.hidden_size, device=dev, dtype=next(model.parameters()).dtype)
        res = torch.randn_like(x)
        cos, sin, meta = model.rope(graphs.positions[:1], meta)  # as the forward passes them
        layer = model.layers[min(1, cfg.num_layers - 1)]
        one = count_kernels(lambda: layer(x, res, cos, sin, meta, engine.runner.kv_cache), dev)
        whole = count_kernels(lambda: graphs.forward_eager(1), dev)
        out = {"per_layer": one["kernels"], "layer": one,
               "forward_total": whole["kernels"],
               "forward_per_layer": whole["kernels"] and whole["kernels"] / cfg.num_layers,
               "forward": whole,
               "method": "torch.profiler CUDA kernel events of one decode step at batch 1 run "
                         "eagerly through the same function and inputs the CUDA graph captured "
                         "(a replay shows as one graph launch); per_layer profiles one "
                         "DecoderLayer call, forward_* the whole model forward (embedding, "
                         "RoPE tables and final norm included) over num_layers",
               "target_per_layer": 8}
        captured = graph_for(graphs, 1, ctx)
        if captured is not None:
            out["graph_replay"] = count_kernels(captured[0].replay, dev)
            out["batch1_step_time_breakdown"] = kernel_times(captured[0].replay, dev)
    out["batch1_matmul_bandwidth"] = gemv_bandwidth(model, dev)
    return out


def run_pdserve(plan: Plan, dev: torch.device, rates: dict, result: dict, save) -> None:
    t0 = time.perf_counter()
    need = max(max(plan.batch_sizes) * (plan.batch_context + plan.batch_tokens + 64),
               max(plan.ttft_lens) + 64, plan.decode_prompt + plan.decode_tokens + 64)
    engine = build_engine(
        plan.preset, device=plan.device, dtype="bfloat16" if dev.type == "cuda" else "float32",
        num_blocks=need // plan.block_size + 64, block_size=plan.block_size,
        max_num_seqs=max(plan.batch_sizes), max_num_batched_tokens=plan.max_num_batched_tokens,
        max_model_len=plan.max_model_len, enable_prefix_caching=False, use_triton=True,
        use_cuda_graphs=dev.type == "cuda")
    runner, cfg = engine.runner, engine.config.model
    graphs = runner.cuda_graphs or DecodeGraphs(engine.config, runner.model, runner.kv_cache)
    dbytes = runner.kv_cache.element_size()
    wbytes, kvb = weight_bytes_per_token(runner.model), kv_bytes_per_token(cfg, dbytes)
    result["model"] = {"preset": plan.preset, "dtype": str(runner.kv_cache.dtype),
                       "weight_bytes_per_token": wbytes, "kv_bytes_per_token": kvb,
                       "num_blocks": engine.config.cache.num_blocks,
                       "graph_buckets": sorted(graphs.graphs), "build_s": time.perf_counter() - t0}
    log(f"engine built in {time.perf_counter() - t0:.1f} s; weights/token {wbytes / 1e9:.2f} GB")
    bw = rates["copy_GBps"]
    result["decode_batch1"] = bench_decode_batch1(engine, graphs, plan, bw, wbytes, kvb)
    log(f"batch 1: {result['decode_batch1']['tok_s']:.1f} tok/s "
        f"(gpu only {result['decode_batch1']['gpu_only_tok_s']:.1f}, roofline "
        f"{result['decode_batch1']['roofline_tok_s']:.1f})")
    save()
    result["kernels_per_decoder_layer"] = bench_kernel_counts(engine, graphs, plan)
    log(f"kernels per layer: {result['kernels_per_decoder_layer']['per_layer']}")
    save()
    # prefill FLOPs: 2 per weight per token in the layers (the head runs for one row), plus
    # causal attention (QK^T and PV over half the square)
    head = cfg.vocab_size * cfg.hidden_size
    flops_tok = 2 * (wbytes / dbytes - head)

    def flops_fixed(n: int) -> float:
        return 2 * head + 4 * n * n / 2 * cfg.num_heads * cfg.head_dim * cfg.num_layers

    result["ttft"] = bench_ttft(engine, plan, flops_tok, flops_fixed,
                                rates["matmul_bf16_TFLOPs"])
    save()
    result["decode_throughput"] = bench_throughput(engine, graphs, plan, bw, wbytes, kvb)
    result["graph_replays"] = graphs.replays
    save()


# -- main --------------------------------------------------------------------------------------

def summary(result: dict) -> dict:
    """The issue's 'done when' lines, each with its measured figure."""
    s: dict = {}
    b1 = result.get("decode_batch1")
    if b1:
        s["batch1_tok_s"] = {"value": b1["tok_s"], "target": ">= 180 and >= 90% of roofline",
                             "pct_of_roofline": b1["pct_of_roofline"],
                             "met": b1["tok_s"] >= 180 and b1["pct_of_roofline"] >= 90}
    ttft = [r for r in result.get("ttft", []) if r["prompt"] >= 10000]
    if ttft:
        s["ttft_10k_s"] = {"value": ttft[0]["ttft_s"], "target": "<= 0.30",
                           "met": ttft[0]["ttft_s"] <= 0.30}
    k = result.get("kernels_per_decoder_layer")
    if k and k["per_layer"] is not None:
        s["kernels_per_layer"] = {"value": k["per_layer"], "target": "<= 8",
                                  "met": k["per_layer"] <= 8}
    top = [r for r in result.get("decode_throughput", []) if r["batch"] == 256]
    if top:
        s["batch256_pct_of_bound"] = {"value": top[0]["pct_of_bound"], "target": ">= 60",
                                      "met": top[0]["pct_of_bound"] >= 60}
    return s


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="JSON file to write")
    ap.add_argument("--preset", default=None, help="model shape (default qwen3-8b)")
    ap.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny-qwen3, small sizes")
    ap.add_argument("--skip-hf", action="store_true", help="leave out the transformers peer")
    args = ap.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    plan = TINY if args.tiny or device == "cpu" else Plan()  # CPU: smoke-test sizes
    plan = dataclasses.replace(plan, preset=args.preset or plan.preset, device=device)
    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    result: dict = {"device": name, "command": " ".join([sys.executable] + sys.argv),
                    "date": datetime.datetime.now(datetime.UTC).isoformat(
                        timespec="seconds"),
                    "versions": _versions(), "plan": dataclasses.asdict(plan)}

    def save() -> None:
        result["summary"] = summary(result)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2, default=str)

    log(f"device {name}; plan {plan.preset}")
    result["device_rates"] = device_rates(plan, dev)
    log(f"copy {result['device_rates']['copy_GBps']:.0f} GB/s, read "
        f"{result['device_rates']['read_GBps']:.0f} GB/s, bf16 matmul "
        f"{result['device_rates']['matmul_bf16_TFLOPs']:.0f} TFLOP/s")
    save()
    try:
        run_pdserve(plan, dev, result["device_rates"], result, save)
    except Exception as e:  # keep what was measured; the peer still runs
        result["pdserve_error"] = f"{type(e).__name__}: {e}"
        log(f"pdserve run failed: {result['pdserve_error']}")
    save()
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # the engine's KV cache and graphs go before the peer loads
    if not args.skip_hf:
        try:
            result["transformers"] = run_hf(plan, dev)
        except Exception as e:
            result["transformers_error"] = f"{type(e).__name__}: {e}"
            log(f"transformers run failed: {result['transformers_error']}")
    save()
    print(json.dumps(result["summary"], indent=2))


def _versions() -> dict:
    out = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for mod in ("triton", "transformers"):
        try:
            out[mod] = __import__(mod).__version__
        except ImportError:
            out[mod] = None
    return out


if __name__ == "__main__":
    main()

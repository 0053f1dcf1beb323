"""Tensor-parallel engine benchmark (issue 26): TP=N against TP=1 on the same machine.

    python -m bench.lab.bench_tp --model qwen3-8b --tp 1 --out $OUT/tp1.json     # one GPU
    python -m bench.lab.bench_tp --model qwen3-8b --tp 1 2 --out $OUT/tp_8b.json   # two GPUs
    python -m bench.lab.bench_tp --model qwen3-30b-a3b --tp 1 2 --out $OUT/tp_30b.json
    python -m bench.lab.bench_tp --tiny --tp 1 2 --out /tmp/tp.json   # CPU, gloo, torch ops

This process is rank 0: build_engine(..., tensor_parallel_size=N) spawns the followers
(engine/dist/rank.py). Random bf16 weights of the preset's shape. Per configuration
(tpN_graphs, tpN_eager): the load (time, memory); batch-1 decode tok/s against
the per-GPU roofline; TTFT of a 10K-token prompt (dense); decode throughput at 64 and 256
sequences x 1K context (MoE: 64); from torch.profiler on rank 0, per decode step the
collectives' time, the lockstep step messages and the kernels, and per decoder layer the
kernel launches and collective calls (with graphs: kernels per step / layers). Every
size runs with CUDA graphs (each rank replays its own capture) and eagerly (--no-eager: not);
what check_tp_args refuses is probed and recorded; --overlap adds eager runs with
overlap_decode='on'.
Everything goes through engine.step(): calling the model directly on rank 0 (as
bench_engine's gpu-only timings do) would wait in an all-reduce no follower joins.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import inspect
import json
import resource
import statistics
import sys
import time

import torch

from pdserve.kernels.triton_mode import select_triton_mode  # noqa: E402

select_triton_mode()  # first: compiled (GPU) or interpreted (CPU) Triton
from pdserve.engine.core.config import ConfigError  # noqa: E402
from pdserve.engine.core.engine_args import EngineArgs  # noqa: E402
from pdserve.engine.dist.rank import check_tp_args, rank_device  # noqa: E402
from pdserve.engine.llm import build_engine  # noqa: E402
from pdserve.engine.model.loader import load_model  # noqa: E402
from pdserve.engine.model.presets import param_count  # noqa: E402

from bench.lab.bench_engine import (  # noqa: E402
    Plan,
    _versions,
    bench_ttft,
    device_rates,
    kv_bytes_per_token,
    weight_bytes_per_token,
)
from bench.lab.bench_fp8 import free  # noqa: E402
from bench.lab.bench_moe import experts_touched, moe_bytes  # noqa: E402
from bench.lab.engine_probes import GcWatch, log, random_prompts, slow_steps  # noqa: E402
from bench.lab.tp_probes import run_steps  # noqa: E402

PLANS = {
    "qwen3-8b": Plan(preset="qwen3-8b", decode_tokens=128, ttft_lens=(10240,), ttft_reps=2,
                     batch_sizes=(64, 256), batch_tokens=32),
    "qwen3-30b-a3b": Plan(preset="qwen3-30b-a3b", decode_tokens=128, ttft_lens=(),
                          batch_sizes=(64,), batch_tokens=32, max_model_len=4096),
}
TINY = {"qwen3-8b": "tiny-qwen3", "qwen3-30b-a3b": "tiny-qwen3-moe"}
TINY_PLAN = Plan(device="cpu", decode_prompt=16, decode_tokens=8, ttft_lens=(40,), ttft_reps=1,
                 batch_sizes=(3,), batch_context=16, batch_tokens=8, max_model_len=128,
                 max_num_batched_tokens=64, copy_bytes=1 << 22, matmul_n=128)
PROFILE_STEPS = 4  # profiled decode steps per measurement (left out of its tok/s)
PROBES = {"use_cuda_graphs": {"use_cuda_graphs": True, "use_triton": True},
          "speculative": {"speculative": "mtp"}, "overlap_decode_on": {"overlap_decode": "on"}}
THIS_RUN = ("no speculation anywhere. tpN_graphs: CUDA graphs on every rank + overlap_decode "
            "'auto' (on), the engine's best at that size; tpN_eager: no CUDA graphs, "
            "overlap_decode 'off' (like for like); *_overlap: eager with overlap_decode 'on'")
ROOFLINE = ("rank 0's shard bytes per token (MoE: dense + top_k experts; batches: touched "
            "experts + the rank's KV heads) / copy bandwidth: every GPU reads its shard at once; "
            "collectives and step messages are not in it")
LOAD_FULL = ("each rank random-inits the FULL preset on its own device (load_model), then "
             "shard_model copies its shard: peak = full + shard per device")
LOAD_SHARD = ("each rank loads only its shard (load_model(tp=, rank=): engine/model/shard_load.py, "
              "a preset drawn one full tensor at a time and cut): peak beyond it one tensor")


def tp_features(preset: str, tp: int) -> dict:
    """What check_tp_args refuses at TP `tp` in this tree, and how a rank loads (probed)."""
    out: dict = {}
    for name, kw in PROBES.items():
        try:
            check_tp_args(EngineArgs(model=preset, tensor_parallel_size=tp, **kw))
            out[name] = f"accepted at TP {tp}"
        except ConfigError as e:
            out[name] = f"refused at TP {tp}: {e}"
    out["this_run"] = THIS_RUN
    out["rank_load"] = LOAD_SHARD if "tp" in inspect.signature(load_model).parameters \
        else LOAD_FULL
    return out


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    tp: int
    graphs: bool
    overlap: bool = False  # overlap_decode 'on' without graphs


def configs(tps: list[int], cuda: bool, overlap: bool, eager: bool = True) -> list[Config]:
    """Every TP size with CUDA graphs (CUDA only: every rank captures its decode graphs) and,
    unless not `eager` on CUDA, eagerly; with `overlap` every eager one again with
    overlap_decode 'on'."""
    out: list[Config] = []
    for tp in tps:
        out += [Config(f"tp{tp}_graphs", tp, True)] if cuda else []
        out += [Config(f"tp{tp}_eager", tp, False)] if eager or not cuda else []
        out += [Config(f"tp{tp}_eager_overlap", tp, False, True)] if overlap else []
    return out


def gpu_used() -> dict[int, int] | None:
    """Bytes in use on every visible GPU by NVML (all processes: the followers too; their
    caching allocators keep what the full model freed); None without NVML bindings."""
    try:
        return {i: torch.cuda.device_memory_used(i) for i in range(torch.cuda.device_count())}
    except Exception:  # noqa: BLE001 - pynvml missing
        return None


def build(plan: Plan, cfg: Config):
    cuda = plan.device == "cuda"
    need = max([b * (plan.batch_context + plan.batch_tokens + 64) for b in plan.batch_sizes]
               + [max(plan.ttft_lens, default=0) + 64, plan.decode_prompt + plan.decode_tokens + 64])
    return build_engine(
        plan.preset, device=plan.device, dtype="bfloat16" if cuda else "float32",
        num_blocks=need // plan.block_size + 64, block_size=plan.block_size,
        max_num_seqs=max(plan.batch_sizes), max_num_batched_tokens=plan.max_num_batched_tokens,
        max_model_len=plan.max_model_len, enable_prefix_caching=False, use_triton=cuda,
        use_cuda_graphs=cfg.graphs,
        overlap_decode="auto" if cfg.graphs else "on" if cfg.overlap else "off",
        tensor_parallel_size=cfg.tp)


def build_measured(plan: Plan, cfg: Config) -> tuple[object, dict]:
    """The engine and its load figures (time, memory; tp_features' rank_load says how)."""
    cuda = plan.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    engine = build(plan, cfg)
    model = engine.runner.model
    full = param_count(engine.config.model) * model.embed_tokens.weight.element_size()
    shard = sum(p.numel() * p.element_size() for p in model.parameters())
    out = {"build_s": time.perf_counter() - t0, "full_model_bytes": full,
           "rank0_shard_bytes": shard,
           "rank0_host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
           * 1024}
    if cuda:
        out["rank0_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()  # KV included
        kv = engine.runner.kv_cache
        out["rank0_kv_cache_bytes"] = kv.numel() * kv.element_size()
        out["gpu_used_bytes_after_load"] = gpu_used()
        out["graph_buckets"] = sorted(engine.runner.cuda_graphs.graphs) \
            if engine.runner.cuda_graphs is not None else []
    return engine, out


def token_bytes(model) -> tuple[int, tuple[int, int, int] | None]:
    """Weight bytes one batch-1 decode token reads on rank 0 (its shard: the per-GPU
    roofline), and for MoE bench_moe's (dense, one expert, MoE layers) sizes."""
    if model.config.moe is None:
        return weight_bytes_per_token(model), None
    sizes = moe_bytes(model)
    return sizes[0] + model.config.moe.top_k * sizes[1] * sizes[2], sizes


def decode_batch1(engine, plan: Plan, bw: float) -> dict:
    vocab = engine.config.model.vocab_size
    run_steps(engine, random_prompts(1, plan.decode_prompt, vocab, 1), 8)  # warm-up
    with GcWatch() as gcw:
        steps, prof = run_steps(engine, random_prompts(1, plan.decode_prompt, vocab, 2),
                                plan.decode_tokens + 1, PROFILE_STEPS)
    dec = [s for s in steps if s["decode"] and not s["profiled"]]
    tok_s = sum(s["tokens"] for s in dec) / sum(s["s"] for s in dec)
    per_token, _ = token_bytes(engine.runner.model)
    roof = bw * 1e9 / per_token
    return {"prompt": plan.decode_prompt, "decode_tokens": len(dec), "tok_s": tok_s,
            "step_ms_median": 1e3 * statistics.median(s["s"] for s in dec),
            "slow_steps_ms": [ms for _, ms in slow_steps([1e3 * s["s"] for s in dec])],
            "gc": gcw.report(), "rank0_bytes_per_token": per_token, "roofline_tok_s": roof,
            "pct_of_roofline": 100 * tok_s / roof, "profile": prof}


def decode_throughput(engine, plan: Plan, bw: float, kvb: int) -> list[dict]:
    """Full-batch decode tok/s at each plan.batch_sizes x plan.batch_context, against the
    per-GPU bandwidth bound (shard weights or touched experts + the rank's KV heads)."""
    model = engine.runner.model
    moe, vocab = model.config.moe, engine.config.model.vocab_size
    per_token, sizes = token_bytes(model)
    rows = []
    for n in plan.batch_sizes:
        pre = -(-n * plan.batch_context // plan.max_num_batched_tokens)
        steps, prof = run_steps(engine, random_prompts(n, plan.batch_context, vocab, 300 + n),
                                plan.batch_tokens + pre + 1, PROFILE_STEPS)
        full = [s for s in steps if s["decode"] and s["tokens"] == n and not s["profiled"]]
        warm, full = full[:1], full[1:]  # the first full step may JIT-compile new shapes
        tok_s = sum(s["tokens"] for s in full) / sum(s["s"] for s in full)
        ctx = plan.batch_context + pre + plan.batch_tokens // 2  # mean context
        weights = per_token if sizes is None else (
            sizes[0] + experts_touched(n, moe.num_experts, moe.top_k) * sizes[1] * sizes[2])
        step_bytes = weights + n * ctx * kvb
        bound = n * bw * 1e9 / step_bytes
        rows.append({"batch": n, "context": plan.batch_context, "mean_context": ctx,
                     "full_decode_steps": len(full), "tok_s": tok_s,
                     "warmup_step_ms": [1e3 * s["s"] for s in warm],
                     "step_ms_median": 1e3 * statistics.median(s["s"] for s in full),
                     "tok_s_at_median_step": n / statistics.median(s["s"] for s in full),
                     "slow_steps_ms": [ms for _, ms in slow_steps([1e3 * s["s"] for s in full])],
                     "rank0_bytes_per_step": step_bytes, "bound_tok_s": bound,
                     "pct_of_bound": 100 * tok_s / bound, "profile": prof})
        log(f"  batch {n}: {tok_s:.0f} tok/s = {100 * tok_s / bound:.0f}% of bound; "
            f"collectives {_coll(prof)} ms/step")
    return rows


def ttft(engine, plan: Plan, rates: dict) -> list[dict]:
    """bench_engine.bench_ttft with rank 0's matmul floor (its shard's FLOPs, its heads)."""
    model, cfg = engine.runner.model, engine.runner.model.config
    head = model.lm_head.weight.numel() + model.embed_tokens.weight.numel()
    flops_tok = 2 * (sum(p.numel() for p in model.parameters()) - head)
    return bench_ttft(engine, plan, flops_tok, lambda n: 4 * n * n / 2 * cfg.num_heads
                      * cfg.head_dim * cfg.num_layers, rates["matmul_bf16_TFLOPs"])


def _coll(prof: dict | None) -> str:
    return "-" if not prof else f"{prof['collective_ms_per_step']:.3f}"


def run_config(plan: Plan, cfg: Config, rates: dict, out: dict, save,
               batch1_only: bool = False) -> None:
    engine, out["load"] = build_measured(plan, cfg)
    log(f"[{cfg.name}] built in {out['load']['build_s']:.1f} s")
    save()
    try:
        measure(engine, plan, cfg, rates, out, save, batch1_only)
    finally:
        engine.close()  # stops the follower ranks; main then frees the device memory


def measure(engine, plan: Plan, cfg: Config, rates: dict, out: dict, save,
            batch1_only: bool = False) -> None:
    bw, model = rates["copy_GBps"], engine.runner.model
    kvb = kv_bytes_per_token(model.config, engine.runner.kv_cache.element_size())
    b1 = out["decode_batch1"] = decode_batch1(engine, plan, bw)
    log(f"[{cfg.name}] batch 1: {b1['tok_s']:.1f} tok/s ({b1['pct_of_roofline']:.0f}% of "
        f"per-GPU roofline); collectives {_coll(b1['profile'])} ms/step; per layer "
        f"{(b1['profile'] or {}).get('per_layer')}")
    save()
    if batch1_only:
        return
    # prefill never replays graphs: tpN_eager's TTFT is tpN_graphs' (measured there on CUDA)
    if plan.ttft_lens and not cfg.overlap and (cfg.graphs or plan.device != "cuda"):
        out["ttft"] = ttft(engine, plan, rates)
        save()
    out["decode_throughput"] = decode_throughput(engine, plan, bw, kvb)
    save()


def summary(result: dict) -> dict:
    """Each configuration's figures, and every TP > 1 against tp1_eager (like for like) and
    tp1_graphs (today's single-GPU best); the issue's batch-1 target is TP 2 >= 1.6x TP 1."""
    s: dict = {}
    runs = result.get("runs", {})
    rates: dict[tuple[str, str], float] = {}  # (configuration, measurement) -> tok/s
    for name, r in runs.items():
        if "decode_batch1" in r:
            rates[name, "batch1"] = r["decode_batch1"]["tok_s"]
            prof = r["decode_batch1"]["profile"] or {}
            s[f"{name}_batch1_collective_ms_per_step"] = prof.get("collective_ms_per_step")
            s[f"{name}_kernel_launches_per_layer"] = (prof.get("per_layer") or {}).get(
                "kernel_launches")
            s[f"{name}_kernels_per_step_over_layers"] = prof.get("kernels_per_step_over_layers")
        s.update({f"{name}_ttft_{t['prompt']}_s": t["ttft_s"] for t in r.get("ttft", [])})
        rates.update({(name, f"batch{t['batch']}"): t["tok_s"]
                      for t in r.get("decode_throughput", [])})
    s.update({f"{c}_{m}_tok_s": v for (c, m), v in rates.items()})
    for (c, m), v in rates.items():
        bases = ("tp1_graphs",) if runs[c]["cuda_graphs"] else ("tp1_eager", "tp1_eager_overlap")
        for base in bases if runs[c]["tp"] > 1 else ():
            if (base, m) in rates:
                ratio = v / rates[base, m]
                s[f"{c}_over_{base}_{m}"] = {"value": ratio, "target": ">= 1.6",
                                             "met": ratio >= 1.6} if m == "batch1" else ratio
    return s


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-8b", choices=sorted(PLANS))
    ap.add_argument("--tp", type=int, nargs="+", default=[1],
                    help="TP sizes to run in turn (TP 1 runs with and without CUDA graphs)")
    ap.add_argument("--overlap", action="store_true",
                    help="also run each eager configuration with overlap_decode 'on'")
    ap.add_argument("--no-eager", action="store_true",
                    help="on CUDA, run only the CUDA-graph configurations")
    ap.add_argument("--batch1-only", action="store_true",
                    help="measure batch-1 decode only (no TTFT, no batched decode)")
    ap.add_argument("--tiny", action="store_true",
                    help="CPU smoke test: tiny preset of the model's family, gloo")
    ap.add_argument("--out", default=None, help="JSON file to write")
    args = ap.parse_args(argv)
    if min(args.tp) < 1:
        ap.error(f"--tp: sizes must be >= 1, got {args.tp}")
    gpus = torch.cuda.device_count()
    if torch.cuda.is_available() and not args.tiny and max(args.tp) > gpus:
        ap.error(f"--tp: TP {max(args.tp)} needs {max(args.tp)} GPUs (one per rank), "
                 f"{gpus} visible")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    plan = PLANS[args.model] if cuda else dataclasses.replace(TINY_PLAN, preset=TINY[args.model])
    if args.batch1_only:  # one sequence: capture bucket 1 only
        plan = dataclasses.replace(plan, batch_sizes=(1,))
    dev = torch.device(plan.device)
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda \
        else []
    result: dict = {
        "device": gpus[0] if gpus else "cpu", "gpus_visible": gpus, "tp_sizes": args.tp,
        "command": " ".join([sys.executable, "-m", "bench.lab.bench_tp"] + sys.argv[1:]
                            if argv is None else ["bench.lab.bench_tp"] + argv),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "versions": _versions(), "plan": dataclasses.asdict(plan),
        "collective_backend": "nccl (eager forward), one-shot peer memory (inside CUDA graphs), "
                              "TCP streams (step messages)" if cuda else "gloo",
        "engine_features_at_tp_gt_1": tp_features(plan.preset, max(2, *args.tp)),
        "roofline": ROOFLINE, "runs": {}}

    def save() -> None:
        result["summary"] = summary(result)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2, default=str)

    log(f"device {result['device']} x{max(1, len(gpus))}; model {plan.preset}; TP {args.tp}")
    rates = result["device_rates"] = device_rates(plan, dev)
    log(f"copy {rates['copy_GBps']:.0f} GB/s, bf16 matmul {rates['matmul_bf16_TFLOPs']:.0f} "
        f"TFLOP/s")
    save()
    for cfg in configs(args.tp, cuda, args.overlap, not args.no_eager):
        out = result["runs"].setdefault(cfg.name, {
            "tp": cfg.tp, "cuda_graphs": cfg.graphs,
            "overlap_decode": "auto (on with graphs)" if cfg.graphs else
            "on" if cfg.overlap else "off",
            "rank_devices": [rank_device(plan.device, r) for r in range(cfg.tp)]})
        try:
            run_config(plan, cfg, rates, out, save, args.batch1_only)
        except Exception as e:  # keep what was measured; the next configuration still runs
            out["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            log(f"[{cfg.name}] failed: {out['error']}")
        free()  # the engine (reference cycles) and its cache go before the next build
        save()
    if not cuda:  # the followers have exited: the largest one's peak RSS
        result["followers_host_peak_rss_bytes"] = resource.getrusage(
            resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    save()
    print(json.dumps(result["summary"], indent=2, default=str))


if __name__ == "__main__":
    main()

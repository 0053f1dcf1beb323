"""FP8 weights on one GPU (issue 22): bf16 against FP8 through the whole engine, one model per run.

    python -m bench.lab.bench_fp8 --model qwen3-8b --out $OUT/fp8_qwen3-8b.json
    python -m bench.lab.bench_fp8 --model qwen3-30b-a3b --out $OUT/fp8_qwen3-30b.json
    python -m bench.lab.bench_fp8 --model glm-4.5-air --out $OUT/fp8_glm.json
    python -m bench.lab.bench_fp8 --tiny --out /tmp/fp8_tiny.json     # CPU smoke test
    python -m bench.lab.bench_fp8 --model qwen3-8b --skip-sweep --batch1-only --out F
        # batch-1 decode only, bf16 and FP8 (issue 22's two roofline lines)
    ... --gemv-stages: first time pipelined one-row GEMV tiles and install the winners

Each run measures the device's copy bandwidth first (the roofline's denominator, in the same
run), then per weight format (bf16, fp8; GLM-4.5-Air only fp8: 106B parameters fit one H200
only as FP8, drawn layer by layer in FP8 on the GPU, never as a float copy) an engine with
Triton kernels and CUDA graphs over random weights of the preset's shape:
  - batch-1 decode tok/s against the roofline: the bytes one token reads (FP8 weights and
    their scales, the bf16 LM head; for MoE the dense part plus top_k experts per layer)
    over the copy bandwidth;
  - TTFT of a 10K-token prompt (dense models);
  - decode throughput at 64 and 256 sequences (MoE: 64) against the bandwidth bound;
  - GLM-4.5-Air: forced-acceptance MTP speedups at k = 1 and 3, the free KV capacity;
  - qwen3-8b: the one-row GEMV per weight shape, bf16 and FP8, tile sweep (device tables;
    bench.lab.bench_gemv.one_row_sweep, each projection with the decoder's fusions).
Writes the JSON after every stage and prints progress.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import sys
import time

import torch

from pdserve.kernels.triton_mode import select_triton_mode  # noqa: E402

select_triton_mode()  # first: compiled (GPU) or interpreted (CPU) Triton
from pdserve.engine.core.config import SpecConfig  # noqa: E402
from pdserve.engine.exec.cuda_graphs import DecodeGraphs  # noqa: E402
from pdserve.engine.llm import build_engine  # noqa: E402
from pdserve.engine.model.presets import get_preset  # noqa: E402

from bench.lab.bench_engine import (  # noqa: E402
    Plan,
    _versions,
    bench_decode_batch1,
    bench_throughput,
    bench_ttft,
    device_rates,
    drive,
    kv_bytes_per_token,
    weight_bytes_per_token,
)
from bench.lab.bench_moe import batch1 as moe_batch1  # noqa: E402
from bench.lab.bench_moe import moe_bytes, throughput  # noqa: E402
from bench.lab.engine_probes import log, random_prompts  # noqa: E402

PLANS = {
    "qwen3-8b": Plan(preset="qwen3-8b", ttft_lens=(10240,), ttft_reps=2, batch_sizes=(64, 256),
                     batch_tokens=32, block_size=16),
    "qwen3-30b-a3b": Plan(preset="qwen3-30b-a3b", ttft_lens=(), batch_sizes=(64,),
                          batch_tokens=32, max_model_len=4096),
    "glm-4.5-air": Plan(preset="glm-4.5-air", ttft_lens=(), batch_sizes=(64,), batch_tokens=32,
                        max_model_len=4096, decode_tokens=128),
}
TINY = Plan(preset="tiny-qwen3", device="cpu", decode_prompt=16, decode_tokens=4, ttft_lens=(40,),
            ttft_reps=1, batch_sizes=(3,), batch_context=16, batch_tokens=2, max_model_len=128,
            max_num_batched_tokens=64, copy_bytes=1 << 22, matmul_n=128)
FORMATS = {"glm-4.5-air": ("fp8",)}  # the others: bf16 and fp8


def build(plan: Plan, quant: str | None, spec: SpecConfig | None = None, num_blocks: int = 0):
    cuda = plan.device == "cuda"
    need = max([b * (plan.batch_context + plan.batch_tokens + 64) for b in plan.batch_sizes]
               + [max(plan.ttft_lens, default=0) + 64, plan.decode_prompt + plan.decode_tokens + 64])
    return build_engine(
        plan.preset, device=plan.device, dtype="bfloat16" if cuda else "float32",
        quantization=quant, num_blocks=num_blocks or need // plan.block_size + 64,
        block_size=plan.block_size, max_num_seqs=max(plan.batch_sizes),
        max_num_batched_tokens=plan.max_num_batched_tokens, max_model_len=plan.max_model_len,
        enable_prefix_caching=False, use_triton=True, use_cuda_graphs=cuda, speculative=spec)


def free() -> None:
    """Collect garbage (engines hold reference cycles) and return cached device memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_format(plan: Plan, quant: str | None, rates: dict, out: dict, save,
               batch1_only: bool = False) -> None:
    t0 = time.perf_counter()
    engine = build(plan, quant)
    runner, cfg = engine.runner, engine.config.model
    graphs = runner.cuda_graphs or DecodeGraphs(engine.config, runner.model, runner.kv_cache)
    kvb = kv_bytes_per_token(cfg, runner.kv_cache.element_size())
    bw = rates["copy_GBps"]
    out["build_s"] = time.perf_counter() - t0
    log(f"[{quant or 'bf16'}] engine built in {out['build_s']:.1f} s")
    if cfg.moe is None:
        wbytes = weight_bytes_per_token(runner.model)
        out["weight_bytes_per_token"] = wbytes
        out["decode_batch1"] = bench_decode_batch1(engine, graphs, plan, bw, wbytes, kvb)
        save()
        log(f"[{quant or 'bf16'}] batch 1: {out['decode_batch1']['tok_s']:.1f} tok/s = "
            f"{out['decode_batch1']['pct_of_roofline']:.1f}% of roofline "
            f"{out['decode_batch1']['roofline_tok_s']:.1f}")
        if batch1_only:
            del engine, runner, graphs
            free()
            return
        head = cfg.vocab_size * cfg.hidden_size
        flops_tok = 2 * (sum(p.numel() for p in runner.model.parameters()) - 2 * head)
        out["ttft"] = bench_ttft(engine, plan, flops_tok, lambda n: 4 * n * n / 2 * cfg.num_heads
                                 * cfg.head_dim * cfg.num_layers, rates["matmul_bf16_TFLOPs"])
        save()
        out["decode_throughput"] = bench_throughput(engine, graphs, plan, bw, wbytes, kvb)
    else:
        sizes = moe_bytes(runner.model)
        dense, expert, layers = sizes
        per_token = dense + cfg.moe.top_k * expert * layers
        out["bytes"] = {"dense": dense, "expert": expert, "moe_layers": layers,
                        "per_token": per_token}
        out["decode_batch1"] = moe_batch1(engine, graphs, plan, bw, per_token)
        save()
        log(f"[{quant or 'bf16'}] batch 1: {out['decode_batch1']['tok_s']:.1f} tok/s = "
            f"{out['decode_batch1']['pct_of_roofline']:.1f}% of roofline")
        out["decode_throughput"] = throughput(engine, graphs, plan, bw, sizes, kvb)
    save()
    if plan.preset.startswith("glm") or plan.device == "cpu":
        out["kv_capacity"] = kv_capacity(engine, kvb)
    # the engine holds reference cycles: drop every name, then collect, before the next
    # build (two GLM-4.5-Air engines do not fit one H200)
    del engine, runner, graphs
    free()


def kv_capacity(engine, kvb: int) -> dict:
    """Tokens of KV the free device memory would hold beside this engine (weights, its
    cache, CUDA graphs): free bytes / KV bytes per token, plus what its cache holds."""
    cache = engine.config.cache
    held = cache.num_blocks * cache.block_size
    free_b = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0
    return {"cache_tokens": held, "free_bytes": free_b, "kv_bytes_per_token": kvb,
            "free_kv_tokens": free_b // kvb, "total_kv_tokens": held + free_b // kvb}


def run_mtp(plan: Plan, ks: tuple[int, ...]) -> dict:
    """Forced-acceptance MTP at batch 1 (every draft accepted: the ceiling of the draft
    path), FP8 weights, against the same engine without speculation."""
    vocab = get_preset(plan.preset).vocab_size
    [prompt] = random_prompts(1, plan.decode_prompt, vocab, 7)
    rows: dict = {}
    for k in (0, *ks):
        spec = SpecConfig(num_speculative_tokens=k, batch_k_caps=(), forced_acceptance=True) \
            if k else None
        engine = build(plan, "fp8", spec, num_blocks=(len(prompt) + plan.decode_tokens) // 16 + 64)
        drive(engine, [prompt[:32]], 8)  # warm-up
        steps = drive(engine, [prompt], plan.decode_tokens)
        dec = [s for s in steps if s["decode"]]
        rows[f"k{k}"] = {"tok_s": sum(s["tokens"] for s in dec) / sum(s["s"] for s in dec)}
        if k:
            rows[f"k{k}"]["speedup"] = rows[f"k{k}"]["tok_s"] / rows["k0"]["tok_s"]
        log(f"MTP k={k}: {rows[f'k{k}']}")
        del engine  # before the next build, not when it replaces this name
        free()
    return rows


def gemv_shapes(cfg) -> list[tuple[str, int, int, str]]:
    """(name, N, K, prologue) of each decoder projection and the LM head of `cfg`."""
    H, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return [("qkv_proj", q + 2 * kv, H, "norm"), ("o_proj", H, q, "none"),
            ("gate_up_proj", 2 * cfg.intermediate_size, H, "norm"),
            ("down_proj", H, cfg.intermediate_size, "silu"), ("lm_head", cfg.vocab_size, H, "none")]


def sweep_gemv(cfg, dev: torch.device) -> dict:
    """One-row GEMV at each decoder weight shape of `cfg`, bf16 and FP8 (128 x 128 blocks),
    each called as the decoder calls it: bench.lab.bench_gemv.one_row_sweep (the one-row
    kernel over its tiles, the former 1..4-row kernel, the default tile, the error)."""
    from bench.lab.bench_gemv import one_row_sweep

    out: dict = {}
    for fmt in ("fp8", "bf16"):
        for name, N, K, prologue in gemv_shapes(cfg):
            if name == "lm_head" and fmt == "fp8":  # the LM head stays bf16
                continue
            out[f"{fmt}_{name}"] = row = one_row_sweep(name, N, K, prologue, fmt, dev)
            log(f"gemv {fmt} {name}: default {row['default']} best {row['best']} "
                f"{row['tiles'][row['best']]}")
            free()
    return out


def summary(result: dict) -> dict:
    s: dict = {}
    fmts = result.get("formats", {})
    b1 = {f: r["decode_batch1"] for f, r in fmts.items() if "decode_batch1" in r}
    if "bf16" in b1:
        s["bf16_batch1_pct_of_roofline"] = {"value": b1["bf16"]["pct_of_roofline"],
                                            "target": ">= 92"}
    if "fp8" in b1:
        s["fp8_batch1_pct_of_roofline"] = {"value": b1["fp8"]["pct_of_roofline"],
                                           "target": ">= 85"}
        if "bf16" in b1:
            s["fp8_over_bf16_batch1"] = b1["fp8"]["tok_s"] / b1["bf16"]["tok_s"]
    for f, r in fmts.items():
        for t in r.get("ttft", []):
            s[f"{f}_ttft_{t['prompt']}_s"] = t["ttft_s"]
        for t in r.get("decode_throughput", []):
            s[f"{f}_batch{t['batch']}_tok_s"] = t["tok_s"]
    if "mtp_forced" in result:
        s["mtp_speedups"] = {k: v["speedup"] for k, v in result["mtp_forced"].items()
                             if "speedup" in v}
    return s


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-8b", choices=sorted(PLANS))
    ap.add_argument("--out", default=None, help="JSON file to write")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test on tiny presets")
    ap.add_argument("--tiny-preset", default="tiny-qwen3", help="with --tiny")
    ap.add_argument("--skip-sweep", action="store_true", help="leave out the GEMV tile sweep")
    ap.add_argument("--sweep-only", action="store_true", help="only the GEMV tile sweep")
    ap.add_argument("--gemv-stages", action="store_true",
                    help="first time pipelined one-row GEMV tiles (bench_gemv.stage_sweep) "
                         "and install the winners for this run's engines")
    ap.add_argument("--batch1-only", action="store_true",
                    help="dense models: batch-1 decode only (no TTFT, no batched throughput)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    plan = PLANS[args.model] if cuda else dataclasses.replace(TINY, preset=args.tiny_preset)
    dev = torch.device(plan.device)
    result: dict = {"device": torch.cuda.get_device_name(dev) if cuda else "cpu",
                    "command": " ".join([sys.executable, "-m", "bench.lab.bench_fp8"] + sys.argv[1:]),
                    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                    "versions": _versions(), "plan": dataclasses.asdict(plan), "formats": {}}

    def save() -> None:
        result["summary"] = summary(result)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2, default=str)

    log(f"device {result['device']}; model {plan.preset}")
    rates = result["device_rates"] = device_rates(plan, dev)
    log(f"copy {rates['copy_GBps']:.0f} GB/s, bf16 matmul {rates['matmul_bf16_TFLOPs']:.0f} TFLOP/s")
    save()
    if cuda and args.model == "qwen3-8b" and not args.skip_sweep:
        result["gemv_sweep"] = sweep_gemv(get_preset(plan.preset), dev)
        save()
        if args.sweep_only:
            return
    if cuda and args.gemv_stages:
        from bench.lab.bench_gemv import apply_stage_sweep, stage_sweep

        result["gemv_stages"] = stage_sweep(gemv_shapes(get_preset(plan.preset)), dev, log)
        result["gemv_applied"] = apply_stage_sweep(result["gemv_stages"], dev)
        log(f"one-row tiles installed for this run: {result['gemv_applied']}")
        free()
        save()
    for fmt in FORMATS.get(args.model, ("bf16", "fp8")) if cuda else ("bf16", "fp8"):
        out = result["formats"].setdefault(fmt, {})
        try:
            run_format(plan, "fp8" if fmt == "fp8" else None, rates, out, save,
                       args.batch1_only)
        except Exception as e:  # keep what was measured; the next format still runs
            out["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            log(f"[{fmt}] failed: {out['error']}")
            free()
        save()
    if args.model == "glm-4.5-air" or not cuda:
        mplan = plan if cuda else dataclasses.replace(plan, preset="tiny-glm4-moe")
        try:
            result["mtp_forced"] = run_mtp(mplan, (1, 3))
        except Exception as e:
            result["mtp_error"] = f"{type(e).__name__}: {str(e)[:500]}"
            log(f"MTP failed: {result['mtp_error']}")
    save()
    print(json.dumps(result["summary"], indent=2))


if __name__ == "__main__":
    main()

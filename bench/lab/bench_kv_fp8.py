"""FP8 KV cache benchmark (issue 23): pool capacity and attention kernel speed, FP8 vs bf16.

    python -m bench.lab.bench_kv_fp8 --out bench/results/kv_fp8_h200_<date>.json
    python -m bench.lab.bench_kv_fp8 --tiny --out /tmp/kv_fp8_tiny.json   # CPU smoke test

For a Qwen3-8B-shaped cache (36 layers, 8 KV heads, head_dim 128, 32 query heads, block 16):
- capacity: bytes per block (the fp8 block includes its scale layer) and how many 8K-token
  sequences fit in the KV pool left after the bf16 weights (pool = --pool-gib);
- per layer, the batch-1 fused decode kernel (QK-norm + RoPE + quantize-on-write + split-K
  attention, one kernel) and the batched decode attention at batch 1, 64 and 256 with 4K
  contexts, and batch 1 at 32K, FP8 vs bf16 in the same run. 36 layers x the per-layer time
  is the attention part of a decode step; the FP8 / bf16 ratio at 256 x 4K is where the
  halved KV read pays.
Engine-level decode throughput (256 x 4K, FP8 vs bf16 KV in the same run) is
bench/lab/bench_kv_fp8_engine.py; this script times the kernels that change.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from dataclasses import dataclass

import torch

from pdserve.kernels.triton_mode import select_triton_mode  # noqa: E402

select_triton_mode()
from pdserve.engine.core.config import ModelConfig
from pdserve.engine.exec.kv_cache import allocate_kv_cache, layer_views
from pdserve.engine.model.attention import write_kv
from pdserve.kernels.decode_attention import (
    Prologue,
    fused_decode_attention,
    paged_decode_attention,
)
from pdserve.kernels.kv_quant import FP8


@dataclass(frozen=True)
class Plan:
    layers: int = 36
    hq: int = 32
    hkv: int = 8
    d: int = 128
    block: int = 16
    cases: tuple[tuple[int, int], ...] = ((1, 4096), (64, 4096), (256, 4096), (1, 32768))
    capacity_ctx: int = 8192
    iters: int = 50


TINY = Plan(layers=2, hq=4, hkv=2, d=32, block=4, cases=((1, 40), (3, 33)), capacity_ctx=64,
            iters=1)


def model_config(p: Plan) -> ModelConfig:
    return ModelConfig(arch="qwen3", vocab_size=8, hidden_size=p.hq * p.d, num_layers=p.layers,
                       num_heads=p.hq, num_kv_heads=p.hkv, head_dim=p.d, intermediate_size=8)


def capacity(p: Plan, pool_bytes: int) -> dict:
    out = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp8", FP8)):
        one = allocate_kv_cache(model_config(p), 1, p.block, dtype, "meta")
        block_bytes = one.numel() * one.element_size()
        blocks = pool_bytes // block_bytes
        out[name] = {"block_bytes": block_bytes, "blocks": blocks,
                     "seqs_at_ctx": blocks // -(-p.capacity_ctx // p.block)}
    out["fp8_over_bf16"] = out["fp8"]["seqs_at_ctx"] / max(1, out["bf16"]["seqs_at_ctx"])
    return out


def time_ms(fn, iters: int, dev: torch.device) -> float:
    fn()  # compile / warm
    if dev.type != "cuda":
        return float("nan")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def layer_case(p: Plan, batch: int, ctx: int, dtype: torch.dtype, dev: torch.device) -> dict:
    """One layer's decode attention over `batch` sequences of `ctx` tokens."""
    per_seq = -(-(ctx + 1) // p.block)
    cfg = model_config(Plan(layers=1, hq=p.hq, hkv=p.hkv, d=p.d, block=p.block))
    kv = allocate_kv_cache(cfg, batch * per_seq, p.block, dtype, dev)
    views = layer_views(kv, 0)
    g = torch.Generator(device=dev).manual_seed(0)
    rows = torch.randn(batch * per_seq * p.block, p.hkv, p.d, device=dev, generator=g)
    slots = torch.arange(rows.shape[0], device=dev)
    write_kv(rows, rows, views.k, views.v, slots, views.scales)  # torch reference write
    del rows
    bt = torch.arange(batch * per_seq, dtype=torch.int32, device=dev).view(batch, per_seq)
    lens = torch.full((batch,), ctx + 1, dtype=torch.int32, device=dev)
    act = torch.bfloat16 if dev.type == "cuda" else torch.float32
    q = torch.randn(batch, p.hq, p.d, device=dev, generator=g).to(act)
    k, v = (torch.randn(batch, p.hkv, p.d, device=dev, generator=g).to(act) for _ in range(2))
    ang = torch.rand(batch, p.d // 2, device=dev, generator=g)
    pro = Prologue(k, v, ang.cos(), ang.sin(),
                   bt[:, ctx // p.block].long() * p.block + ctx % p.block)
    sc = views.scales
    fused = time_ms(lambda: fused_decode_attention(q, pro, views.k, views.v, bt, lens,
                                                   p.d ** -0.5, kv_scales=sc), p.iters, dev)
    plain = time_ms(lambda: paged_decode_attention(q, views.k, views.v, bt, lens, p.d ** -0.5,
                                                   kv_scales=sc), p.iters, dev)
    kv_bytes = batch * (ctx + 1) * p.hkv * p.d * 2 * kv.element_size()
    return {"fused_ms": fused, "attn_ms": plain, "kv_bytes": kv_bytes,
            "attn_gbps": kv_bytes / plain / 1e6 if plain == plain else None}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on CPU (interpreter)")
    ap.add_argument("--pool-gib", type=float, default=110.0, help="KV pool for the capacity")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    plan = TINY if args.tiny else Plan()
    dev = torch.device("cpu" if args.tiny else "cuda")
    result: dict = {"date": datetime.date.today().isoformat(), "command": " ".join(sys.argv),
                    "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                    "torch": torch.__version__, "plan": plan.__dict__,
                    "capacity": capacity(plan, int(args.pool_gib * 2**30)), "layers": []}
    for batch, ctx in plan.cases:
        row: dict = {"batch": batch, "ctx": ctx}
        act = torch.bfloat16 if dev.type == "cuda" else torch.float32  # "bf16": float on CPU
        for name, dtype in (("bf16", act), ("fp8", FP8)):
            row[name] = layer_case(plan, batch, ctx, dtype, dev)
            torch.cuda.empty_cache() if dev.type == "cuda" else None
        b, f = row["bf16"], row["fp8"]
        row["attn_speedup"] = b["attn_ms"] / f["attn_ms"] if dev.type == "cuda" else None
        row["fused_speedup"] = b["fused_ms"] / f["fused_ms"] if dev.type == "cuda" else None
        result["layers"].append(row)
        print(json.dumps(row), flush=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=2, default=str)
    print(json.dumps(result["capacity"], indent=2))


if __name__ == "__main__":
    main()

"""kernels/gemv_chain.py against the three one-row GEMVs it replaces (GPU).

    python -m bench.lab.bench_chain [--dtype fp8|bf16] [--shape qwen3-8b] [--out F.json]

A preset's shapes (Qwen3-8B: o_proj 4096 x 4096, gate_up 24576 x 4096, down 4096 x 12288),
random weights, one set per layer (Qwen3-8B's 36: 6 GB in FP8, far past L2), each layer's
tail as one
chain launch or as three GEMV launches, all PDL-chained in one CUDA graph. Prints and writes
the time per layer of each variant (median of the rounds, variants timed in turn) and the
bandwidth it reaches on the weight bytes, with the chain kernel's registers per thread.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from pdserve.kernels import gemv_chain as chain_mod
from pdserve.kernels.fp8_scales import FP8_DTYPE
from pdserve.kernels.gemv import gemv
from pdserve.kernels.gemv_chain import ChainConfig, ChainWeight, gemv_chain

# (hidden D, attention width KO, intermediate I, layers) of the presets' shapes
SHAPES = {"qwen3-8b": (4096, 4096, 12288, 36), "qwen3-4b": (2560, 4096, 9728, 36),
          "qwen3-0.6b": (1024, 2048, 3072, 28), "smollm2-135m": (576, 576, 1536, 30)}
D, KO, I = SHAPES["qwen3-8b"][:3]
CC = ChainConfig
VARIANTS = {"chain": CC(), "ch_all4x2k": CC((4, 2048), (4, 2048), (4, 2048)),
            "ch_dn8x1k": CC(down=(8, 1024)), "ch_4x1k": CC((4, 1024), (8, 1024), (4, 1024)),
            "ch_all8x1k": CC((8, 1024), (8, 1024), (8, 1024)),
            "ch_all4x2k_ps5": CC((4, 2048), (4, 2048), (4, 2048), per_sm=5)}


def _weight(n: int, k: int, fp8: bool) -> ChainWeight:
    w = torch.randn(n, k, device="cuda") / k ** 0.5
    if not fp8:
        return ChainWeight(w.to(torch.bfloat16))
    s = torch.rand(-(-n // 128), -(-k // 128), device="cuda") * 0.01 + 0.001
    w8 = (torch.randn(n, k, device="cuda") * 64).clamp(-448, 448).to(FP8_DTYPE)
    return ChainWeight(w8, s, (128, 128))


def build(layers: int, fp8: bool) -> list[tuple[ChainWeight, ChainWeight, ChainWeight]]:
    out = []
    for i in range(layers):
        out.append((_weight(D, KO, fp8), _weight(2 * I, D, fp8), _weight(D, I, fp8)))
        print(f"\rweights: layer {i + 1}/{layers}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return out


def unfused(a, res, nw, w):
    o, gu, dn = w
    h = gemv(a, o.weight, add=res, prefetch=True, scales=o.scales, block=o.block)
    g, _ = gemv(h, gu.weight, "norm", norm_weight=nw, eps=1e-6, scales=gu.scales, block=gu.block)
    return gemv(g, dn.weight, "silu", add=h, scales=dn.scales, block=dn.block)


def capture(fn):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def time_graph(g: torch.cuda.CUDAGraph, reps: int = 20) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="fp8", choices=("fp8", "bf16"))
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    global D, KO, I
    D, KO, I, args.layers = SHAPES[args.shape]
    fp8 = args.dtype == "fp8"
    ws = build(args.layers, fp8)
    a = torch.randn(1, KO, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(1, D, device="cuda", dtype=torch.bfloat16)
    nw = torch.ones(D, device="cuda", dtype=torch.bfloat16)
    graphs = {"three_gemvs": capture(lambda: [unfused(a, res, nw, w) for w in ws])}
    for name in filter(None, args.variants.split(",")):
        cfg = VARIANTS[name]
        graphs[name] = capture(lambda cfg=cfg: [gemv_chain(a, res, nw, 1e-6, *w, slot=i, config=cfg)
                                                for i, w in enumerate(ws)])
    # the chain's output equals the unfused GEMVs' (same math, other summation order)
    y_ref = unfused(a, res, nw, ws[0])
    y, _ = gemv_chain(a, res, nw, 1e-6, *ws[0], slot=0)
    err = ((y.float() - y_ref.float()).abs().max() / y_ref.float().abs().max()).item()
    times: dict[str, list[float]] = {k: [] for k in graphs}
    for _ in range(args.rounds):
        for k, g in graphs.items():
            times[k].append(time_graph(g))
    nbytes = sum(w.weight.numel() * w.weight.element_size() for w in ws[0])
    results = {}
    for k, t in times.items():
        ms = sorted(t)[len(t) // 2]
        us = ms * 1e3 / args.layers
        results[k] = {"ms": ms, "us_per_layer": us, "tb_s": nbytes / us / 1e6, "rounds_ms": t}
        print(f"{k:16s} {us:7.2f} us/layer  {nbytes / us / 1e6:.2f} TB/s", flush=True)
    out = {"device": torch.cuda.get_device_name(), "dtype": args.dtype, "shape": args.shape,
           "layers": args.layers,
           "weight_bytes_per_layer": nbytes, "chain_vs_unfused_rel_err": err,
           "chain_regs_shared_spills": {str(k[1:]): v for k, v in chain_mod.COMPILED.items()},
           "results": results,
           "command": "python -m bench.lab.bench_chain " + " ".join(sys.argv[1:]),
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    print(json.dumps({k: out[k] for k in ("chain_vs_unfused_rel_err", "chain_regs_shared_spills")}))
    if args.out:
        json.dump(out, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()

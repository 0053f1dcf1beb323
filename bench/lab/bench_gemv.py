"""Tile sweep of kernels.gemv at Qwen3-8B's decode projections, next to cuBLAS:
`python -m bench.lab.bench_gemv [--out F]` (needs CUDA; prints JSON, progress on stderr).

Each timing replays a CUDA graph that runs the kernel over several distinct copies of the
weight, so no copy is still in L2 (50 MB on an H100) when it is read again -- as in a real
decode step, where ~15 GB of other weights pass between two reads of one matrix.
GB/s counts weight bytes only (the activations are a few KB).
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time

import torch

from bench.lab.kernel_bench import emit

# (name, N, K, prologue): Qwen3-8B; lm_head has the shape of the tied/untied output matrix
SHAPES = [("qkv_proj", 6144, 4096, "norm"), ("o_proj", 4096, 4096, "none"),
          ("gate_up_proj", 24576, 4096, "norm"), ("down_proj", 4096, 12288, "silu"),
          ("lm_head", 151936, 4096, "none")]
MIN_BYTES = 256 << 20  # weight copies per timing: at least this much, to defeat L2


def _graph_us(fn, copies: int) -> float:
    from triton.testing import do_bench_cudagraph

    fn()
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=60) * 1e3 / copies


def _setup(N: int, K: int, T: int, prologue: str):
    k_in = 2 * K if prologue == "silu" else K
    copies = max(1, -(-MIN_BYTES // (N * K * 2)))
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
          for _ in range(copies)]
    x = torch.randn(T, k_in, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    nw = torch.ones(K, device="cuda", dtype=torch.bfloat16)
    return ws, x, res, nw


def _time_config(ws, x, res, nw, prologue: str, cfg) -> float:
    from pdserve.kernels.ops import gemv

    kw = {"residual": res, "norm_weight": nw} if prologue == "norm" else {}
    return _graph_us(lambda: [gemv(x, w, prologue, config=cfg, **kw) for w in ws], len(ws))


def _candidates(T: int, more_warps: bool = False) -> list:
    """T = 1 (CUDA-core kernel): a grid of tiles with <= 64 fp32 accumulators per thread.
    T > 1 (tensor-core kernel): output widths, K steps, pipeline depths and K splits."""
    from pdserve.kernels.gemv import GemvConfig

    if T == 1:
        grid = itertools.product((2, 4, 8, 16, 32), (256, 512, 1024), (4, 8))
        return [GemvConfig(bn, bk, w, 1) for bn, bk, w in grid
                if bn * bk <= 2048 * w and bn * bk >= 1024]
    if more_warps:  # wider tiles on 8 warps, deeper pipelines
        grid = itertools.product((32, 64, 128), (128, 256), (3, 4, 5), (1, 2))
        return [GemvConfig(bn, bk, w, st, tensor_cores=True, split_k=sk)
                for bn, bk, st, sk in grid for w in (4, 8) if bn * bk * st <= 64 * 256 * 5]
    grid = itertools.product((16, 32, 64), (128, 256), (3, 4), (1, 2, 4))
    deep = itertools.product((16, 32), (512,), (2, 3), (1, 2))
    return [GemvConfig(bn, bk, 4, st, tensor_cores=True, split_k=sk)
            for bn, bk, st, sk in itertools.chain(grid, deep)]


def sweep_shape(name: str, N: int, K: int, prologue: str, T: int,
                more_warps: bool = False) -> dict:
    """Time every candidate tile (and 2-3 pipeline stages on the best three when T = 1);
    returns the JSON row."""
    from pdserve.kernels.gemv import GemvConfig, pick_config

    ws, x, res, nw = _setup(N, K, T, prologue)
    nbytes = N * K * 2
    rows = [(_time_config(ws, x, res, nw, prologue, c), c) for c in _candidates(T, more_warps)
            if -(-N // c.block_n) * c.split_k >= 132]
    rows.sort(key=lambda r: r[0])
    if T == 1:
        for _, cfg in list(rows[:3]):
            for stages in (2, 3):
                staged = GemvConfig(cfg.block_n, cfg.block_k, cfg.num_warps, stages)
                rows.append((_time_config(ws, x, res, nw, prologue, staged), staged))
        rows.sort(key=lambda r: r[0])
    heur = pick_config(N, K, T)
    heur_us = _time_config(ws, x, res, nw, prologue, heur)
    xin = x if prologue != "silu" else x[:, :K]
    cublas_us = _graph_us(lambda: [torch.nn.functional.linear(xin, w) for w in ws], len(ws))
    best_us, best = rows[0]
    out = {"name": name, "N": N, "K": K, "T": T, "prologue": prologue,
           "best": vars(best) | {"us": round(best_us, 2), "GBps": round(nbytes / best_us / 1e3)},
           "heuristic": vars(heur) | {"us": round(heur_us, 2),
                                      "GBps": round(nbytes / heur_us / 1e3)},
           "cublas_matmul_only": {"us": round(cublas_us, 2),
                                  "GBps": round(nbytes / cublas_us / 1e3)},
           "top5": [vars(c) | {"us": round(u, 2)} for u, c in rows[:5]]}
    del ws
    torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--rows", default="1,2,4", help="T values (comma-separated)")
    parser.add_argument("--only", default="", help="projection names (comma-separated)")
    parser.add_argument("--more-warps", action="store_true",
                        help="tensor-core grid of 4/8 warps, wider tiles, 3-5 stages")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.lab.bench_gemv needs a CUDA device")
    t0, results = time.time(), []
    rows = [int(t) for t in args.rows.split(",")]
    only = set(filter(None, args.only.split(",")))
    for name, N, K, prologue in SHAPES:
        if only and name not in only:
            continue
        for T in rows:
            row = sweep_shape(name, N, K, prologue, T, args.more_warps)
            results.append(row)
            print(f"[{time.time() - t0:5.0f}s] T={T} {name}: best {row['best']} heuristic "
                  f"{row['heuristic']['GBps']} GB/s, cuBLAS {row['cublas_matmul_only']['GBps']}",
                  file=sys.stderr, flush=True)
    emit({"device": torch.cuda.get_device_name(), "command": " ".join(sys.argv),
          "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "results": results}, args.out)


if __name__ == "__main__":
    main()

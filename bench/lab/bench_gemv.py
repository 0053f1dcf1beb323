"""Tile sweep of kernels.gemv at Qwen3-8B's decode projections, next to cuBLAS:
`python -m bench.lab.bench_gemv [--out F]` (needs CUDA; prints JSON, progress on stderr).

`--one-row`: batch 1 only, bf16 and FP8 (128 x 128 blocks) weights, each projection called as
the decoder calls it (qkv: norm + residual; o: residual add + L2 prefetch; gate_up: norm;
down: SiLU + residual add; LM head bf16 only): the one-row kernel (kernels/gemv_row.py) over
ONE_ROW_TILES, the 1..4-row kernel at its former H100 tile (one_row=False: the "before"),
the current pick_config default, and the error against kernels.reference (see one_row_sweep).

Each timing replays a CUDA graph that runs the kernel over several distinct copies of the
weight, so no copy is still in L2 (50 MB on an H100) when it is read again -- as in a real
decode step, where ~15 GB of other weights pass between two reads of one matrix.
GB/s counts weight bytes only (the activations are a few KB).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import torch

from bench.lab.kernel_bench import emit

# (name, N, K, prologue): Qwen3-8B; lm_head has the shape of the tied/untied output matrix
SHAPES = [("qkv_proj", 6144, 4096, "norm"), ("o_proj", 4096, 4096, "none"),
          ("gate_up_proj", 24576, 4096, "norm"), ("down_proj", 4096, 12288, "silu"),
          ("lm_head", 151936, 4096, "none")]
MIN_BYTES = 256 << 20  # weight copies per timing: at least this much, to defeat L2
MIN_PROGRAMS = 132  # --one-row: tiles leaving fewer programs than SMs are skipped


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


# one-row tiles timed by --one-row: (block_n, block_k, num_warps)
ONE_ROW_TILES = {
    "bf16": ((4, 1024, 4), (8, 1024, 4), (2, 2048, 4), (4, 2048, 4), (8, 2048, 8),
             (16, 1024, 8)),
    "fp8": ((4, 1024, 4), (8, 1024, 4), (16, 1024, 4), (4, 2048, 4), (8, 2048, 4),
            (16, 2048, 8), (32, 1024, 8), (8, 4096, 8)),
}
# how DecoderLayer._forward_gemv calls each projection: (residual in, residual add, prefetch)
CALLS = {"qkv_proj": (True, False, False), "o_proj": (False, True, True),
         "gate_up_proj": (False, False, False), "down_proj": (False, True, False),
         "lm_head": (False, False, False)}


def _one_row_inputs(name: str, N: int, K: int, prologue: str, fmt: str, dev) -> dict:
    """Weight copies (> MIN_BYTES together; FP8 with random 128 x 128 block scales) and the
    call's other inputs, all random."""
    from pdserve.kernels.fp8_scales import FP8_DTYPE

    esize = 1 if fmt == "fp8" else 2
    copies = max(2, -(-MIN_BYTES // (N * K * esize)))
    ws = []
    for _ in range(copies):
        if fmt == "fp8":
            w = (torch.randn(N, K, device=dev) * 64).clamp(-448, 448).to(FP8_DTYPE)
            s = (torch.rand(-(-N // 128), -(-K // 128), device=dev) + 0.5) / (64 * K ** 0.5)
            ws.append((w, {"scales": s, "block": (128, 128)}))
        else:
            ws.append((torch.randn(N, K, device=dev, dtype=torch.bfloat16) / K ** 0.5, {}))
    has_res, has_add, prefetch = CALLS[name]
    bf = torch.bfloat16
    kw = {}
    if prologue == "norm":
        kw["norm_weight"] = (torch.rand(K, device=dev) + 0.5).to(bf)
        kw["residual"] = torch.randn(1, K, device=dev, dtype=bf) if has_res else None
    if has_add:
        kw["add"] = torch.randn(1, N, device=dev, dtype=bf)
    x = torch.randn(1, 2 * K if prologue == "silu" else K, device=dev, dtype=bf)
    return {"ws": ws, "x": x, "kw": kw, "prefetch": prefetch, "esize": esize}


def _rel_err(inp: dict, prologue: str, cfg) -> float:
    """|y - ref| / |ref| of the first copy against kernels.reference (fp32 math)."""
    from pdserve.kernels.ops import gemv
    from pdserve.kernels.reference import fp8_dequant_ref, gemv_ref

    w, fp8 = inp["ws"][0]
    wd = fp8_dequant_ref(w, fp8["scales"], fp8["block"]) if fp8 else w
    y = gemv(inp["x"], w, prologue, config=cfg, **inp["kw"], **fp8)
    ref = gemv_ref(inp["x"], wd, prologue, **inp["kw"])
    y, ref = (y[0], ref[0]) if prologue == "norm" else (y, ref)
    return float((y.float() - ref.float()).norm() / ref.float().norm())


def one_row_sweep(name: str, N: int, K: int, prologue: str, fmt: str, dev,
                  tiles: tuple | None = None, shares: tuple = (), legacy: bool = True) -> dict:
    """One projection, one weight format: microseconds and weight GB/s per tile (tiles:
    (block_n, block_k, warps[, stages]), default ONE_ROW_TILES[fmt]), the default tile with each L2
    prefetch share in `shares`, and (legacy) the 1..4-row kernel at its former tile."""
    from dataclasses import replace

    from pdserve.kernels.gemv import PREFETCH_SHARE, GemvConfig, pick_config
    from pdserve.kernels.ops import gemv

    inp = _one_row_inputs(name, N, K, prologue, fmt, dev)
    nbytes = N * K * inp["esize"]

    def run(cfg, share: float | None = None) -> dict:
        if share is None:
            share = PREFETCH_SHARE if inp["prefetch"] else 0.0
        cfg = replace(cfg, l2_prefetch=share)
        us = _graph_us(lambda: [gemv(inp["x"], w, prologue, config=cfg, **inp["kw"], **fp8)
                                for w, fp8 in inp["ws"]], len(inp["ws"]))
        return {"us": round(us, 2), "GBps": round(nbytes / us / 1e3)}

    default = pick_config(N, K, 1, inp["esize"], inp["prefetch"], dev)
    row: dict = {"N": N, "K": K, "fmt": fmt, "prologue": prologue, "copies": len(inp["ws"]),
                 "weight_bytes": nbytes,
                 "default": run(default) | {"tile": [default.block_n, default.block_k,
                                                     default.num_warps, default.num_stages]},
                 "tiles": {}, "prefetch": {f"{sh}": run(default, sh) for sh in shares}}
    if legacy:
        bn = 8 if fmt == "fp8" or N * K >= (32 << 20) else 4
        old = GemvConfig(bn, 1024, 4, one_row=False)  # the kernel and tile before
        row["legacy"] = run(old) | {"tile": [bn, 1024, 4]}
        row["rel_err_legacy"] = _rel_err(inp, prologue, old)
    for tile in ONE_ROW_TILES[fmt] if tiles is None else tiles:
        bn, bk, warps, stages = (*tile, 1)[:4]
        if -(-N // bn) >= MIN_PROGRAMS:
            key = f"{bn}x{bk}w{warps}" + (f"s{stages}" if stages > 1 else "")
            try:  # a tile beyond shared memory spoils nothing
                row["tiles"][key] = run(GemvConfig(bn, bk, warps, stages))
            except Exception as e:
                row["tiles"][key] = {"us": float("inf"), "error": f"{type(e).__name__}: {e}"[:200]}
    row["best"] = min(row["tiles"], key=lambda k: row["tiles"][k]["us"], default="")
    row["rel_err_default"] = _rel_err(inp, prologue, default)
    if fmt == "bf16":
        xin = inp["x"][:, :K]
        us = _graph_us(lambda: [torch.nn.functional.linear(xin, w) for w, _ in inp["ws"]],
                       len(inp["ws"]))
        row["cublas_matmul_only"] = {"us": round(us, 2), "GBps": round(nbytes / us / 1e3)}
    del inp
    torch.cuda.empty_cache()
    return row


def copy_gbps() -> float:
    """Device-to-device copy of 1 GiB of random fp32: bytes read + written per second / 1e9."""
    from triton.testing import do_bench

    x = torch.randn(1 << 28, device="cuda")
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), rep=200, return_mode="median")
    return 2 * x.numel() * 4 / ms / 1e6


# --one-row --extra: more tiles for the small matrices, L2 prefetch shares of the default
# tile for the projections the decoder does not prefetch, and o_proj-like calls at growing N
EXTRA_TILES = ((2, 4096, 4), (4, 4096, 4), (4, 4096, 8), (2, 2048, 4), (8, 2048, 8),
               (16, 1024, 8))
EXTRA_SHARES = (0.25, 1.0)
SCALING_N = (1024, 2048, 4096, 8192, 16384)


def extra_one_row(out: dict, path: str | None, dev) -> None:
    results = out["results"]
    for fmt in ("fp8", "bf16"):
        for name, N, K, prologue in SHAPES[:4]:
            shares = () if CALLS[name][2] else EXTRA_SHARES
            results[f"extra_{fmt}_{name}"] = row = one_row_sweep(
                name, N, K, prologue, fmt, dev, EXTRA_TILES, shares, legacy=False)
            print(f"{fmt} {name}: default {row['default']} prefetch {row['prefetch']} best "
                  f"{row['best']} {row['tiles'].get(row['best'])}", file=sys.stderr, flush=True)
    for fmt in ("fp8", "bf16"):
        pts = []
        for n in SCALING_N:
            row = one_row_sweep("o_proj", n, 4096, "none", fmt, dev, (), legacy=False)
            pts.append((row["weight_bytes"], row["default"]["us"], row["default"]["tile"]))
        b, a = _fit(pts)
        results[f"scaling_{fmt}_o_proj"] = {"points": pts, "fixed_us": a, "GBps_marginal": b}
        print(f"{fmt} o_proj scaling: {pts}; time = {a:.2f} us + bytes / {b:.0f} GB/s",
              file=sys.stderr, flush=True)
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


# the K loop pipelined through shared memory (GemvConfig.num_stages > 1, kernels/gemv_row.py)
STAGE_TILES = {
    "fp8": tuple((*t, s) for t in ((4, 2048, 4), (8, 1024, 4), (16, 1024, 4), (16, 2048, 8),
                                   (8, 2048, 4)) for s in (2, 3, 4)),
    "bf16": tuple((*t, s) for t in ((4, 1024, 4), (8, 1024, 4), (4, 2048, 4), (16, 1024, 8),
                                    (8, 2048, 8)) for s in (2, 3)),
}
WIN_MARGIN = 0.97  # a tile replaces the default only when >= 3% faster (repeat spread ~3%)


def stage_sweep(shapes: list, dev, log=print) -> dict:
    """STAGE_TILES at each (name, N, K, prologue) of `shapes` (bf16 and FP8; no FP8 LM
    head): one_row_sweep rows, keyed "{fmt}_{name}"."""
    out: dict = {}
    for fmt in ("fp8", "bf16"):
        for name, N, K, prologue in shapes:
            if fmt == "fp8" and name == "lm_head":
                continue
            out[f"{fmt}_{name}"] = row = one_row_sweep(name, N, K, prologue, fmt, dev,
                                                       STAGE_TILES[fmt], legacy=False)
            log(f"stages {fmt} {name}: default {row['default']} best {row['best']} "
                f"{row['tiles'].get(row['best'])}")
    return out


def apply_stage_sweep(sweep: dict, dev) -> dict:
    """Install each shape's winner (>= 3% under the default) in this process's one-row tile
    tables (kernels.gemv DEVICE_TILES / FP8_DEVICE_TILES) for the benchmark that follows;
    returns the entries installed (what the committed tables should then hold)."""
    from pdserve.kernels import gemv

    name = torch.cuda.get_device_name(dev)
    frag = "H200" if "H200" in name else name
    applied: dict = {"device_fragment": frag}
    for key, row in sweep.items():
        best = row["tiles"].get(row["best"], {})
        if best.get("us", float("inf")) < WIN_MARGIN * row["default"]["us"]:
            bn, bk, rest = row["best"].split("x")[0], *row["best"].split("x")[1].split("w")
            warps, _, stages = rest.partition("s")
            tile = (int(bn), int(bk), int(warps), int(stages or 1))
            table = gemv.FP8_DEVICE_TILES if row["fmt"] == "fp8" else gemv.DEVICE_TILES
            table.setdefault(frag, {})[(row["N"], row["K"])] = tile
            applied[key] = {"tile": tile, "us": best["us"], "default_us": row["default"]["us"]}
    return applied


def _fit(pts: list) -> tuple[float, float]:
    """Least squares us = a + bytes / (b GB/s) over (bytes, us, ...) points: (b, a)."""
    n = len(pts)
    xs, ys = [p[0] / 1e3 for p in pts], [p[1] for p in pts]  # kB (-> us at GB/s) and us
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return (1 / slope if slope > 0 else float("inf")), my - slope * mx


def main_one_row(args) -> None:
    t0, results = time.time(), {}
    only = set(filter(None, args.only.split(",")))
    dev = torch.device("cuda")
    out = {"device": torch.cuda.get_device_name(), "command": " ".join(sys.argv),
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "copy_GBps": round(copy_gbps()),
           "results": results}
    if args.extra:
        return extra_one_row(out, args.out, dev)
    for fmt in ("fp8", "bf16"):
        for name, N, K, prologue in SHAPES:
            if (only and name not in only) or (fmt == "fp8" and name == "lm_head"):
                continue
            row = one_row_sweep(name, N, K, prologue, fmt, dev)
            results[f"{fmt}_{name}"] = row
            print(f"[{time.time() - t0:5.0f}s] {fmt} {name}: legacy {row['legacy']['us']} us, "
                  f"default {row['default']['us']} us, best {row['best']} "
                  f"{row['tiles'][row['best']]} err {row['rel_err_default']:.1e}",
                  file=sys.stderr, flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(out, f, indent=1)
    for key, row in results.items():  # the table last: the device reply keeps the tail
        best = row["tiles"][row["best"]]
        print(f"{key:18s} legacy {row['legacy']['us']:7.2f} us {row['legacy']['GBps']:5d} GB/s"
              f" | default {row['default']['tile']} {row['default']['us']:7.2f} us"
              f" {row['default']['GBps']:5d} | best {row['best']} {best['us']:7.2f} us"
              f" {best['GBps']:5d} | err {row['rel_err_default']:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--one-row", action="store_true",
                        help="batch-1 bf16 and FP8 sweep of the one-row kernel (see doc)")
    parser.add_argument("--extra", action="store_true",
                        help="with --one-row: extra tiles, L2 prefetch, o_proj scaling")
    parser.add_argument("--rows", default="1,2,4", help="T values (comma-separated)")
    parser.add_argument("--only", default="", help="projection names (comma-separated)")
    parser.add_argument("--more-warps", action="store_true",
                        help="tensor-core grid of 4/8 warps, wider tiles, 3-5 stages")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.lab.bench_gemv needs a CUDA device")
    if args.one_row:
        return main_one_row(args)
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

"""Does the FP8 one-row GEMV lose bandwidth to 8-byte weight loads? (GPU)

    python -m bench.lab.probe_fp8_vec [--out F.json]

The one-row kernel (kernels/gemv_row.py) gives each thread VEC = 8 consecutive K columns, so
that a bf16 activation load and the weight load share one register layout. For FP8 weights
that is an 8-byte load per thread per row (LDG.64), half the bf16 kernel's 16 bytes. Two
measurements at Qwen3-8B's FP8 shapes, each timed over enough weight copies to defeat L2:
  1. a read-only kernel with the GEMV's tiles and grid (load, e4m3 -> fp32, row sums), VEC 8
     and 16: what the load width alone costs;
  2. the real kernel at its default tile with GemvConfig.vec 8 (default) and 16 (where the
     activation, loaded 8 per thread, goes through shared memory to the weight's layout).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

import torch
import triton
import triton.language as tl

from bench.lab.bench_gemv import SHAPES, _graph_us, _one_row_inputs, _rel_err, copy_gbps


@triton.jit
def _read_kernel(w_ptr, y_ptr, N, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 VEC: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k0 = tl.arange(0, BLOCK_K)
    rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_w
    acc = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = tl.max_contiguous(tl.multiple_of(k0 + offs_k0, VEC), VEC)
        w = tl.load(rows + offs[None, :], mask=n_ok[:, None] & (offs < K)[None, :], other=0,
                    eviction_policy="evict_first")
        wf = w.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        acc += tl.sum(tl.reshape(wf, [BLOCK_N, BLOCK_K // VEC, VEC]), axis=2)
    tl.store(y_ptr + offs_n, tl.sum(acc, axis=1), mask=n_ok)


def read_only(ws: list, cfg, vec: int) -> float:
    N, K = ws[0][0].shape
    y = torch.empty(N, device="cuda", dtype=torch.float32)

    def run():
        for w, _ in ws:
            _read_kernel[(triton.cdiv(N, cfg.block_n),)](
                w.view(torch.int8), y, N, K, w.stride(0), BLOCK_N=cfg.block_n,
                BLOCK_K=cfg.block_k, VEC=vec, num_warps=cfg.num_warps)
    return _graph_us(run, len(ws))


def main() -> None:
    from pdserve.kernels.gemv_configs import pick_config
    from pdserve.kernels.ops import gemv

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    out: dict = {"what": __doc__.split("\n")[0], "copy_GBps": round(copy_gbps()), "shapes": {}}
    for name, N, K, prologue in SHAPES[:4]:
        inp = _one_row_inputs(name, N, K, prologue, "fp8", dev)
        cfg = pick_config(N, K, 1, 1, inp["prefetch"], dev)
        nbytes = N * K
        row: dict = {"tile": [cfg.block_n, cfg.block_k, cfg.num_warps]}
        for vec in (8, 16):
            us = read_only(inp["ws"], cfg, vec)
            row[f"read_vec{vec}"] = {"us": round(us, 2), "GBps": round(nbytes / us / 1e3)}
            c = replace(cfg, vec=vec)
            us = _graph_us(lambda c=c: [gemv(inp["x"], w, prologue, config=c, **inp["kw"], **f)
                                        for w, f in inp["ws"]], len(inp["ws"]))
            row[f"gemv_vec{vec}"] = {"us": round(us, 2), "GBps": round(nbytes / us / 1e3),
                                     "rel_err": _rel_err(inp, prologue, c)}
        for reg in (64, 56, 48, 40):
            c = replace(cfg, maxnreg=reg)
            us = _graph_us(lambda c=c: [gemv(inp["x"], w, prologue, config=c, **inp["kw"], **f)
                                        for w, f in inp["ws"]], len(inp["ws"]))
            row[f"gemv_reg{reg}"] = {"us": round(us, 2), "GBps": round(nbytes / us / 1e3)}
        out["shapes"][name] = row
        print(name, json.dumps(row), file=sys.stderr, flush=True)
        del inp
        torch.cuda.empty_cache()
    write_result(out, "bench.lab.probe_fp8_vec", args.out)


def write_result(out: dict, module: str, path: str | None) -> None:
    """Stamp a probe's result with the device, its command and the date; print it and, with
    a path, write it there."""
    out["device"] = torch.cuda.get_device_name()
    out["command"] = f"PYTHONPATH=. python3 -m {module} " + " ".join(sys.argv[1:])
    out["date"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    print(json.dumps(out, indent=1))
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

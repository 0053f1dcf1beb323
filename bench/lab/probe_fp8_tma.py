"""Can FP8 weights stream faster through the bulk-copy engine (TMA) than through registers? (GPU)

    python -m bench.lab.probe_fp8_tma [--out F.json]

At batch 1 the FP8 one-row GEMVs read at ~3.55 TB/s on an H200 where the bf16 ones read at
~4.2 (bench/results/gemv_chain_h200_2026-11-28.json, three_gemvs), and a kernel that only
reads the FP8 weights with the GEMVs' tiles takes as long as the GEMVs
(bench/results/fp8_b1_probes_h200_2026-11-26.json): per program an 8 KB FP8 tile is half
the bytes in flight of a 16 KB bf16 one at the same registers. A TMA load puts its tile in
shared memory and holds no register while in flight, so stages of it could keep more bytes
in flight. Read-only kernels (load, e4m3 -> fp32, row sums) over the FP8 gate_up and down
of Qwen3-8B, copies past L2, timed in a CUDA graph:
  reg: pointer loads into registers, the GEMV's tile and warps (probe_fp8_vec.read_only);
  tma: tensor-descriptor loads (boxes <= 256 wide), tl.range(num_stages=S) pipelined.
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from pdserve.kernels.gemv_configs import GemvConfig

from bench.lab.bench_gemv import _graph_us, copy_gbps
from bench.lab.probe_fp8_vec import read_only, write_result

SHAPES = {"gate_up": (24576, 4096), "down": (4096, 12288)}
MIN_BYTES = 2 << 30


@triton.jit
def _tma_read_kernel(desc, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     VEC: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    n0 = pid * BLOCK_N
    acc = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        w = desc.load([n0, k0])
        wf = w.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        acc += tl.sum(tl.reshape(wf, [BLOCK_N, BLOCK_K // VEC, VEC]), axis=2)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    tl.store(y_ptr + offs_n, tl.sum(acc, axis=1), mask=offs_n < N)


def _copies(N: int, K: int) -> list[torch.Tensor]:
    n = max(2, -(-MIN_BYTES // (N * K)))
    return [(torch.randn(N, K, device="cuda") * 64).clamp(-448, 448)
            .to(torch.float8_e4m3fn).view(torch.int8) for _ in range(n)]


def tma_us(ws: list[torch.Tensor], bn: int, bk: int, warps: int, stages: int) -> float:
    N, K = ws[0].shape
    y = torch.empty(N, device="cuda", dtype=torch.float32)
    descs = [TensorDescriptor.from_tensor(w, block_shape=[bn, bk]) for w in ws]
    return _graph_us(lambda: [_tma_read_kernel[(triton.cdiv(N, bn),)](
        d, y, N, K, BLOCK_N=bn, BLOCK_K=bk, VEC=8, STAGES=stages, num_warps=warps)
        for d in descs], len(ws))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out: dict = {"what": __doc__.split("\n")[0], "copy_GBps": round(copy_gbps()), "shapes": {}}
    for name, (N, K) in SHAPES.items():
        ws = _copies(N, K)
        row: dict = {}
        for bn, bk, warps in ((8, 1024, 4), (16, 2048, 8)):
            us = read_only([(w, None) for w in ws], GemvConfig(bn, bk, num_warps=warps), 8)
            row[f"reg_{bn}x{bk}w{warps}"] = {"us": round(us, 2), "GBps": round(N * K / us / 1e3)}
        for bn, bk, warps, stages in ((32, 256, 4, 3), (32, 256, 4, 4), (64, 256, 4, 3),
                                      (64, 256, 8, 4), (16, 256, 4, 4), (128, 256, 8, 3)):
            key = f"tma_{bn}x{bk}w{warps}s{stages}"
            try:
                us = tma_us(ws, bn, bk, warps, stages)
                row[key] = {"us": round(us, 2), "GBps": round(N * K / us / 1e3)}
            except Exception as e:  # a shape Triton cannot build: say which and why
                row[key] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            print(name, key, row[key], file=sys.stderr, flush=True)
        out["shapes"][name] = row
        del ws
        torch.cuda.empty_cache()
    write_result(out, "bench.lab.probe_fp8_tma", args.out)


if __name__ == "__main__":
    main()

"""Row-wise argmax of logits [B, V] -> token ids [B] (greedy sampling, MTP drafting and
verifying), as torch.argmax returns it: the first index of the row's maximum.

torch.argmax reduces a 152K-entry row in one thread block (8.6 us per batch-1 decode step on
an H100, bench/results/diag_decode_h100_2026-11-23_run8.json; twice per MTP step). Here each
row is cut into chunks read by programs across the GPU; each stores its chunk's (max, first
index), and the last program of the row to arrive (arrival counter, as in
kernels/decode_attention.py) reduces the partials: 3.4 us per decode step
(bench/results/diag_spec_k0_h100_2026-11-24.json). The reference is
kernels.reference.argmax_ref.
NaN counts as +inf (torch would return the first NaN's index; logits are never NaN here).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._triton import (
    FLOAT_DTYPES,
    arrival_counters,
    check_launchable,
    check_tensor,
    interpreting,
    jit,
    next_pow2,
    num_sms,
    pdl_enter,
    pdl_launch,
    scratch_fp32,
)

BLOCK = 1024  # entries per program per step
MAX_INDEX = (1 << 24) - 1  # partial indices travel through fp32 scratch as bit patterns


@jit
def _chunk_best(x_ptr, row, start, end, stride_x, BLOCK: tl.constexpr):
    """(max, first index of it) over x[row, start:end], fp32 and int32 scalars."""
    best_v = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK], 2147483647, tl.int32)
    lanes = tl.arange(0, BLOCK)
    for off in range(start, end, BLOCK):
        idx = off + lanes
        ok = idx < end
        v = tl.load(x_ptr + row * stride_x + idx, mask=ok, other=float("-inf")).to(tl.float32)
        v = tl.where(v != v, float("inf"), v)
        idx = tl.where(ok, idx, 2147483647)
        # per lane, indices only grow: ">" keeps the earlier index on ties, and the first
        # valid entry always replaces the -inf / MAX start (an all -inf row gives index 0)
        take = (v > best_v) | ((v == best_v) & (idx < best_i))
        best_v = tl.where(take, v, best_v)
        best_i = tl.where(take, idx, best_i)
    m = tl.max(best_v, axis=0)
    return m, tl.min(tl.where(best_v == m, best_i, 2147483647), axis=0)


@jit
def _argmax_kernel(x_ptr, out_ptr, part_ptr, count_ptr, V, stride_x, CHUNK,
                   NUM_CHUNKS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    pdl_enter(USE_PDL)
    m, i = _chunk_best(x_ptr, row, c * CHUNK, tl.minimum((c + 1) * CHUNK, V), stride_x, BLOCK)
    if NUM_CHUNKS == 1:
        tl.store(out_ptr + row, i.to(tl.int64))
    else:
        # partials: values at [row, c], indices (int32 bits) NUM_CHUNKS * rows further on
        base = part_ptr + row * NUM_CHUNKS
        tl.store(base + c, m)
        tl.store(base + tl.num_programs(0) * NUM_CHUNKS + c, i.to(tl.float32, bitcast=True))
        tl.debug_barrier()
        if tl.atomic_add(count_ptr + row, 1, sem="acq_rel") == NUM_CHUNKS - 1:
            tl.store(count_ptr + row, 0)  # all have arrived: reset for the next launch
            cs = tl.arange(0, NUM_CHUNKS)
            pv = tl.load(base + cs, cache_modifier=".cg")
            pi = tl.load(base + tl.num_programs(0) * NUM_CHUNKS + cs, cache_modifier=".cg")
            pi = pi.to(tl.int32, bitcast=True)
            best = tl.max(pv, axis=0)
            tl.store(out_ptr + row, tl.min(tl.where(pv == best, pi, 2147483647),
                                           axis=0).to(tl.int64))


def num_chunks(rows: int, vocab: int, device: torch.device) -> int:
    """Chunks per row: about two programs per SM over all rows, a power of 2, each chunk at
    least one BLOCK (one chunk in the interpreter, which runs programs one by one)."""
    if interpreting() or device.type != "cuda":
        return 1
    want = max(1, 2 * num_sms(device.index or 0) // max(rows, 1))
    return max(1, min(next_pow2(want), 64, next_pow2(triton.cdiv(vocab, BLOCK))))


def argmax(logits: torch.Tensor, chunks: int | None = None, pdl: bool = False) -> torch.Tensor:
    """logits [B, V] (fp32/fp16/bf16, rows may be strided) -> int64 [B], the first index of
    each row's maximum (torch.argmax(logits, dim=-1)). chunks: programs per row (a power of
    2; default num_chunks). pdl=True: a programmatic dependent launch, only right after a
    Triton kernel (the GEMV LM head); after a cuBLAS GEMM it breaks CUDA-graph capture, as
    kernels.fused_add_rmsnorm notes."""
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES, last_contiguous=True)
    check_launchable("logits", logits)
    B, V = logits.shape
    if not 0 < V <= MAX_INDEX:
        raise ValueError(f"logits: vocabulary of {V} entries; argmax takes 1..{MAX_INDEX}")
    n = chunks if chunks is not None else num_chunks(B, V, logits.device)
    if n < 1 or n & (n - 1):
        raise ValueError(f"chunks: must be a power of 2, got {n}")
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    chunk = triton.cdiv(triton.cdiv(V, n), BLOCK) * BLOCK
    parts, counts = out, out
    if n > 1:
        parts = scratch_fp32(logits.device, 2 * B * n)
        counts = arrival_counters(logits.device, B)
    _argmax_kernel[(B, n)](logits, out, parts, counts, V, logits.stride(0), chunk,
                           NUM_CHUNKS=n, BLOCK=BLOCK, num_warps=4,
                           **(pdl_launch(logits) if pdl else {"USE_PDL": False}))
    return out

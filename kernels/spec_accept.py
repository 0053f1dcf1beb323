"""Greedy MTP acceptance on the device, written straight into the drafting's static inputs.

After a verify forward over B sequences x q = k + 1 rows (the last accepted token + k drafts),
the next MTP proposal (engine/spec/draft_graphs.py) must start from each sequence's accepted
prefix, which only the target's argmax knows. Per sequence i this kernel computes

    n[i]       leading drafts equal to the target's argmax (k under forced acceptance)
    ids[i, j]  the token after verify row j: drafts[i, j] for j < n[i], else argmax[i, j]
    sel[i]     the catch-up row the chain starts from: i * q + n[i]
    chain      for s < k_next - 1: position cpos[s, i] moves back by k - n[i] (it was staged
               for n = k), and its cache slot and sequence length follow from the block table

In torch that is ~12 tiny kernels and copies between the verify and the drafting graphs
(cmp, cumprod, sum, arange, cat, where, copies, subtractions): ~3 us each at batch 1 on an
H100, on the critical path of every speculative step. The reference is
engine.spec.draft_graphs.accept_ref.
"""
from __future__ import annotations

import torch
import triton.language as tl

from pdserve.kernels._triton import check_launchable, check_tensor, jit, next_pow2


# the block table's width and the chain's stride change from step to step: not specialized,
# or each (== 1, % 16) compiled in a served step (engine/exec/warmup.py)
@jit(do_not_specialize=["stride_chain", "stride_table"])
def _accept_kernel(argmax_ptr, drafts_ptr, ids_ptr, sel_ptr, cpos_ptr, cslots_ptr, cseq_ptr,
                   tables_ptr, stride_chain, stride_table, block_size, K, Q: tl.constexpr,
                   QP: tl.constexpr, CHAIN: tl.constexpr, FORCED: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, QP)
    in_row = j < Q
    am = tl.load(argmax_ptr + i * Q + j, mask=in_row, other=0)
    d = tl.load(drafts_ptr + i * K + j, mask=j < K, other=0)
    if FORCED:
        n = K
    else:  # the first row whose draft misses (or the bonus row K) bounds the accepted run
        miss = (d != am) | (j >= K)
        n = tl.min(tl.where(miss & in_row, j, Q), axis=0)
    tl.store(ids_ptr + i * Q + j, tl.where(j < n, d, am), mask=in_row)
    tl.store(sel_ptr + i, i * Q + n)
    back = K - n
    for s in tl.static_range(CHAIN):
        p = tl.load(cpos_ptr + s * stride_chain + i) - back
        blk = tl.load(tables_ptr + i * stride_table + p // block_size).to(tl.int64)
        tl.store(cpos_ptr + s * stride_chain + i, p)
        tl.store(cslots_ptr + s * stride_chain + i, blk * block_size + p % block_size)
        tl.store(cseq_ptr + s * stride_chain + i, (p + 1).to(tl.int32))


def spec_accept(argmax: torch.Tensor, drafts: torch.Tensor, ids: torch.Tensor,
                sel: torch.Tensor, cpos: torch.Tensor, cslots: torch.Tensor, cseq: torch.Tensor,
                tables: torch.Tensor, block_size: int, forced: bool = False) -> None:
    """In place, for B sequences that verified k drafts each (q = k + 1 rows):
    argmax [B * q] int64 (the target's), drafts [B, k] int64 -> ids [B * q] int64 and
    sel [B] int64 written; chain rows cpos / cslots [C, >= B] int64 and cseq [C, >= B] int32
    (C = k_next - 1 >= 0, staged as if all k drafts were accepted) moved back to each
    sequence's accepted prefix through tables [>= B, W] int32 (block ids)."""
    dev = argmax.device
    check_tensor("drafts", drafts, ndim=2, dtypes=[torch.int64], device=dev)
    B, k = drafts.shape
    if k < 1:
        raise ValueError(f"drafts: k must be >= 1, got shape {tuple(drafts.shape)}")
    q = k + 1
    check_tensor("argmax", argmax, shape=[B * q], dtypes=[torch.int64])
    check_tensor("ids", ids, shape=[B * q], dtypes=[torch.int64], device=dev)
    check_tensor("sel", sel, shape=[B], dtypes=[torch.int64], device=dev)
    C = cpos.shape[0] if cpos.dim() == 2 else -1
    for name, t, dtype in (("cpos", cpos, torch.int64), ("cslots", cslots, torch.int64),
                           ("cseq", cseq, torch.int32)):
        check_tensor(name, t, shape=[C, None], dtypes=[dtype], device=dev)
        if C > 0 and (t.shape[1] < B or t.stride() != cpos.stride()):
            raise ValueError(f"{name}: shape {tuple(t.shape)} strides {t.stride()}; expected "
                             f"[{C}, >= {B}] with cpos's strides {cpos.stride()}")
    check_tensor("tables", tables, ndim=2, dtypes=[torch.int32], device=dev)
    if C > 0 and tables.shape[0] < B:
        raise ValueError(f"tables: {tables.shape[0]} rows for {B} sequences")
    if block_size < 1:
        raise ValueError(f"block_size: must be >= 1, got {block_size}")
    for name, t in (("argmax", argmax), ("drafts", drafts), ("ids", ids), ("sel", sel)):
        if not t.is_contiguous():
            raise ValueError(f"{name}: must be contiguous, strides {t.stride()}")
    check_launchable("argmax", argmax)
    if B == 0:
        return
    stride_chain = cpos.stride(0) if C > 0 else 0
    _accept_kernel[(B,)](argmax, drafts, ids, sel, cpos, cslots, cseq, tables, stride_chain,
                         tables.stride(0), block_size, k, Q=q, QP=next_pow2(q),
                         CHAIN=max(C, 0), FORCED=forced, num_warps=1)

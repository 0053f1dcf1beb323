"""The decode attention's split merge inside a thread-block cluster (Hopper, sm_90).

At batch 1 the split programs of a KV head each hold a partial result (o [rows, D], its
log-sum-exp [rows]), and one program merges them. Through global memory that costs three
dependent round trips a layer: the partials' stores and the release fence, the arrival
atomic, the merger's loads (~2 us a layer on an H200 under the weight stream's traffic).
With the split programs of a KV head launched as one cluster (up to 16 CTAs, co-scheduled
on one GPC), the merge goes over distributed shared memory instead:

1. each split program but the leader (the last active split of the cluster) writes its
   partial into its own shared memory and arrives at the cluster barrier;
2. the leader arrives, waits, reads the others' partials through DSMEM (`mapa` +
   `ld.shared::cluster`), merges them with its own in registers, and arrives again;
3. the others wait for that second arrival before they exit (a CTA's shared memory must
   outlive every read of it); splits with no keys exit at once (the barrier waits only for
   non-exited threads).

A context of more than `cluster` splits' keys has several clusters per KV head: their leaders
then meet through global memory as before (kernels/decode_attention_tiles.merge_splits),
with one partial per cluster instead of one per split.

Triton has no cluster API: the PTX is inline asm, the partials sit at the start of the
kernel's dynamic shared memory (`global_smem`; Triton's own buffers there are dead by then,
after a CTA barrier), and kernels/_triton.cluster_launch launches the compiled kernel with
a cluster dimension. Compiled only (the interpreter has no clusters).
"""
from __future__ import annotations

import triton.language as tl

from pdserve.kernels._triton import jit


@jit
def _cluster_sync(x):
    """barrier.cluster arrive (release) + wait (acquire); returns 0, a token to add into
    addresses that must be read after it (inline asm with side effects keeps its order)."""
    return tl.inline_asm_elementwise(
        "barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;\n\t"
        "mov.u32 $0, 0;", "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1)


@jit
def _cluster_arrive(x):
    """barrier.cluster arrive (release) only: the accesses before it are performed (so the
    DSMEM loads have landed) before a waiting peer sees it."""
    return tl.inline_asm_elementwise(
        "barrier.cluster.arrive.release.aligned;\n\tmov.u32 $0, 0;", "=r,r", [x],
        dtype=tl.int32, is_pure=False, pack=1)


@jit
def _st_own(off, val, ok):
    """st.shared.f32 of val at byte `off` of this CTA's dynamic shared memory where ok."""
    return tl.inline_asm_elementwise(
        "{ .reg .u32 a; .reg .pred p;\n\tmov.u32 a, global_smem;\n\tadd.u32 a, a, $1;\n\t"
        "setp.ne.s32 p, $3, 0;\n\t@p st.shared.f32 [a], $2;\n\tmov.u32 $0, 0; }",
        "=r,r,f,r", [off, val, ok], dtype=tl.int32, is_pure=False, pack=1)


@jit
def _ld_peer(off, rank, ok, other):
    """ld.shared::cluster.f32 at byte `off` of CTA `rank`'s dynamic shared memory where ok,
    else `other`."""
    return tl.inline_asm_elementwise(
        "{ .reg .u32 a; .reg .pred p;\n\tmov.u32 a, global_smem;\n\tadd.u32 a, a, $1;\n\t"
        "mapa.shared::cluster.u32 a, a, $2;\n\tsetp.ne.s32 p, $3, 0;\n\tmov.f32 $0, $4;\n\t"
        "@p ld.shared::cluster.f32 $0, [a]; }",
        "=f,r,r,r,f", [off, rank, ok, other], dtype=tl.float32, is_pure=False, pack=1)


@jit
def cluster_merge(o, lse, row_ok, rank, lead, BLOCK_G: tl.constexpr, D: tl.constexpr,
                  CLUSTER: tl.constexpr):
    """Split programs rank 0 .. lead of a cluster hold partials (o [BLOCK_G, D] normalised,
    lse [BLOCK_G] in log2 units, rows where row_ok); the leader (rank == lead) returns their
    merge (o, lse); the others return their own after the leader has read it (callers
    store only the leader's)."""
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    o_off = (g[:, None] * D + d[None, :]) * 4  # bytes: o [BLOCK_G, D] then lse [BLOCK_G]
    lse_off = BLOCK_G * D * 4 + g * 4
    res = o
    lse_out = lse
    if rank != lead:
        tl.debug_barrier()  # every warp done with Triton's buffers at global_smem
        # side-effecting asm keeps program order: stores, then the release; no reduction
        # here (Triton's cross-warp scratch is global_smem too)
        _st_own(o_off, o, row_ok[:, None].to(tl.int32))
        _st_own(lse_off, lse, row_ok.to(tl.int32))
        _cluster_sync(rank)  # phase 1: the partial is visible to the leader
        _cluster_sync(rank)  # phase 2: the leader has read it
    else:
        token = _cluster_sync(rank)
        m = lse
        total = tl.where(lse == float("-inf"), 0.0, 1.0)
        acc = o * total[:, None]
        for r in tl.static_range(CLUSTER - 1):  # peers 0 .. lead - 1 (lead <= CLUSTER - 1)
            ok = row_ok & (r < lead)
            lse_r = _ld_peer(lse_off + token, r, ok.to(tl.int32), float("-inf"))
            o_r = _ld_peer(o_off + token, r, ok[:, None].to(tl.int32), 0.0)
            m_new = tl.maximum(m, lse_r)
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no keys yet: weights 0
            alpha = tl.exp2(m - m_ref)
            w = tl.exp2(lse_r - m_ref)
            total = total * alpha + w
            acc = acc * alpha[:, None] + o_r * w[:, None]
            m = m_new
        has = total > 0.0
        res = acc / tl.where(has, total, 1.0)[:, None]
        lse_out = tl.where(has, m + tl.log2(tl.where(has, total, 1.0)), float("-inf"))
        _cluster_arrive(rank)  # phase 2: the peers may exit
    return res, lse_out

"""The FP8 one-row GEMV on the tensor cores in Gluon, for bench/lab/probe_fp8_gluon.py:
wgmma m64n8k32 with the weight tile (64 rows x 128) as A straight from the TMA ring and
the activation, quantized to e4m3 per 128 columns, as B (one real column of 8); CTAs take
K splits. Lab code: measured, not used by the engine.
Qwen3-8B's four FP8 projections, 36 layers in one graph (bench/results/
probe_fp8_gluon_h200_2026-11-30.json): 46.8-47.6 us a layer with four wgmmas in flight
(GROUP 4), an 8-stage ring and balanced K splits, against 50.5-51.3 with one synchronous
wgmma per tile, 53.0-53.6 for the one-row Triton GEMVs and 45.8 for the TMA stream alone."""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from bench.lab.gluon_gemv_cuda_core import _gdc_launch, _gdc_wait, ring_barriers


@gluon.jit
def _mmb_loader(w_desc, ring, ready, empty, N, KTS: gl.constexpr, SPLIT: gl.constexpr,
                STAGES: gl.constexpr):
    """One warp: the CTA's [64, 128] weight tiles: its K split ks = pid % SPLIT, its row
    blocks pid // SPLIT + j * (G / SPLIT)."""
    pid = gl.program_id(0)
    GS = gl.num_programs(0) // SPLIT
    first = pid // SPLIT
    total = ((gl.cdiv(N, 64) - first + GS - 1) // GS) * KTS
    for t in range(total):
        s = t % STAGES
        mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), 64 * 128)
        tma.async_copy_global_to_shared(
            w_desc, [(first + (t // KTS) * GS) * 64, ((pid % SPLIT) * KTS + t % KTS) * 128],
            ready.index(s), ring.index(s))


@gluon.jit
def _mmb_scale(s_ptr, sx_ptr, stride_s, first, GS, k0, t, KTS: gl.constexpr):
    """The scale of the CTA's tile t: its 128 x 128 weight block's times its activation
    group's."""
    rb = first + (t // KTS) * GS
    return gl.load(s_ptr + (rb * 64 // 128) * stride_s + k0 + t % KTS) * \
        gl.load(sx_ptr + k0 + t % KTS)


@gluon.jit
def _stage_xq(xq_smem, xq_ptr, k0, KTS: gl.constexpr):
    """The CTA's K range of the quantized activation into shared memory as wgmma's B,
    [KTS][8, 128] e4m3 (row 0 the activation, rows 1..7 zero)."""
    XB: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    KP: gl.constexpr = 8 if KTS >= 8 else KTS  # K tiles staged per pass (8 rows each)
    r = gl.arange(0, KP * 8, layout=gl.SliceLayout(1, XB))
    c = gl.arange(0, 128, layout=gl.SliceLayout(0, XB))
    for k8 in gl.static_range(0, KTS, KP):
        v = gl.load(xq_ptr + (k0 + k8 + r // 8)[:, None] * 128 + c[None, :],
                    mask=(r % 8 == 0)[:, None], other=0.0)
        xq_smem._reinterpret(gl.float8e4nv, [KTS * 8, 128], gl.NVMMASharedLayout(128, 8, rank=2)
                             ).slice(k8 * 8, KP * 8).store(v)
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _mmb_out(y_ptr, acc, rb, rows, cols, N, pid, SPLIT: gl.constexpr, ATOMIC: gl.constexpr):
    """Column 0 of acc [64, 8] is row block rb's partial y: added into y (RED) or stored."""
    n = rb * 64 + rows
    keep = (n < N)[:, None] & (cols == 0)[None, :]
    if ATOMIC:  # fire-and-forget reductions (RED) into a zeroed fp32 y [N]
        gl.atomic_add(y_ptr + n[:, None] + cols[None, :] * 0, acc, mask=keep, sem="relaxed")
    else:
        gl.store(y_ptr + (pid % SPLIT) * N + n[:, None] + cols[None, :] * 0, acc, mask=keep)


@gluon.jit
def _mmb_issue(ring, ready, xq_smem, zero, t, KTS: gl.constexpr, STAGES: gl.constexpr):
    """Tile t's wgmma, started once its ring slot is full: a token for warpgroup_mma_wait."""
    s = t % STAGES
    mbarrier.wait(ready.index(s), (t // STAGES) & 1)
    return warpgroup_mma(ring.index(s), xq_smem.index(t % KTS).permute((1, 0)), zero,
                         use_acc=False, is_async=True)


@gluon.jit
def _mmb_consumer(ring, ready, empty, xq_smem, xq_ptr, sx_ptr, s_ptr, y_ptr, N, stride_s,
                  KTS: gl.constexpr, SPLIT: gl.constexpr, STAGES: gl.constexpr,
                  USE_PDL: gl.constexpr, ATOMIC: gl.constexpr, GROUP: gl.constexpr,
                  EARLY: gl.constexpr):
    """One warpgroup. Per tile acc_t [64, 8] = W_tile @ B on the tensor cores, acc +=
    acc_t * (weight block scale * activation group scale); column 0 of acc is the row
    block's partial y. GROUP (2, 4): that many tiles' wgmmas in flight at once (async, each
    waited for in turn while the later ones run). EARLY: the next launch is let go before this
    one's PDL wait, so its CTAs can fill their rings while this one streams."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, 8, 32])
    pid = gl.program_id(0)
    GS = gl.num_programs(0) // SPLIT
    first = pid // SPLIT
    k0 = (pid % SPLIT) * KTS  # first K tile of this CTA's split
    total = ((gl.cdiv(N, 64) - first + GS - 1) // GS) * KTS
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
    cols = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    if USE_PDL:
        if EARLY:
            _gdc_launch()
        _gdc_wait()
        if not EARLY:
            _gdc_launch()
    _stage_xq(xq_smem, xq_ptr, k0, KTS)
    acc = gl.zeros([64, 8], gl.float32, MMA)
    zero = gl.zeros([64, 8], gl.float32, MMA)
    if GROUP > 1:  # KTS % GROUP == 0: a group never straddles two row blocks
        for t in range(0, total, GROUP):
            sc = _mmb_scale(s_ptr, sx_ptr, stride_s, first, GS, k0, t, KTS)
            tok0 = _mmb_issue(ring, ready, xq_smem, zero, t, KTS, STAGES)
            tok1 = _mmb_issue(ring, ready, xq_smem, zero, t + 1, KTS, STAGES)
            if GROUP == 4:
                sc1 = _mmb_scale(s_ptr, sx_ptr, stride_s, first, GS, k0, t + 1, KTS)
                sc2 = _mmb_scale(s_ptr, sx_ptr, stride_s, first, GS, k0, t + 2, KTS)
                sc3 = _mmb_scale(s_ptr, sx_ptr, stride_s, first, GS, k0, t + 3, KTS)
                tok2 = _mmb_issue(ring, ready, xq_smem, zero, t + 2, KTS, STAGES)
                tok3 = _mmb_issue(ring, ready, xq_smem, zero, t + 3, KTS, STAGES)
                p0 = warpgroup_mma_wait(3, deps=[tok0])
                mbarrier.arrive(empty.index(t % STAGES), count=1)
                p1 = warpgroup_mma_wait(2, deps=[tok1])
                mbarrier.arrive(empty.index((t + 1) % STAGES), count=1)
                p2 = warpgroup_mma_wait(1, deps=[tok2])
                mbarrier.arrive(empty.index((t + 2) % STAGES), count=1)
                p3 = warpgroup_mma_wait(0, deps=[tok3])
                mbarrier.arrive(empty.index((t + 3) % STAGES), count=1)
                acc += p0 * sc + p1 * sc1 + p2 * sc2 + p3 * sc3
            else:
                sc1 = _mmb_scale(s_ptr, sx_ptr, stride_s, first, GS, k0, t + 1, KTS)
                p0 = warpgroup_mma_wait(1, deps=[tok0])
                mbarrier.arrive(empty.index(t % STAGES), count=1)
                p1 = warpgroup_mma_wait(0, deps=[tok1])
                mbarrier.arrive(empty.index((t + 1) % STAGES), count=1)
                acc += p0 * sc + p1 * sc1
            if (t + GROUP - 1) % KTS == KTS - 1:
                _mmb_out(y_ptr, acc, first + (t // KTS) * GS, rows, cols, N, pid, SPLIT,
                         ATOMIC)
                acc = gl.zeros([64, 8], gl.float32, MMA)
    else:
        # the tile's scale (weight block x activation group) is loaded two tiles ahead: its
        # latency stays off the loop
        sc1 = _mmb_scale(s_ptr, sx_ptr, stride_s, first, GS, k0, 0, KTS)
        sc2 = _mmb_scale(s_ptr, sx_ptr, stride_s, first, GS, k0, gl.minimum(1, total - 1),
                         KTS)
        for t in range(total):
            kl = t % KTS
            sc = sc1
            sc1 = sc2
            sc2 = _mmb_scale(s_ptr, sx_ptr, stride_s, first, GS, k0,
                             gl.minimum(t + 2, total - 1), KTS)
            s = t % STAGES
            mbarrier.wait(ready.index(s), (t // STAGES) & 1)
            part = warpgroup_mma(ring.index(s), xq_smem.index(kl).permute((1, 0)), zero,
                                 use_acc=False)
            mbarrier.arrive(empty.index(s), count=1)
            acc += part * sc
            if kl == KTS - 1:
                _mmb_out(y_ptr, acc, first + (t // KTS) * GS, rows, cols, N, pid, SPLIT,
                         ATOMIC)
                acc = gl.zeros([64, 8], gl.float32, MMA)


@gluon.jit
def _gemv_mmb_kernel(w_desc, xq_ptr, sx_ptr, s_ptr, y_ptr, N, stride_s, KTS: gl.constexpr,
                     SPLIT: gl.constexpr, STAGES: gl.constexpr, USE_PDL: gl.constexpr,
                     ATOMIC: gl.constexpr, GROUP: gl.constexpr, EARLY: gl.constexpr):
    """The FP8 GEMV on the tensor cores with the weights as wgmma's A (M = 64 rows) and the
    quantized activation as B (N = 8, one real column); CTA pid takes K split pid % SPLIT
    (KTS tiles of 128) of every (G / SPLIT)-th 64-row block."""
    ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 64, 128], w_desc.layout)
    xq_smem = gl.allocate_shared_memory(gl.float8e4nv, [KTS, 8, 128],
                                        gl.NVMMASharedLayout(128, 8, rank=2))
    ready, empty = ring_barriers(STAGES)
    gl.warp_specialize([
        (_mmb_consumer, (ring, ready, empty, xq_smem, xq_ptr, sx_ptr, s_ptr, y_ptr, N,
                         stride_s, KTS, SPLIT, STAGES, USE_PDL, ATOMIC, GROUP, EARLY)),
        (_mmb_loader, (w_desc, ring, ready, empty, N, KTS, SPLIT, STAGES)),
    ], [1], [40])


def gemv_mmb(xq: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, s: torch.Tensor,
             y: torch.Tensor, grid: int, split: int, stages: int, atomic: bool = False,
             maxnreg: int = 128, group: int = 1, early: bool = False) -> None:
    """y [split, N] fp32 partials (sum over dim 0 is the GEMV), or with atomic a zeroed
    [N] fp32 that the K splits add into; group / early: see _mmb_consumer."""
    N, K = w.shape
    layout = gl.NVMMASharedLayout.get_default_for([64, 128], gl.float8e4nv)
    desc = TensorDescriptor(w, [N, K], [K, 1], [64, 128], layout)
    assert grid % split == 0 and (K // 128) % split == 0
    assert (K // 128 // split) % group == 0, "group: must divide the K tiles per split"
    _gemv_mmb_kernel[(grid,)](desc, xq, sx, s, y, N, s.stride(0), KTS=K // 128 // split,
                              SPLIT=split, ATOMIC=atomic, GROUP=group, EARLY=early,
                              STAGES=stages, USE_PDL=True, num_warps=4, launch_pdl=True,
                              maxnreg=maxnreg)


def quantize_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [K] -> (e4m3 [K], fp32 scales [K / 128]): one scale per 128-column group."""
    g = x.float().view(-1, 128)
    sx = (g.abs().amax(dim=1) / 448.0).clamp(min=1e-12)
    return (g / sx[:, None]).to(torch.float8_e4m3fn).view(-1), sx

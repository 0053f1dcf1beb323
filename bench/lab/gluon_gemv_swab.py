"""The FP8 one-row GEMV on the tensor cores with A and B swapped, for
bench/lab/probe_fp8_gluon.py: the weight tile [BN rows, 128] is wgmma's B (N = BN), the
activation, quantized to e4m3 per 128 columns, is A (M = 64, row 0 real). A CTA owns row
blocks of BN whole rows (BN a power of 2 chosen so that the blocks split evenly over <= 2
CTAs per SM: swab_tile), so every CTA streams about the same bytes with no K split and no
atomics, and y is stored once in bf16 (the kernels/gemv.py contract). A lives in shared
memory: GPS slots [64, 128] zeroed once, row 0 rewritten per group (built in registers,
with 63 of 64 rows zero, it would cost a select per byte).
Measured (bench/results/probe_fp8_gluon_h200_2026-11-30.json): correct (rel. err 1.7e-3, the
bf16 output's rounding) but consumer-bound, 76-81 us a layer for Qwen3-8B's four FP8
projections against 47.0 for gluon_gemv_wgmma's kernel and 53.0 for Triton's: per group
(1-4 KB of weight) a row write, a proxy fence, a barrier, a [BN] scale load and a
[64, BN] wgmma result, 63 of whose 64 rows are waste. Lab code, not used by the engine."""
from __future__ import annotations

import torch
import triton
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
def _swab_loader(w_desc, ring, ready, empty, N, KG: gl.constexpr, GPS: gl.constexpr,
                 BN: gl.constexpr, STAGES: gl.constexpr):
    """One warp: the CTA's row blocks pid, pid + G, ... (G CTAs), each all of K, GPS
    [BN, 128] boxes per ring stage."""
    pid = gl.program_id(0)
    G = gl.num_programs(0)
    SPB: gl.constexpr = KG // GPS  # ring stages per row block
    for t in range(((gl.cdiv(N, BN) - pid + G - 1) // G) * SPB):
        s = t % STAGES
        mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), GPS * BN * 128)
        row0 = (pid + (t // SPB) * G) * BN
        for g in gl.static_range(GPS):
            tma.async_copy_global_to_shared(w_desc, [row0, ((t % SPB) * GPS + g) * 128],
                                            ready.index(s), ring.index(s * GPS + g))


@gluon.jit
def _swab_issue(ring, a_slots, g, zero):
    """Group g of the stage: wgmma A = a_slots[g] (row 0 the activation group), B = ring
    slot's weight box (K-major): a token for warpgroup_mma_wait."""
    return warpgroup_mma(a_slots.index(g), ring.permute((1, 0)), zero,
                         use_acc=False, is_async=True)


@gluon.jit
def _swab_rows(a_slots, xq_smem, kg, GPS: gl.constexpr):
    """Row 0 of A slot g <- activation group kg + g, for the stage's GPS groups."""
    RL: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, 4], [1, 0])
    for g in gl.static_range(GPS):
        v = xq_smem.index(kg + g).load(RL)  # [1, 128]
        # row 0 of a 128-byte-swizzled tile is not permuted: its plain view takes the bytes
        a_slots.index(g)._reinterpret(gl.float8e4nv, [64, 128],
                                      gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
                                      ).slice(0, 1).store(v)
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _swab_scale(s_ptr, sx_ptr, stride_s, n, N, kg):
    """[BN] scales of group kg: each row's weight block scale times the activation group's."""
    return gl.load(s_ptr + (n // 128) * stride_s + kg, mask=n < N, other=0.0) * \
        gl.load(sx_ptr + kg)


@gluon.jit
def _swab_consumer(ring, ready, empty, xq_smem, a_slots, xq_ptr, sx_ptr, s_ptr, y_ptr, N, stride_s,
                   KG: gl.constexpr, GPS: gl.constexpr, BN: gl.constexpr,
                   STAGES: gl.constexpr, EARLY: gl.constexpr, XQ: gl.constexpr):
    """One warpgroup: per ring stage, GPS wgmmas in flight (each its own [64, BN] result),
    waited for in turn and added into acc times their [BN] scales; row 0 of acc is y."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BN, 32])
    XB: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    pid = gl.program_id(0)
    G = gl.num_programs(0)
    SPB: gl.constexpr = KG // GPS  # ring stages per row block
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, MMA))
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
    if EARLY:
        _gdc_launch()
    _gdc_wait()
    if not EARLY:
        _gdc_launch()
    XS: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    r16 = gl.arange(0, 16, layout=gl.SliceLayout(1, XB))
    c128 = gl.arange(0, 128, layout=gl.SliceLayout(0, XB))
    for k in gl.static_range(0, XQ // 128, 16):  # the activation [K] e4m3 into smem
        c = (k + r16)[:, None] * 128 + c128[None, :]
        # the whole buffer reinterpreted, then sliced (slice first: Triton's lowering asserts)
        xq_smem._reinterpret(gl.float8e4nv, [XQ // 128, 128], XS).slice(k, 16).store(
            gl.load(xq_ptr + c, mask=c < KG * 128, other=0.0))
    ZL: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    for g in gl.static_range(GPS):  # rows 1..63 of every A slot stay zero
        a_slots.index(g).store(gl.zeros([64, 128], gl.float8e4nv, ZL))
    gl.thread_barrier()
    acc = gl.zeros([64, BN], gl.float32, MMA)
    zero = gl.zeros([64, BN], gl.float32, MMA)
    for t in range(((gl.cdiv(N, BN) - pid + G - 1) // G) * SPB):
        s = t % STAGES
        kg = (t % SPB) * GPS
        n = (pid + (t // SPB) * G) * BN + cols
        sc0 = gl.expand_dims(_swab_scale(s_ptr, sx_ptr, stride_s, n, N, kg), 0)
        _swab_rows(a_slots, xq_smem, kg, GPS)
        mbarrier.wait(ready.index(s), (t // STAGES) & 1)
        tok0 = _swab_issue(ring.index(s * GPS), a_slots, 0, zero)
        if GPS == 1:
            p0 = warpgroup_mma_wait(0, deps=[tok0])
            mbarrier.arrive(empty.index(s), count=1)
            acc += p0 * sc0
        if GPS == 2:
            sc1 = gl.expand_dims(_swab_scale(s_ptr, sx_ptr, stride_s, n, N, kg + 1), 0)
            tok1 = _swab_issue(ring.index(s * GPS + 1), a_slots, 1, zero)
            p0 = warpgroup_mma_wait(1, deps=[tok0])
            p1 = warpgroup_mma_wait(0, deps=[tok1])
            mbarrier.arrive(empty.index(s), count=1)
            acc += p0 * sc0 + p1 * sc1
        if GPS == 4:
            sc1 = gl.expand_dims(_swab_scale(s_ptr, sx_ptr, stride_s, n, N, kg + 1), 0)
            sc2 = gl.expand_dims(_swab_scale(s_ptr, sx_ptr, stride_s, n, N, kg + 2), 0)
            sc3 = gl.expand_dims(_swab_scale(s_ptr, sx_ptr, stride_s, n, N, kg + 3), 0)
            tok1 = _swab_issue(ring.index(s * GPS + 1), a_slots, 1, zero)
            tok2 = _swab_issue(ring.index(s * GPS + 2), a_slots, 2, zero)
            tok3 = _swab_issue(ring.index(s * GPS + 3), a_slots, 3, zero)
            p0 = warpgroup_mma_wait(3, deps=[tok0])
            p1 = warpgroup_mma_wait(2, deps=[tok1])
            p2 = warpgroup_mma_wait(1, deps=[tok2])
            p3 = warpgroup_mma_wait(0, deps=[tok3])
            mbarrier.arrive(empty.index(s), count=1)
            acc += p0 * sc0 + p1 * sc1 + p2 * sc2 + p3 * sc3
        if t % SPB == SPB - 1:  # the row block is done: row 0 of acc is its y
            keep = (rows == 0)[:, None] & (n < N)[None, :]
            gl.store(y_ptr + n[None, :] + rows[:, None] * 0, acc.to(y_ptr.dtype.element_ty),
                     mask=keep)
            acc = gl.zeros([64, BN], gl.float32, MMA)


@gluon.jit
def _gemv_swab_kernel(w_desc, xq_ptr, sx_ptr, s_ptr, y_ptr, N, stride_s, KG: gl.constexpr,
                      GPS: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                      EARLY: gl.constexpr, XQ: gl.constexpr):
    ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES * GPS, BN, 128], w_desc.layout)
    xq_smem = gl.allocate_shared_memory(gl.float8e4nv, [XQ // 128, 1, 128],
                                        gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    a_slots = gl.allocate_shared_memory(gl.float8e4nv, [GPS, 64, 128],
                                        gl.NVMMASharedLayout.get_default_for([64, 128],
                                                                             gl.float8e4nv))
    ready, empty = ring_barriers(STAGES)
    gl.warp_specialize([
        (_swab_consumer, (ring, ready, empty, xq_smem, a_slots, xq_ptr, sx_ptr, s_ptr, y_ptr, N,
                          stride_s, KG, GPS, BN, STAGES, EARLY, XQ)),
        (_swab_loader, (w_desc, ring, ready, empty, N, KG, GPS, BN, STAGES)),
    ], [1], [40])


def swab_tile(N: int, K: int, sms: int, per_sm: int = 2, stage_bytes: int = 8192
              ) -> tuple[int, int, int]:
    """(BN, GPS, grid): BN rows per block (a power of 2, 8..128) that splits N into about a
    whole number of blocks per CTA over <= per_sm CTAs per SM (<= 4% idle), [BN, 128] boxes
    per ring stage (<= 4, ~stage_bytes, dividing K / 128), and the grid."""
    slots = sms * per_sm
    bn = 8
    for cand in (128, 64, 32, 16, 8):
        blocks = triton.cdiv(N, cand)
        if blocks / (triton.cdiv(blocks, slots) * slots) >= 0.96:
            bn = cand
            break
    gps = 1
    while gps < 4 and 2 * gps * bn * 128 <= stage_bytes and (K // 128) % (2 * gps) == 0:
        gps *= 2
    return bn, gps, min(triton.cdiv(N, bn), slots)


def gemv_swab(xq: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, s: torch.Tensor,
              y: torch.Tensor, sms: int, ring_kb: int, maxnreg: int = 128,
              early: bool = True, per_sm: int = 2, stage_bytes: int = 8192) -> None:
    """y [N] (bf16) = dequant(w, s) @ (xq * sx per 128-column group); the ring holds the
    largest power-of-2 number of stages that fits ring_kb KiB."""
    N, K = w.shape
    assert K % 128 == 0 and xq.numel() == K
    bn, gps, grid = swab_tile(N, K, sms, per_sm, stage_bytes)
    stages = 1 << ((ring_kb * 1024 // (gps * bn * 128)).bit_length() - 1)
    layout = gl.NVMMASharedLayout.get_default_for([bn, 128], gl.float8e4nv)
    desc = TensorDescriptor(w, [N, K], [K, 1], [bn, 128], layout)
    _gemv_swab_kernel[(grid,)](
        desc, xq, sx, s, y, N, s.stride(0), KG=K // 128, GPS=gps, BN=bn, STAGES=stages,
        EARLY=early, XQ=max(2048, triton.next_power_of_2(K)), num_warps=4, launch_pdl=True,
        maxnreg=maxnreg)

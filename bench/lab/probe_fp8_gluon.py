"""Can a persistent FP8 GEMV that streams its weight through shared memory with TMA beat the
one-row Triton GEMV in a batch-1 decode chain? (GPU, Hopper)

    python -m bench.lab.probe_fp8_gluon [--layers 36] [--out F.json]

Session 18 found the FP8 GEMVs stream at ~3.55 TB/s where bf16 ones reach ~4.2: a
register-tiled program keeps half the bytes in flight at FP8. Here each CTA (one or two per
SM, a persistent grid) owns a ring of STAGES weight tiles in shared memory that TMA fills; the
bytes in flight no longer cost registers, and before the PDL wait each CTA already has its
first STAGES tiles in flight while the kernel before it drains. Timed: 36 layers of Qwen3-8B's
four projections (FP8 weights, 128 x 128 block scales, prologue "none"), each layer its own
weights, one CUDA graph of PDL launches, against the same chain of the one-row Triton GEMV.
"""
from __future__ import annotations

import argparse
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)]


@gluon.jit
def _gdc_wait():
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _gdc_launch():
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _issue(w_desc, ring, bars, t, total, pid, G, KT: gl.constexpr, BLOCK_N: gl.constexpr,
           BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    """TMA the t-th tile of this CTA's sequence (row block pid + (t // KT) * G, K tile t % KT)
    into slot t % STAGES, if t < total."""
    s = t % STAGES
    ok = t < total
    rb = pid + (t // KT) * G
    mbarrier.expect(bars.index(s), BLOCK_N * BLOCK_K, pred=ok)
    tma.async_copy_global_to_shared(w_desc, [rb * BLOCK_N, (t % KT) * BLOCK_K], bars.index(s),
                                    ring.index(s), pred=ok)


@gluon.jit
def _act(x_ptr, s_ptr, stride_s, rb, kt, j, e, KT: gl.constexpr, BLOCK_N: gl.constexpr,
         BLOCK_K: gl.constexpr):
    """x[kt * BLOCK_K ..] as [BLOCK_K / 16, 16] fp32 times the block scale of row block rb."""
    sc = gl.load(s_ptr + (rb * BLOCK_N // 128) * stride_s + (kt * BLOCK_K + j * 16) // 128)
    x = gl.load(x_ptr + kt * BLOCK_K + j[:, None] * 16 + e[None, :])
    return x.to(gl.float32) * sc[:, None]


@gluon.jit
def _gemv_tma_kernel(w_desc, x_ptr, s_ptr, y_ptr, N, stride_s, K: gl.constexpr,
                     BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                     NUM_WARPS: gl.constexpr, USE_PDL: gl.constexpr):
    """y[N] = (W8 * block scales)[N, K] @ x[K]; CTA pid takes row blocks pid, pid + G, ...
    Weight tile [BLOCK_N, BLOCK_K] viewed as [BLOCK_N, BLOCK_K / 16, 16]: each thread reads
    16 consecutive bytes of a row (one LDS.128) and sums its 16 products in registers."""
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 16], [2, 16, 1], [NUM_WARPS, 1, 1], [2, 1, 0])
    XL: gl.constexpr = gl.SliceLayout(0, L3)   # [BLOCK_K / 16, 16]
    AL: gl.constexpr = gl.SliceLayout(2, L3)   # [BLOCK_N, BLOCK_K / 16]
    KT: gl.constexpr = K // BLOCK_K
    pid = gl.program_id(0)
    G = gl.num_programs(0)
    n_rb = gl.cdiv(N, BLOCK_N)
    total = ((n_rb - pid + G - 1) // G) * KT

    ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    for i in gl.static_range(STAGES):  # weights are never written: load before the wait
        _issue(w_desc, ring, bars, i, total, pid, G, KT, BLOCK_N, BLOCK_K, STAGES)
    if USE_PDL:
        _gdc_wait()
        _gdc_launch()

    j = gl.arange(0, BLOCK_K // 16, layout=gl.SliceLayout(1, XL))
    e = gl.arange(0, 16, layout=gl.SliceLayout(0, XL))
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, AL))
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
    # the activation slice (times its block scales) of tile t + 1 is loaded during tile t:
    # its L2 latency is then off the loop's critical path
    xs_n = _act(x_ptr, s_ptr, stride_s, pid, 0, j, e, KT, BLOCK_N, BLOCK_K)
    acc = gl.zeros([BLOCK_N, BLOCK_K // 16], gl.float32, AL)
    for t in range(total):
        xs = xs_n
        t1 = gl.minimum(t + 1, total - 1)
        xs_n = _act(x_ptr, s_ptr, stride_s, pid + (t1 // KT) * G, t1 % KT, j, e, KT, BLOCK_N,
                    BLOCK_K)
        s = t % STAGES
        mbarrier.wait(bars.index(s), (t // STAGES) & 1)
        w = ring.index(s)._reinterpret(gl.float8e4nv, [BLOCK_N, BLOCK_K // 16, 16],
                                       flat).load(L3)
        acc += gl.sum(w.to(gl.float32) * xs[None, :, :], axis=2)
        # every warp has used slot s (its values are in acc): refill it. No proxy fence: a
        # fence.proxy.async here compiles to MEMBAR.ALL.CTA, which also waits for the next
        # tile's activation loads in flight
        gl.thread_barrier()
        _issue(w_desc, ring, bars, t + STAGES, total, pid, G, KT, BLOCK_N, BLOCK_K, STAGES)
        if t % KT == KT - 1:
            n = (pid + (t // KT) * G) * BLOCK_N + rows
            gl.store(y_ptr + n, gl.sum(acc, axis=1).to(gl.bfloat16), mask=n < N)
            acc = gl.zeros([BLOCK_N, BLOCK_K // 16], gl.float32, AL)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


@gluon.jit
def _ws_loader(w_desc, ring, ready, empty, N, KT: gl.constexpr, BLOCK_N: gl.constexpr,
               BLOCK_K: gl.constexpr, STAGES: gl.constexpr, MODE: gl.constexpr):
    """One warp: TMA the CTA's tiles in order into the ring, each slot once its consumers
    released it (empty), across row-block boundaries; never waits for the kernel before."""
    pid = gl.program_id(0)
    G = gl.num_programs(0)
    total = ((gl.cdiv(N, BLOCK_N) - pid + G - 1) // G) * KT
    if MODE == 3:  # probe: the consumer computes on whatever the ring holds
        total = 0
    for t in range(total):
        s = t % STAGES
        mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), BLOCK_N * BLOCK_K)
        tma.async_copy_global_to_shared(w_desc, [(pid + (t // KT) * G) * BLOCK_N,
                                                 (t % KT) * BLOCK_K], ready.index(s),
                                        ring.index(s))


@gluon.jit
def _ws_consumer(ring, ready, empty, x_ptr, s_ptr, y_ptr, N, stride_s, KT: gl.constexpr,
                 BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                 NUM_WARPS: gl.constexpr, USE_PDL: gl.constexpr, MODE: gl.constexpr):
    """MODE (probes of where a CTA's time goes): 0 the GEMV; 1 no activation (row sums of
    the weights); 2 the stream alone (wait for each tile, release it, read nothing); 3 the
    compute alone (no TMA: the same slot read again, never waited for)."""
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 16], [2, 16, 1], [NUM_WARPS, 1, 1], [2, 1, 0])
    XL: gl.constexpr = gl.SliceLayout(0, L3)
    AL: gl.constexpr = gl.SliceLayout(2, L3)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
    pid = gl.program_id(0)
    G = gl.num_programs(0)
    total = ((gl.cdiv(N, BLOCK_N) - pid + G - 1) // G) * KT
    if USE_PDL:
        _gdc_wait()
        _gdc_launch()
    j = gl.arange(0, BLOCK_K // 16, layout=gl.SliceLayout(1, XL))
    e = gl.arange(0, 16, layout=gl.SliceLayout(0, XL))
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, AL))
    xs_n = _act(x_ptr, s_ptr, stride_s, pid, 0, j, e, KT, BLOCK_N, BLOCK_K)
    acc = gl.zeros([BLOCK_N, BLOCK_K // 16], gl.float32, AL)
    for t in range(total):
        xs = xs_n
        s = t % STAGES
        if MODE != 3:
            mbarrier.wait(ready.index(s), (t // STAGES) & 1)
        if MODE == 2:
            acc += 1.0
        else:
            w = ring.index(s)._reinterpret(gl.float8e4nv, [BLOCK_N, BLOCK_K // 16, 16],
                                           flat).load(L3)
            if MODE == 1:
                acc += gl.sum(w.to(gl.float32), axis=2)
            else:
                acc += gl.sum(w.to(gl.float32) * xs[None, :, :], axis=2)
        if MODE != 3:
            mbarrier.arrive(empty.index(s), count=1)
        if MODE == 0 or MODE == 3:
            t1 = gl.minimum(t + 1, total - 1)
            xs_n = _act(x_ptr, s_ptr, stride_s, pid + (t1 // KT) * G, t1 % KT, j, e, KT,
                        BLOCK_N, BLOCK_K)
        if t % KT == KT - 1:
            n = (pid + (t // KT) * G) * BLOCK_N + rows
            gl.store(y_ptr + n, gl.sum(acc, axis=1).to(gl.bfloat16), mask=n < N)
            acc = gl.zeros([BLOCK_N, BLOCK_K // 16], gl.float32, AL)


@gluon.jit
def _gemv_ws_kernel(w_desc, x_ptr, s_ptr, y_ptr, N, stride_s, K: gl.constexpr,
                    BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                    NUM_WARPS: gl.constexpr, USE_PDL: gl.constexpr, MODE: gl.constexpr):
    """_gemv_tma_kernel with the TMA issue in a warp of its own (warp specialization): the
    consumer warps never block on a CTA barrier, the loader runs up to STAGES tiles ahead."""
    KT: gl.constexpr = K // BLOCK_K
    ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_ws_consumer, (ring, ready, empty, x_ptr, s_ptr, y_ptr, N, stride_s, KT, BLOCK_N,
                        BLOCK_K, STAGES, NUM_WARPS, USE_PDL, MODE)),
        (_ws_loader, (w_desc, ring, ready, empty, N, KT, BLOCK_N, BLOCK_K, STAGES, MODE)),
    ], [1], [40])


@gluon.jit
def _chunk_scales(s_ptr, stride_s, rb, KT: gl.constexpr, KTP: gl.constexpr, CB: gl.constexpr,
                  BLOCK_N: gl.constexpr, SL: gl.constexpr):
    """Row block rb's 128 x 128 block scales, one per 16-column chunk of each K tile:
    [KTP (KT padded to a power of 2), CB] fp32 in SL."""
    kt = gl.arange(0, KTP, layout=gl.SliceLayout(1, SL))
    c = gl.arange(0, CB, layout=gl.SliceLayout(0, SL))
    col = kt[:, None] * CB + c[None, :]
    return gl.load(s_ptr + (rb * BLOCK_N // 128) * stride_s + col // 8,
                   mask=(kt < KT)[:, None], other=0.0)


@gluon.jit
def _take(ring, ready, t, STAGES: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
          L3: gl.constexpr):
    """Wait for tile t and load it from its slot: [BLOCK_N, BLOCK_K / 16, 16] e4m3 in L3."""
    s = t % STAGES
    mbarrier.wait(ready.index(s), (t // STAGES) & 1)
    return ring.index(s)._reinterpret(gl.float8e4nv, [BLOCK_N, BLOCK_K // 16, 16],
                                      gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])).load(L3)


@gluon.jit
def _tile_sum(w, x_smem, s_smem, kt, XL: gl.constexpr):
    """Each thread's 16-column sums of w times the activation and scales of K tile kt."""
    xv = x_smem.index(kt).load(XL).to(gl.float32)
    sc = s_smem.index(kt).load(gl.SliceLayout(1, XL))
    return gl.sum(w.to(gl.float32) * (xv * sc[:, None])[None, :, :], axis=2)


@gluon.jit
def _wss_consumer(ring, ready, empty, x_smem, s_smem, x_ptr, s_ptr, y_ptr, N, stride_s,
                  K: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                  STAGES: gl.constexpr, NUM_WARPS: gl.constexpr, USE_PDL: gl.constexpr,
                  PAIR: gl.constexpr):
    """_ws_consumer with no global load in its loop: after the PDL wait the activation is
    staged in shared memory (bf16 [K / 16, 16]); each row block's scales, one per 16-column
    chunk [K / 16], are loaded a row block ahead and stored there at its start."""
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 16], [2, 16, 1], [NUM_WARPS, 1, 1], [2, 1, 0])
    XL: gl.constexpr = gl.SliceLayout(0, L3)
    AL: gl.constexpr = gl.SliceLayout(2, L3)
    SL: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [NUM_WARPS, 1], [1, 0])
    XG: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [NUM_WARPS, 1], [1, 0])
    KT: gl.constexpr = K // BLOCK_K
    KTP: gl.constexpr = s_smem.shape[0]
    CB: gl.constexpr = BLOCK_K // 16  # chunks per tile
    pid = gl.program_id(0)
    G = gl.num_programs(0)
    n_rb = gl.cdiv(N, BLOCK_N)
    total = ((n_rb - pid + G - 1) // G) * KT
    sc_next = _chunk_scales(s_ptr, stride_s, pid, KT, KTP, CB, BLOCK_N, SL)  # no wait needed
    if USE_PDL:
        _gdc_wait()
        _gdc_launch()
    r = gl.arange(0, KTP * CB, layout=gl.SliceLayout(1, XG))  # the activation, all loads
    e16 = gl.arange(0, 16, layout=gl.SliceLayout(0, XG))  # in flight at once
    x_smem._reinterpret(gl.bfloat16, [KTP * CB, 16], gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
                        ).store(gl.load(x_ptr + r[:, None] * 16 + e16[None, :],
                                        mask=(r < KT * CB)[:, None], other=0.0))
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, AL))
    acc = gl.zeros([BLOCK_N, BLOCK_K // 16], gl.float32, AL)
    for t0 in range(0, total, 2 if PAIR else 1):
        kt = t0 % KT
        if kt == 0:  # a new row block: its scales to shared memory, the next one's loaded
            gl.thread_barrier()
            s_smem._reinterpret(gl.float32, [KTP, CB],
                                gl.SwizzledSharedLayout(1, 1, 1, [1, 0])).store(sc_next)
            gl.thread_barrier()
            nxt = gl.minimum(pid + (t0 // KT + 1) * G, n_rb - 1)
            sc_next = _chunk_scales(s_ptr, stride_s, nxt, KT, KTP, CB, BLOCK_N, SL)
        if PAIR:  # two tiles per pass: both loaded before either is summed (more in flight
            # per warp between the partition's barriers)
            t = t0 + 1
            w0 = _take(ring, ready, t0, STAGES, BLOCK_N, BLOCK_K, L3)
            w1 = _take(ring, ready, t, STAGES, BLOCK_N, BLOCK_K, L3)
            acc += _tile_sum(w0, x_smem, s_smem, kt, XL)
            acc += _tile_sum(w1, x_smem, s_smem, kt + 1, XL)
            mbarrier.arrive(empty.index(t0 % STAGES), count=1)
            mbarrier.arrive(empty.index(t % STAGES), count=1)
            kt += 1
        else:
            t = t0
            w = _take(ring, ready, t, STAGES, BLOCK_N, BLOCK_K, L3)
            acc += _tile_sum(w, x_smem, s_smem, kt, XL)
            mbarrier.arrive(empty.index(t % STAGES), count=1)
        if kt == KT - 1:
            n = (pid + (t // KT) * G) * BLOCK_N + rows
            gl.store(y_ptr + n, gl.sum(acc, axis=1).to(gl.bfloat16), mask=n < N)
            acc = gl.zeros([BLOCK_N, BLOCK_K // 16], gl.float32, AL)


@gluon.jit
def _gemv_wss_kernel(w_desc, x_ptr, s_ptr, y_ptr, N, stride_s, K: gl.constexpr,
                     BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                     NUM_WARPS: gl.constexpr, USE_PDL: gl.constexpr, MODE: gl.constexpr):
    """_gemv_ws_kernel with the activation and scales staged in shared memory."""
    ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    KT: gl.constexpr = K // BLOCK_K
    KTP: gl.constexpr = 1 << (KT - 1).bit_length()
    # layouts of rank one less than the shape: .index(kt) views one K tile
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [KTP, BLOCK_K // 16, 16],
                                       gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    s_smem = gl.allocate_shared_memory(gl.float32, [KTP, BLOCK_K // 16],
                                       gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_wss_consumer, (ring, ready, empty, x_smem, s_smem, x_ptr, s_ptr, y_ptr, N, stride_s,
                         K, BLOCK_N, BLOCK_K, STAGES, NUM_WARPS, USE_PDL, MODE == 5)),
        (_ws_loader, (w_desc, ring, ready, empty, N, K // BLOCK_K, BLOCK_N, BLOCK_K, STAGES,
                      MODE)),
    ], [1], [40])


@gluon.jit
def _mma_loader(w_desc, ring, ready, empty, N, K: gl.constexpr, BLOCK_N: gl.constexpr,
                STAGES: gl.constexpr):
    """One warp: the CTA's [BLOCK_N, 128] weight tiles into the ring (as _ws_loader)."""
    pid = gl.program_id(0)
    G = gl.num_programs(0)
    KT: gl.constexpr = K // 128
    total = ((gl.cdiv(N, BLOCK_N) - pid + G - 1) // G) * KT
    for t in range(total):
        s = t % STAGES
        mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), BLOCK_N * 128)
        tma.async_copy_global_to_shared(w_desc, [(pid + (t // KT) * G) * BLOCK_N,
                                                 (t % KT) * 128], ready.index(s),
                                        ring.index(s))


@gluon.jit
def _a_tile(xq_ptr, kt, rows, cols):
    """The activation's K tile kt as the wgmma A operand [64, 128] e4m3: row 0 the
    quantized activation, rows 1..63 zero (only the lanes holding row 0 load)."""
    return gl.load(xq_ptr + kt * 128 + cols[None, :] + rows[:, None] * 0,
                   mask=(rows == 0)[:, None], other=0.0)


@gluon.jit
def _mma_consumer(ring, ready, empty, xq_ptr, sx_ptr, s_ptr, y_ptr, N, stride_s,
                  K: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  USE_PDL: gl.constexpr):
    """One warpgroup. Per K tile: acc_t [64, BLOCK_N] = A (the quantized activation in row
    0) @ W_tile^T on the tensor cores, then acc += acc_t * (weight block scale * activation
    group scale); row 0 of acc is y for the row block."""
    KT: gl.constexpr = K // 128
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_N, 32])
    AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
    pid = gl.program_id(0)
    G = gl.num_programs(0)
    total = ((gl.cdiv(N, BLOCK_N) - pid + G - 1) // G) * KT
    rows_a = gl.arange(0, 64, layout=gl.SliceLayout(1, AL))
    cols_a = gl.arange(0, 128, layout=gl.SliceLayout(0, AL))
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA))
    if USE_PDL:
        _gdc_wait()
        _gdc_launch()
    a_n = _a_tile(xq_ptr, 0, rows_a, cols_a)
    sc_n = gl.load(s_ptr + (pid * BLOCK_N // 128) * stride_s) * gl.load(sx_ptr)
    acc = gl.zeros([64, BLOCK_N], gl.float32, MMA)
    for t in range(total):
        a = a_n
        sc = sc_n
        t1 = gl.minimum(t + 1, total - 1)  # the next tile's operand and scale, in flight now
        a_n = _a_tile(xq_ptr, t1 % KT, rows_a, cols_a)
        sc_n = gl.load(s_ptr + ((pid + (t1 // KT) * G) * BLOCK_N // 128) * stride_s
                       + t1 % KT) * gl.load(sx_ptr + t1 % KT)
        s = t % STAGES
        mbarrier.wait(ready.index(s), (t // STAGES) & 1)
        part = warpgroup_mma(a, ring.index(s).permute((1, 0)),
                             gl.zeros([64, BLOCK_N], gl.float32, MMA), use_acc=False)
        mbarrier.arrive(empty.index(s), count=1)
        acc += part * sc
        if t % KT == KT - 1:
            n = (pid + (t // KT) * G) * BLOCK_N + cols
            gl.store(y_ptr + n[None, :] + rows[:, None] * 0, acc.to(gl.bfloat16),
                     mask=(rows == 0)[:, None] & (n < N)[None, :])
            acc = gl.zeros([64, BLOCK_N], gl.float32, MMA)


@gluon.jit
def _gemv_mma_kernel(w_desc, xq_ptr, sx_ptr, s_ptr, y_ptr, N, stride_s, K: gl.constexpr,
                     BLOCK_N: gl.constexpr, STAGES: gl.constexpr, USE_PDL: gl.constexpr):
    """The FP8 GEMV on the tensor cores: the activation quantized to e4m3 per 128-column
    group (xq [K], sx [K / 128]), W8 tiles [BLOCK_N, 128] streamed by TMA as wgmma's B."""
    ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, 128], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_mma_consumer, (ring, ready, empty, xq_ptr, sx_ptr, s_ptr, y_ptr, N, stride_s, K,
                         BLOCK_N, STAGES, USE_PDL)),
        (_mma_loader, (w_desc, ring, ready, empty, N, K, BLOCK_N, STAGES)),
    ], [1], [40])


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
def _mmb_consumer(ring, ready, empty, xq_smem, xq_ptr, sx_ptr, s_ptr, y_ptr, N, stride_s,
                  KTS: gl.constexpr, SPLIT: gl.constexpr, STAGES: gl.constexpr,
                  USE_PDL: gl.constexpr, ATOMIC: gl.constexpr):
    """One warpgroup. The CTA's K range of the quantized activation is staged as wgmma's B,
    [KTS][8, 128] e4m3 (row 0 the activation, rows 1..7 zero); per tile acc_t [64, 8] =
    W_tile @ B on the tensor cores, acc += acc_t * (weight block scale * activation group
    scale); column 0 of acc is the row block's partial y, stored to y[ks, rows]."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, 8, 32])
    XB: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    pid = gl.program_id(0)
    GS = gl.num_programs(0) // SPLIT
    first = pid // SPLIT
    k0 = (pid % SPLIT) * KTS  # first K tile of this CTA's split
    total = ((gl.cdiv(N, 64) - first + GS - 1) // GS) * KTS
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
    cols = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    if USE_PDL:
        _gdc_wait()
        _gdc_launch()
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
    acc = gl.zeros([64, 8], gl.float32, MMA)
    # the tile's scale (weight block x activation group) is loaded two tiles ahead: its
    # latency stays off the loop
    sc1 = _mmb_scale(s_ptr, sx_ptr, stride_s, first, GS, k0, 0, KTS)
    sc2 = _mmb_scale(s_ptr, sx_ptr, stride_s, first, GS, k0, gl.minimum(1, total - 1), KTS)
    for t in range(total):
        rb = first + (t // KTS) * GS
        kl = t % KTS
        sc = sc1
        sc1 = sc2
        sc2 = _mmb_scale(s_ptr, sx_ptr, stride_s, first, GS, k0, gl.minimum(t + 2, total - 1),
                         KTS)
        s = t % STAGES
        mbarrier.wait(ready.index(s), (t // STAGES) & 1)
        part = warpgroup_mma(ring.index(s), xq_smem.index(kl).permute((1, 0)),
                             gl.zeros([64, 8], gl.float32, MMA), use_acc=False)
        mbarrier.arrive(empty.index(s), count=1)
        acc += part * sc
        if kl == KTS - 1:
            n = rb * 64 + rows
            keep = (n < N)[:, None] & (cols == 0)[None, :]
            if ATOMIC:  # fire-and-forget reductions (RED) into a zeroed fp32 y [N]
                gl.atomic_add(y_ptr + n[:, None] + cols[None, :] * 0, acc, mask=keep,
                              sem="relaxed")
            else:
                gl.store(y_ptr + (pid % SPLIT) * N + n[:, None] + cols[None, :] * 0, acc,
                         mask=keep)
            acc = gl.zeros([64, 8], gl.float32, MMA)


@gluon.jit
def _gemv_mmb_kernel(w_desc, xq_ptr, sx_ptr, s_ptr, y_ptr, N, stride_s, KTS: gl.constexpr,
                     SPLIT: gl.constexpr, STAGES: gl.constexpr, USE_PDL: gl.constexpr,
                     ATOMIC: gl.constexpr):
    """The FP8 GEMV on the tensor cores with the weights as wgmma's A (M = 64 rows) and the
    quantized activation as B (N = 8, one real column); CTA pid takes K split pid % SPLIT
    (KTS tiles of 128) of every (G / SPLIT)-th 64-row block."""
    ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 64, 128], w_desc.layout)
    xq_smem = gl.allocate_shared_memory(gl.float8e4nv, [KTS, 8, 128],
                                        gl.NVMMASharedLayout(128, 8, rank=2))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_mmb_consumer, (ring, ready, empty, xq_smem, xq_ptr, sx_ptr, s_ptr, y_ptr, N,
                         stride_s, KTS, SPLIT, STAGES, USE_PDL, ATOMIC)),
        (_mmb_loader, (w_desc, ring, ready, empty, N, KTS, SPLIT, STAGES)),
    ], [1], [40])


def gemv_mmb(xq: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, s: torch.Tensor,
             y: torch.Tensor, grid: int, split: int, stages: int, atomic: bool = False,
             maxnreg: int = 128) -> None:
    """y [split, N] fp32 partials (sum over dim 0 is the GEMV), or with atomic a zeroed
    [N] fp32 that the K splits add into."""
    N, K = w.shape
    layout = gl.NVMMASharedLayout.get_default_for([64, 128], gl.float8e4nv)
    desc = TensorDescriptor(w, [N, K], [K, 1], [64, 128], layout)
    assert grid % split == 0 and (K // 128) % split == 0
    _gemv_mmb_kernel[(grid,)](desc, xq, sx, s, y, N, s.stride(0), KTS=K // 128 // split,
                              SPLIT=split, ATOMIC=atomic,
                              STAGES=stages, USE_PDL=True, num_warps=4, launch_pdl=True,
                              maxnreg=maxnreg)


def quantize_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [K] -> (e4m3 [K], fp32 scales [K / 128]): one scale per 128-column group."""
    g = x.float().view(-1, 128)
    sx = (g.abs().amax(dim=1) / 448.0).clamp(min=1e-12)
    return (g / sx[:, None]).to(torch.float8_e4m3fn).view(-1), sx


def gemv_mma(xq: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, s: torch.Tensor,
             y: torch.Tensor, grid: int, block_n: int, stages: int, maxnreg: int = 128) -> None:
    N, K = w.shape
    layout = gl.NVMMASharedLayout.get_default_for([block_n, 128], gl.float8e4nv)
    desc = TensorDescriptor(w, [N, K], [K, 1], [block_n, 128], layout)
    _gemv_mma_kernel[(grid,)](desc, xq, sx, s, y, N, s.stride(0), K=K, BLOCK_N=block_n,
                              STAGES=stages, USE_PDL=True, num_warps=4, launch_pdl=True,
                              maxnreg=maxnreg)


def gemv_tma(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, y: torch.Tensor, grid: int,
             block_n: int, block_k: int, stages: int, num_warps: int, ws: str = "",
             maxnreg: int = 128) -> None:
    """x [K] bf16, w [N, K] e4m3, s [N / 128, K / 128] fp32, y [N] bf16."""
    N, K = w.shape
    assert K % block_k == 0 and 128 % block_n == 0 and block_k % 128 == 0
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
    desc = TensorDescriptor(w, [N, K], [K, 1], [block_n, block_k], layout)
    kernel = _gemv_wss_kernel if ws.startswith("wss") else _gemv_ws_kernel if ws else \
        _gemv_tma_kernel
    modes = {"ws": 0, "wsnoact": 1, "wsstream": 2, "wscompute": 3, "wss": 0, "wsspair": 5}
    extra = {"maxnreg": maxnreg, "MODE": modes[ws]} if ws else {}
    kernel[(grid,)](desc, x, s, y, N, s.stride(0), K=K, BLOCK_N=block_n, BLOCK_K=block_k,
                    STAGES=stages, NUM_WARPS=num_warps, USE_PDL=True, num_warps=num_warps,
                    launch_pdl=True, **extra)


def _layers(n_layers: int, dev) -> list:
    from pdserve.kernels.fp8_scales import FP8_DTYPE
    out = []
    for _ in range(n_layers):
        layer = []
        for _name, N, K in SHAPES:
            w = (torch.randn(N, K, device=dev) * 64).clamp(-448, 448).to(FP8_DTYPE)
            s = (torch.rand(N // 128, K // 128, device=dev) + 0.5) / (64 * K ** 0.5)
            x = torch.randn(K, device=dev, dtype=torch.bfloat16)
            layer.append((w, s, x, torch.empty(N, device=dev, dtype=torch.bfloat16)))
        out.append(layer)
    return out


def _graph_us(fn) -> float:
    from triton.testing import do_bench_cudagraph
    fn()
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=100) * 1e3


def _mmb_variant(v: str, layers: list, sms: int, nbytes: int, n_layers: int) -> dict:
    """"mmb-Sq-So-Sg-Sd-STAGES-PER_SM[-REGS][-a]": the tensor-core GEMV, K splits per shape (q/k/v, o,
    gate_up, down). Activations quantized beforehand (untimed); times the GEMVs alone (their
    fp32 partials over the K splits are left for the next kernel to add)."""
    from pdserve.kernels.reference import fp8_dequant_ref
    fields = v.split("-")[1:]
    atomic = fields[-1] == "a"
    nums = [int(t) for t in (fields[:-1] if atomic else fields)]
    splits, (stages, per_sm), regs = nums[:4], nums[4:6], (nums[6:] or [128])[0]
    grid = sms * per_sm
    try:
        calls = []
        for layer in layers:
            row = []
            for (w, s, x, _y), split in zip(layer, splits):
                xq, sx = quantize_act(x)
                part = torch.zeros(1 if atomic else split, w.shape[0], device=w.device,
                                   dtype=torch.float32)
                row.append((xq, sx, w, s, part, split))
            calls.append(row)
        errs = {}
        for (xq, sx, w, s, part, split), (name, _n, _k) in zip(calls[0], SHAPES):
            gemv_mmb(xq, sx, w, s, part, grid, split, stages, atomic, regs)
            wd = fp8_dequant_ref(w, s, (128, 128)).float()
            xd = (xq.float().view(-1, 128) * sx[:, None]).view(-1)
            got = part.sum(0)
            ref_q = wd @ xd
            ref = wd @ layers[0][[n for n, _, _ in SHAPES].index(name)][2].float()
            errs[name] = [round(float((got - ref_q).norm() / ref_q.norm()), 6),
                          round(float((got - ref).norm() / ref.norm()), 6)]

        def chain(idx=None):
            for row in calls:
                for i, (xq, sx, w, s, part, split) in enumerate(row):
                    if idx is None or i == idx:
                        gemv_mmb(xq, sx, w, s, part, grid, split, stages, atomic, regs)
        us = _graph_us(chain) / n_layers
        return {"us_per_layer": round(us, 2), "TBps": round(nbytes / us / 1e6, 3),
                "rel_err_vs_quantized_act_and_vs_bf16_act": errs,
                "us_alone": {name: round(_graph_us(lambda i=i: chain(i)) / n_layers, 2)
                             for i, (name, _n, _k) in enumerate(SHAPES)}}
    except Exception as exc:  # noqa: BLE001 - a probe records what failed and goes on
        return {"error": f"{type(exc).__name__}: {exc}"[:800]}


def _once(shape: str, variant: str) -> None:
    """Shape's kernel, a few launches: "triton" or a variant of main's --variants."""
    from pdserve.kernels.ops import gemv
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    (w, s, x, y), = [lay for n, lay in zip([n for n, _, _ in SHAPES], _layers(1, dev)[0])
                     if n == shape]
    for _ in range(3):
        if variant == "triton":
            gemv(x[None], w, "none", scales=s, block=(128, 128))
        else:
            parts = variant.split("x")
            bn, bk, stages, per_sm, warps = (int(t) for t in parts[:5])
            regs = int(parts[6]) if len(parts) > 6 else 128
            gemv_tma(x, w, s, y, sms * per_sm, bn, bk, stages, warps, parts[5], regs)
    torch.cuda.synchronize()


def main() -> None:
    from pdserve.kernels.gemv_configs import pick_config
    from pdserve.kernels.ops import gemv
    from pdserve.kernels.reference import fp8_dequant_ref

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--variants", default="16x256x4x2x4,16x256x6x2x8,32x256x4x2x4,"
                    "32x256x4x2x8,32x256x6x1x8,64x256x3x1x8,16x256x4x3x4,16x256x8x1x8")
    ap.add_argument("--out", default=None)
    ap.add_argument("--once", default=None, metavar="SHAPE:VARIANT",
                    help="run one kernel a few times, no graph (a target for ncu), and exit")
    args = ap.parse_args()
    if args.once:
        _once(*args.once.split(":"))
        return
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    layers = _layers(args.layers, dev)
    nbytes = sum(N * K for _n, N, K in SHAPES)
    out: dict = {"what": __doc__.split("\n")[0], "layers": args.layers, "sms": sms,
                 "bytes_per_layer": nbytes, "variants": {}}

    def triton_chain():
        for layer in layers:
            for w, s, x, _y in layer:
                gemv(x[None], w, "none", scales=s, block=(128, 128))
    us = _graph_us(triton_chain) / args.layers
    out["triton_one_row"] = {"us_per_layer": round(us, 2), "TBps": round(nbytes / us / 1e6, 3),
                             "us_alone": {n: round(_graph_us(lambda i=i: [gemv(
                                 lay[i][2][None], lay[i][0], "none", scales=lay[i][1],
                                 block=(128, 128)) for lay in layers]) / args.layers, 2)
                                 for i, (n, _, _) in enumerate(SHAPES)}}
    print("triton", out["triton_one_row"], file=sys.stderr, flush=True)
    cfgs = {n: pick_config(N, K, 1, 1, None, dev) for n, N, K in SHAPES}
    out["triton_tiles"] = {n: [c.block_n, c.block_k, c.num_warps] for n, c in cfgs.items()}

    w, s, x, y = layers[0][2]
    ref = (fp8_dequant_ref(w, s, (128, 128)).float() @ x.float())
    for v in args.variants.split(","):
        if v.startswith("mmb"):
            out["variants"][v] = _mmb_variant(v, layers, sms, nbytes, args.layers)
            print(v, out["variants"][v], file=sys.stderr, flush=True)
            continue
        parts = v.split("x")
        bn, bk, stages, per_sm, warps = (int(t) for t in parts[:5])
        ws = parts[5] if len(parts) > 5 else ""
        regs = int(parts[6]) if len(parts) > 6 else 128
        try:
            gemv_tma(x, w, s, y, sms * per_sm, bn, bk, stages, warps, ws, regs)
            err = float((y.float() - ref).norm() / ref.norm())

            def chain(bn=bn, bk=bk, stages=stages, per_sm=per_sm, warps=warps, ws=ws,
                      regs=regs):
                for layer in layers:
                    for w, s, x, y in layer:
                        gemv_tma(x, w, s, y, sms * per_sm, bn, bk, stages, warps, ws, regs)
            us = _graph_us(chain) / args.layers
            row = {"us_per_layer": round(us, 2), "TBps": round(nbytes / us / 1e6, 3),
                   "rel_err": err}
            per = {}
            for i, (name, _n, _k) in enumerate(SHAPES):
                per[name] = round(_graph_us(lambda i=i: [gemv_tma(
                    lay[i][2], lay[i][0], lay[i][1], lay[i][3], sms * per_sm, bn, bk, stages,
                    warps, ws, regs) for lay in layers]) / args.layers, 2)  # noqa: B023
            row["us_alone"] = per
        except Exception as exc:  # noqa: BLE001 - a probe records what failed and goes on
            row = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        out["variants"][v] = row
        print(v, row, file=sys.stderr, flush=True)
    from bench.lab.probe_fp8_vec import write_result
    write_result(out, "bench.lab.probe_fp8_gluon", args.out)


if __name__ == "__main__":
    main()

"""FP8 one-row GEMVs in Gluon on the CUDA cores, for bench/lab/probe_fp8_gluon.py: a
persistent grid whose CTAs stream their weight tiles through a shared-memory ring that
TMA fills (_gemv_tma_kernel: the refill behind a CTA barrier; _gemv_ws_kernel: the TMA
issue in a warp of its own, with probe MODEs; _gemv_wss_kernel: the activation and
scales staged in shared memory). Lab code: measured, not used by the engine."""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from pdserve.kernels.fp8_gemv_tc import _gdc_launch, _gdc_wait  # noqa: F401 (re-exported)


@gluon.jit
def ring_barriers(STAGES: gl.constexpr):
    """(ready, empty): one pair of mbarriers per ring slot, initialized; the loader waits on
    empty, the consumer on ready."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    return ready, empty


@gluon.jit
def _store_rows(y_ptr, acc, n, N):
    """A finished row block: y[n] = the rows' sums of acc [BLOCK_N, chunks], in bf16."""
    gl.store(y_ptr + n, gl.sum(acc, axis=1).to(gl.bfloat16), mask=n < N)


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
            _store_rows(y_ptr, acc, (pid + (t // KT) * G) * BLOCK_N + rows, N)
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
            _store_rows(y_ptr, acc, (pid + (t // KT) * G) * BLOCK_N + rows, N)
            acc = gl.zeros([BLOCK_N, BLOCK_K // 16], gl.float32, AL)


@gluon.jit
def _gemv_ws_kernel(w_desc, x_ptr, s_ptr, y_ptr, N, stride_s, K: gl.constexpr,
                    BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                    NUM_WARPS: gl.constexpr, USE_PDL: gl.constexpr, MODE: gl.constexpr):
    """_gemv_tma_kernel with the TMA issue in a warp of its own (warp specialization): the
    consumer warps never block on a CTA barrier, the loader runs up to STAGES tiles ahead."""
    KT: gl.constexpr = K // BLOCK_K
    ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    ready, empty = ring_barriers(STAGES)
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
            _store_rows(y_ptr, acc, (pid + (t // KT) * G) * BLOCK_N + rows, N)
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
    ready, empty = ring_barriers(STAGES)
    gl.warp_specialize([
        (_wss_consumer, (ring, ready, empty, x_smem, s_smem, x_ptr, s_ptr, y_ptr, N, stride_s,
                         K, BLOCK_N, BLOCK_K, STAGES, NUM_WARPS, USE_PDL, MODE == 5)),
        (_ws_loader, (w_desc, ring, ready, empty, N, K // BLOCK_K, BLOCK_N, BLOCK_K, STAGES,
                      MODE)),
    ], [1], [40])


def gemv_tma(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, y: torch.Tensor, grid: int,
             block_n: int, block_k: int, stages: int, num_warps: int, ws: str = "",
             maxnreg: int = 128) -> None:
    """x [K] bf16, w [N, K] e4m3, s [N / 128, K / 128] fp32, y [N] bf16."""
    N, K = w.shape
    assert K % block_k == 0 and 128 % block_n == 0 and block_k % 128 == 0
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
    desc = TensorDescriptor(w, [N, K], [K, 1], [block_n, block_k], layout)
    kernel = _gemv_wss_kernel if ws in ("wss", "wsspair") else _gemv_ws_kernel if ws else \
        _gemv_tma_kernel  # by exact name: "wsstream" begins with "wss" too
    modes = {"ws": 0, "wsnoact": 1, "wsstream": 2, "wscompute": 3, "wss": 0, "wsspair": 5}
    extra = {"maxnreg": maxnreg, "MODE": modes[ws]} if ws else {}
    kernel[(grid,)](desc, x, s, y, N, s.stride(0), K=K, BLOCK_N=block_n, BLOCK_K=block_k,
                    STAGES=stages, NUM_WARPS=num_warps, USE_PDL=True, num_warps=num_warps,
                    launch_pdl=True, **extra)

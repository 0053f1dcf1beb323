"""o_proj -> gate_up -> down of a batch-1 FP8 decode layer in ONE launch (Hopper, Gluon):

    o       += attn @ Wo^T + res                   (fp32, RED over K splits)
    gate_up += rmsnorm(o) @ Wgu^T
    down    += silu(gate) * up @ Wd^T + o

Why (docs/design.md, "The tensor-core GEMV"): between two GEMV launches the weight stream
stops. The next launch's CTAs take an SM only once the last one's leave it (shared memory),
and their first bytes arrive a microsecond or more later; in the step gate_up took 28.2 us a
layer against 23.9 at the copy rate. Here one grid, sized to be resident at once (2 CTAs per
SM), streams all three weights through one shared-memory ring: the loader warp goes from
o_proj's tiles to gate_up's to down's without a pause, while the consumer warpgroup syncs
the grid between the phases (an arrival counter in global memory, CUDA cooperative groups'
pattern). Each phase is the GEMV of kernels/fp8_gemv_tc.py with its own K split.

Lifecycle of one CTA: loader warp streams o's tiles (before the PDL wait: the attention is
still running), waits, then gate_up's and down's | consumer: PDL wait -> zero its slice of
the `zero` buffers -> o phase -> grid sync -> gate_up phase (norm) -> grid sync -> let the
next launch in -> down phase (silu).

gate_up's and down's row blocks are claimed, not dealt: the CTAs of one K split take them
from a counter one at a time, so that a CTA whose SM streams slower takes fewer and the grid
reaches each sync together (dealt evenly, the CTAs ended gate_up 9 us apart).

The counters (int64 [COUNTERS], TcBuffers keeps them): [0] the syncs' arrivals, [16 + s]
gate_up's and [32 + s] down's row blocks of K split s. They only grow, and each launch moves
each by a fixed amount, so no launch resets them; one set serves one layer shape. CPU and the interpreter:
fp8_gemv_tc_ref three times (kernels/reference.py).
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from pdserve.kernels._triton import check_tensor, num_sms
from pdserve.kernels.fp8_gemv_tc import (
    GROUP_K,
    ROWS,
    TcPlan,
    _add_rows,
    _consume,
    _gdc_launch,
    _gdc_wait,
    _load_tiles,
    _out,
    _prologue,
    _row_block,
    _row_scales,
    _zero,
    mark,
    tc_available,
    tc_fits,
    tc_plan,
)

COUNTERS = 64

# Thread 0 of the CTA: release the CTA's writes (its warpgroup barrier came before), arrive,
# and spin until the count reaches the next multiple of the grid size $2.
_GRID_SYNC_ASM = gl.constexpr("""{
.reg .pred p, q;
.reg .u32 t;
.reg .u64 old, tgt, v, g;
mov.u32 t, %tid.x;
setp.ne.u32 p, t, 0;
@p bra DONE_${:uid};
cvt.u64.u32 g, $2;
fence.acq_rel.gpu;
atom.add.release.gpu.global.u64 old, [$1], 1;
div.u64 tgt, old, g;
add.u64 tgt, tgt, 1;
mul.lo.u64 tgt, tgt, g;
SPIN_${:uid}:
ld.acquire.gpu.global.u64 v, [$1];
setp.lt.u64 q, v, tgt;
@q bra SPIN_${:uid};
DONE_${:uid}:
mov.u32 $0, 0;
}""")


@gluon.jit
def _grid_sync(cnt_ptr):
    """Every CTA of the grid has reached this point, and what any wrote before it is visible
    to all after it. The grid must be resident at once (the launcher sizes it so)."""
    gl.thread_barrier()
    gl.inline_asm_elementwise(_GRID_SYNC_ASM, "=r,l,r", [cnt_ptr, gl.num_programs(0)],
                              dtype=gl.int32, is_pure=False, pack=1)
    gl.thread_barrier()


@gluon.jit
def _claim(ctr_ptr, nb, GS):
    """The next row block of the CTA's K split that no CTA has taken, or -1. The split's GS
    CTAs each claim until they are refused, so a launch moves the counter by exactly nb + GS
    and the count modulo that is this launch's."""
    v = gl.atomic_add(ctr_ptr, 1, sem="relaxed")
    m = (v % (nb + GS)).to(gl.int32)
    return gl.where(m < nb, m, -1)


@gluon.jit
def _load_claimed(w_desc, ring, ready, empty, slots, ctr_ptr, N, t0, KTS: gl.constexpr,
                  SPLIT: gl.constexpr, STAGES: gl.constexpr):
    """One weight's row blocks claimed one at a time (the CTAs of a K split share them, so
    one whose SM streams slower takes fewer): each block's KTS tiles into the ring with the
    block's index in `slots` beside its first tile, then a slot holding -1 (no tile) to say
    the weight is done. Returns the ring position after it."""
    SL1: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    pid = gl.program_id(0)
    GS = gl.num_programs(0) // SPLIT
    nb = gl.cdiv(N, 64)
    ctr = ctr_ptr + pid % SPLIT
    u = t0
    rb = _claim(ctr, nb, GS)
    while rb >= 0:
        for k in range(KTS):
            s = (u + k) % STAGES
            mbarrier.wait(empty.index(s), (((u + k) // STAGES) & 1) ^ 1)
            slots.index(s).store(gl.full([1], rb, gl.int32, SL1))
            mbarrier.expect(ready.index(s), 64 * 128)
            tma.async_copy_global_to_shared(
                w_desc, [rb * 64, ((pid % SPLIT) * KTS + k) * 128], ready.index(s),
                ring.index(s))
        u += KTS
        rb = _claim(ctr, nb, GS)
    s = u % STAGES
    mbarrier.wait(empty.index(s), ((u // STAGES) & 1) ^ 1)
    slots.index(s).store(gl.full([1], -1, gl.int32, SL1))
    mbarrier.arrive(ready.index(s), count=1)
    return u + 1


@gluon.jit
def _next_block(ready, slots, u, STAGES: gl.constexpr):
    """The row block whose first tile is at ring position u (-1: the weight is done), once
    the loader has filled that slot."""
    SL4: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    s = u % STAGES
    mbarrier.wait(ready.index(s), (u // STAGES) & 1)
    return gl.max(slots.index(s).load(SL4), axis=0)


@gluon.jit
def _consume_claimed(ring, ready, empty, slots, xq_smem, sx_smem, x_ptr, nw_ptr, s_ptr,
                     out_ptr, add_ptr, N, stride_s, eps, t0, K: gl.constexpr,
                     KTS: gl.constexpr, SPLIT: gl.constexpr, STAGES: gl.constexpr,
                     GROUP: gl.constexpr, PROLOGUE: gl.constexpr, HAS_ADD: gl.constexpr,
                     tr_ptr, TR: gl.constexpr):
    """_consume (kernels/fp8_gemv_tc.py) for the row blocks _load_claimed took, in its
    order, up to its -1 slot (released here). Returns the ring position after it."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, 8, 32])
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
    cols = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    ks = gl.program_id(0) % SPLIT
    rstd = _prologue(x_ptr, nw_ptr, x_ptr, xq_smem, sx_smem, eps, ks * KTS, K, KTS, PROLOGUE,
                     False)
    if TR >= 0:
        mark(tr_ptr, TR)
    u = t0
    rb = _next_block(ready, slots, u, STAGES)
    while rb >= 0:
        wsc = _row_scales(s_ptr, stride_s, rb, ks * KTS, N, KTS)
        addv = _add_rows(add_ptr, rb, rows, N, ks == 0, HAS_ADD)
        acc = _row_block(ring, ready, empty, xq_smem, sx_smem, s_ptr, stride_s, rb, ks * KTS,
                         u, wsc, KTS, STAGES, GROUP, True)
        _out(out_ptr, add_ptr, acc, rb, rows, cols, N, rstd, ks == 0, addv, PROLOGUE, HAS_ADD,
             True)
        u += KTS
        rb = _next_block(ready, slots, u, STAGES)
    mbarrier.arrive(empty.index(u % STAGES), count=1)
    return u + 1


@gluon.jit
def _chain_loader(wo_desc, wg_desc, wd_desc, ring, ready, empty, slots, cnt_ptr, NO, NG, ND,
                  KTS_O: gl.constexpr, KTS_G: gl.constexpr, KTS_D: gl.constexpr,
                  S_O: gl.constexpr, S_G: gl.constexpr, S_D: gl.constexpr,
                  STAGES: gl.constexpr, WAIT_AFTER_O: gl.constexpr, tr_ptr,
                  TRACE: gl.constexpr):
    """One warp: o_proj's tiles (while the attention before still runs), then gate_up's and
    down's into the same ring with no pause. WAIT_AFTER_O: hold gate_up's until the
    attention has ended (its dependent loads slow down behind any other HBM traffic)."""
    if TRACE:
        mark(tr_ptr, 8)
    t = _load_tiles(wo_desc, ring, ready, empty, NO, 0, KTS_O, S_O, STAGES)
    if TRACE:
        mark(tr_ptr, 9)
    if WAIT_AFTER_O:
        _gdc_wait()
    if TRACE:
        mark(tr_ptr, 10)
    t = _load_claimed(wg_desc, ring, ready, empty, slots, cnt_ptr + 16, NG, t, KTS_G, S_G,
                      STAGES)
    if TRACE:
        mark(tr_ptr, 11)
    _load_claimed(wd_desc, ring, ready, empty, slots, cnt_ptr + 32, ND, t, KTS_D, S_D, STAGES)
    if TRACE:
        mark(tr_ptr, 12)


@gluon.jit
def _chain_consumer(ring, ready, empty, slots, xq_smem, sx_smem, attn_ptr, res_ptr, so_ptr, o_ptr,
                    nw_ptr, sg_ptr, gu_ptr, sd_ptr, dn_ptr, z1_ptr, z1_n, z2_ptr, z2_n,
                    cnt_ptr, NO, NG, ND, sso, ssg, ssd, eps,
                    KO: gl.constexpr, KG: gl.constexpr, KD: gl.constexpr,
                    KTS_O: gl.constexpr, KTS_G: gl.constexpr, KTS_D: gl.constexpr,
                    S_O: gl.constexpr, S_G: gl.constexpr, S_D: gl.constexpr,
                    G_O: gl.constexpr, G_G: gl.constexpr, G_D: gl.constexpr,
                    STAGES: gl.constexpr, ZCH: gl.constexpr, tr_ptr, TRACE: gl.constexpr):
    """One warpgroup: the module doc's lifecycle after the PDL wait. TRACE: timeline
    probes (mark) at each step, slots 0-7."""
    TR: gl.constexpr = 0 if TRACE else -100  # the prologue-done slots, TR + 2 / 4 / 6
    if TRACE:
        mark(tr_ptr, 0)
    _gdc_wait()
    if TRACE:
        mark(tr_ptr, 1)
    _zero(z1_ptr, z1_n, ZCH)
    _zero(z2_ptr, z2_n, ZCH)
    t = _consume(ring, ready, empty, xq_smem, sx_smem, attn_ptr, attn_ptr, res_ptr, so_ptr,
                 o_ptr, res_ptr, NO, sso, eps, 0, KO, KTS_O, S_O, STAGES, G_O, 0, True, False,
                 True, tr_ptr, TR + 2)
    if TRACE:
        mark(tr_ptr, 3)
    _grid_sync(cnt_ptr)
    t = _consume_claimed(ring, ready, empty, slots, xq_smem, sx_smem, o_ptr, nw_ptr, sg_ptr,
                         gu_ptr, gu_ptr, NG, ssg, eps, t, KG, KTS_G, S_G, STAGES, G_G, 1,
                         False, tr_ptr, TR + 4)
    if TRACE:
        mark(tr_ptr, 5)
    _grid_sync(cnt_ptr)
    _gdc_launch()  # every CTA is resident and past gate_up: the next launch may take SMs
    _consume_claimed(ring, ready, empty, slots, xq_smem, sx_smem, gu_ptr, gu_ptr, sd_ptr,
                     dn_ptr, o_ptr, ND, ssd, eps, t, KD, KTS_D, S_D, STAGES, G_D, 2, True,
                     tr_ptr, TR + 6)
    if TRACE:
        mark(tr_ptr, 7)


@gluon.jit
def _fp8_chain_tc_kernel(wo_desc, wg_desc, wd_desc, attn_ptr, res_ptr, so_ptr, o_ptr, nw_ptr,
                         sg_ptr, gu_ptr, sd_ptr, dn_ptr, z1_ptr, z1_n, z2_ptr, z2_n, cnt_ptr,
                         NO, NG, ND, sso, ssg, ssd, eps,
                         KO: gl.constexpr, KG: gl.constexpr, KD: gl.constexpr,
                         KTS_O: gl.constexpr, KTS_G: gl.constexpr, KTS_D: gl.constexpr,
                         S_O: gl.constexpr, S_G: gl.constexpr, S_D: gl.constexpr,
                         G_O: gl.constexpr, G_G: gl.constexpr, G_D: gl.constexpr,
                         KTS_MAX: gl.constexpr, STAGES: gl.constexpr, ZCH: gl.constexpr,
                         WAIT_AFTER_O: gl.constexpr, tr_ptr, TRACE: gl.constexpr):
    ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 64, 128], wo_desc.layout)
    xq_smem = gl.allocate_shared_memory(gl.float8e4nv, [KTS_MAX, 8, 128],
                                        gl.NVMMASharedLayout(128, 8, rank=2))
    sx_smem = gl.allocate_shared_memory(gl.float32, [KTS_MAX * 8, 1],
                                        gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    slots = gl.allocate_shared_memory(gl.int32, [STAGES, 1],
                                      gl.SwizzledSharedLayout(1, 1, 1, [0]))
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_chain_consumer, (ring, ready, empty, slots, xq_smem, sx_smem, attn_ptr, res_ptr, so_ptr,
                           o_ptr, nw_ptr, sg_ptr, gu_ptr, sd_ptr, dn_ptr, z1_ptr, z1_n,
                           z2_ptr, z2_n, cnt_ptr, NO, NG, ND, sso, ssg, ssd, eps, KO, KG, KD,
                           KTS_O, KTS_G, KTS_D, S_O, S_G, S_D, G_O, G_G, G_D, STAGES, ZCH,
                           tr_ptr, TRACE)),
        (_chain_loader, (wo_desc, wg_desc, wd_desc, ring, ready, empty, slots, cnt_ptr, NO,
                         NG, ND, KTS_O,
                         KTS_G, KTS_D, S_O, S_G, S_D, STAGES, WAIT_AFTER_O, tr_ptr, TRACE)),
    ], [1], [40])


def chain_plans(shapes: tuple[tuple[int, int], ...], sms: int) -> tuple[TcPlan, ...]:
    """Each phase's K split and wgmmas in flight (tc_plan), on one grid of 2 CTAs per SM."""
    plans = tuple(tc_plan(N, K, sms) for N, K in shapes)
    if len({p.grid for p in plans}) != 1:
        raise ValueError(f"chain: phases plan different grids {[p.grid for p in plans]}")
    if plans[1].split > 16 or plans[2].split > 32:
        raise ValueError(f"chain: K splits {plans[1].split}, {plans[2].split} exceed the "
                         "counters (16 for gate_up, 32 for down)")
    return plans


def _desc(weight: torch.Tensor) -> TensorDescriptor:
    N, K = weight.shape
    layout = gl.NVMMASharedLayout.get_default_for([ROWS, GROUP_K], gl.float8e4nv)
    return TensorDescriptor(weight, [N, K], [K, 1], [ROWS, GROUP_K], layout)


def fp8_chain_tc(attn: torch.Tensor, wo: tuple[torch.Tensor, torch.Tensor],
                 wgu: tuple[torch.Tensor, torch.Tensor], wd: tuple[torch.Tensor, torch.Tensor],
                 norm_weight: torch.Tensor, eps: float, *, res: torch.Tensor, o: torch.Tensor,
                 gate_up: torch.Tensor, down: torch.Tensor, counter: torch.Tensor,
                 zero: tuple[torch.Tensor, torch.Tensor], stages: int = 12,
                 wait_after_o: bool = True, trace: torch.Tensor | None = None) -> torch.Tensor:
    """The module doc's three products for one token: attn [1, Ko] (the attention's
    output), each weight (e4m3 [N, K], scales [N / 128, K / 128]); res [1, No] (fp32, the
    residual o_proj adds); o, gate_up, down (fp32 [1, N], zero on entry) receive the
    outputs; counter: int64 [COUNTERS], the module doc's counters (zero at first); zero: two fp32 buffers
    (never this launch's inputs or outputs, except down) <- 0 once the launch before has
    finished. Off Hopper or on CPU: kernels.reference.fp8_gemv_tc_ref per phase. Returns
    down."""
    (Wo, so), (Wg, sg), (Wd, sd) = wo, wgu, wd
    for name, (w, _) in (("wo", wo), ("wgu", wgu), ("wd", wd)):
        if not tc_fits(w, (128, 128)):
            raise ValueError(f"{name}: {tuple(w.shape)} {w.dtype} must be contiguous "
                             f"float8_e4m3fn [N, K] with K % {GROUP_K} == 0")
    if Wg.shape[1] != Wo.shape[0] or Wd.shape[1] * 2 != Wg.shape[0]:
        raise ValueError(f"wo {tuple(Wo.shape)}, wgu {tuple(Wg.shape)}, wd {tuple(Wd.shape)}:"
                         " gate_up must take o_proj's output and down half of gate_up's")
    dev = Wo.device
    check_tensor("attn", attn, shape=(1, Wo.shape[1]), device=dev, last_contiguous=True)
    for name, t, n in (("res", res, Wo.shape[0]), ("o", o, Wo.shape[0]),
                       ("gate_up", gate_up, Wg.shape[0]), ("down", down, Wd.shape[0])):
        check_tensor(name, t, shape=(1, n), dtypes=(torch.float32,), device=dev,
                     last_contiguous=True)
    check_tensor("counter", counter, shape=(COUNTERS,), dtypes=(torch.int64,), device=dev)
    for i, z in enumerate(zero):
        check_tensor(f"zero[{i}]", z, dtypes=(torch.float32,), device=dev)
        if not z.is_contiguous() or any(z is t for t in (attn, res, o, gate_up)):
            raise ValueError(f"zero[{i}]: must be contiguous and not an input")
    if not (Wo.is_cuda and tc_available(dev.index or 0)):
        from pdserve.kernels.reference import fp8_gemv_tc_ref
        for z in zero:
            z.zero_()
        fp8_gemv_tc_ref(attn, Wo, so, out=o, add=res)
        fp8_gemv_tc_ref(o, Wg, sg, "norm", norm_weight, eps, out=gate_up)
        return fp8_gemv_tc_ref(gate_up, Wd, sd, "silu", out=down, add=o)
    _launch(attn, wo, wgu, wd, norm_weight, eps, res, o, gate_up, down, counter, zero, stages,
            wait_after_o, trace)
    return down


def _launch(attn, wo, wgu, wd, norm_weight, eps, res, o, gate_up, down, counter, zero,
            stages: int, wait_after_o: bool, trace: torch.Tensor | None = None) -> None:
    """The kernel on the checked arguments of fp8_chain_tc."""
    (Wo, so), (Wg, sg), (Wd, sd) = wo, wgu, wd
    shapes = (tuple(Wo.shape), tuple(Wg.shape), tuple(Wd.shape))
    po, pg, pd = chain_plans(shapes, num_sms(Wo.device.index or 0))
    kts = [K // GROUP_K // p.split for (_, K), p in zip(shapes, (po, pg, pd))]
    zch = max(128, triton.next_power_of_2(triton.cdiv(max(z.numel() for z in zero), po.grid)))
    _fp8_chain_tc_kernel[(po.grid,)](
        _desc(Wo), _desc(Wg), _desc(Wd), attn, res, so, o, norm_weight, sg, gate_up, sd, down,
        zero[0], zero[0].numel(), zero[1], zero[1].numel(), counter, Wo.shape[0], Wg.shape[0],
        Wd.shape[0], so.stride(0), sg.stride(0), sd.stride(0), float(eps),
        KO=Wo.shape[1], KG=Wg.shape[1], KD=Wd.shape[1], KTS_O=kts[0], KTS_G=kts[1],
        KTS_D=kts[2], S_O=po.split, S_G=pg.split, S_D=pd.split, G_O=po.group, G_G=pg.group,
        G_D=pd.group, KTS_MAX=max(kts), STAGES=stages, ZCH=zch, WAIT_AFTER_O=wait_after_o,
        tr_ptr=trace if trace is not None else counter, TRACE=trace is not None, num_warps=4,
        launch_pdl=True, maxnreg=128)

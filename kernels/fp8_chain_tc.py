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

The counter is int64 and only grows: a CTA's arrival returns the count before it, and the
barrier it waits for is the next multiple of the grid size, so no launch resets it; one
counter serves one grid size (TcBuffers keeps it). CPU and the interpreter:
fp8_gemv_tc_ref three times (kernels/reference.py).
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from pdserve.kernels._triton import check_tensor, num_sms
from pdserve.kernels.fp8_gemv_tc import (
    GROUP_K,
    ROWS,
    TcPlan,
    _consume,
    _gdc_launch,
    _gdc_wait,
    _load_tiles,
    _zero,
    mark,
    tc_available,
    tc_fits,
    tc_plan,
)

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
def _chain_loader(wo_desc, wg_desc, wd_desc, ring, ready, empty, NO, NG, ND,
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
    t = _load_tiles(wg_desc, ring, ready, empty, NG, t, KTS_G, S_G, STAGES)
    if TRACE:
        mark(tr_ptr, 11)
    _load_tiles(wd_desc, ring, ready, empty, ND, t, KTS_D, S_D, STAGES)
    if TRACE:
        mark(tr_ptr, 12)


@gluon.jit
def _chain_consumer(ring, ready, empty, xq_smem, sx_smem, attn_ptr, res_ptr, so_ptr, o_ptr,
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
                 tr_ptr, TR + 2)
    if TRACE:
        mark(tr_ptr, 3)
    _grid_sync(cnt_ptr)
    t = _consume(ring, ready, empty, xq_smem, sx_smem, o_ptr, nw_ptr, res_ptr, sg_ptr,
                 gu_ptr, gu_ptr, NG, ssg, eps, t, KG, KTS_G, S_G, STAGES, G_G, 1, False,
                 False, tr_ptr, TR + 4)
    if TRACE:
        mark(tr_ptr, 5)
    _grid_sync(cnt_ptr)
    _gdc_launch()  # every CTA is resident and past gate_up: the next launch may take SMs
    _consume(ring, ready, empty, xq_smem, sx_smem, gu_ptr, gu_ptr, res_ptr, sd_ptr, dn_ptr,
             o_ptr, ND, ssd, eps, t, KD, KTS_D, S_D, STAGES, G_D, 2, True, False, tr_ptr,
             TR + 6)
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
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_chain_consumer, (ring, ready, empty, xq_smem, sx_smem, attn_ptr, res_ptr, so_ptr,
                           o_ptr, nw_ptr, sg_ptr, gu_ptr, sd_ptr, dn_ptr, z1_ptr, z1_n,
                           z2_ptr, z2_n, cnt_ptr, NO, NG, ND, sso, ssg, ssd, eps, KO, KG, KD,
                           KTS_O, KTS_G, KTS_D, S_O, S_G, S_D, G_O, G_G, G_D, STAGES, ZCH,
                           tr_ptr, TRACE)),
        (_chain_loader, (wo_desc, wg_desc, wd_desc, ring, ready, empty, NO, NG, ND, KTS_O,
                         KTS_G, KTS_D, S_O, S_G, S_D, STAGES, WAIT_AFTER_O, tr_ptr, TRACE)),
    ], [1], [40])


def chain_plans(shapes: tuple[tuple[int, int], ...], sms: int) -> tuple[TcPlan, ...]:
    """Each phase's K split and wgmmas in flight (tc_plan), on one grid of 2 CTAs per SM."""
    plans = tuple(tc_plan(N, K, sms) for N, K in shapes)
    if len({p.grid for p in plans}) != 1:
        raise ValueError(f"chain: phases plan different grids {[p.grid for p in plans]}")
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
    outputs; counter: int64 [1], this grid size's arrival counter; zero: two fp32 buffers
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
    check_tensor("counter", counter, shape=(1,), dtypes=(torch.int64,), device=dev)
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

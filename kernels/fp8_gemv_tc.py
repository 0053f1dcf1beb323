"""Batch-1 FP8 GEMV on Hopper's tensor cores (Gluon, Triton's explicit-layout dialect):

    out[N] += (prologue(x)[K] quantized per 128 columns) @ dequant(W8, scales)[N, K]^T (+ add)

for a batch-1 decode step of a dense model with block-FP8 weights (128 x 128 scales).

Why (docs/design.md, "The tensor-core GEMV"): the one-row Triton GEMV (kernels/gemv_row.py)
streams FP8 weights at ~3.6 TB/s in a decode chain; the CUDA cores cannot take 16 weights a
clock per SM with the e4m3 decode. Here each CTA streams its weight tiles [64 rows, 128]
through a shared-memory ring that TMA fills from a warp of its own (the first tiles before
the PDL wait, while the kernel before drains), and wgmma multiplies each tile by the
activation, quantized to e4m3 per 128 columns as vLLM serves block-FP8 checkpoints (w8a8,
as kernels/fp8_gemm.py does for 2+ rows): one real column of an m64n8k32 B operand. Four
tiles' wgmmas are in flight at once. Qwen3-8B's four projections take 47 us a layer against
53 for the Triton GEMVs (bench/results/probe_fp8_gluon_h200_2026-11-30.json).

The launch shape: 2 CTAs per SM; CTA p takes K split p % S of the row blocks p // S,
p // S + G / S, ... (tc_plan picks S so that every CTA streams about the same bytes). The
splits of a row add into `out` (fp32) with RED atomics, so `out` must be zero: the caller
passes the buffers this launch zeroes (`zero`, after its PDL wait) and keeps the rule that
a buffer is zeroed only once every reader has finished (engine/model/decoder.py, TcBuffers).

Lifecycle of one CTA: loader warp streams tiles | consumer: ("merge": its sequence's active
attention splits, from the length) PDL wait -> zero its slice of the `zero` buffers ->
prologue (norm: the whole x for the sum of squares; silu(gate) * up; merge: the decode
attention's unmerged splits of its heads; none), quantize its K range into shared memory
(kernels/fp8_gemv_tc_prologue.py) -> per row block (its weight scales and residual loaded
one row block ahead): per tile wgmma, scale, add; (rstd, residual on split 0) RED into out.

CPU and the interpreter: fp8_gemv_tc_ref (kernels/reference.py) is the function; the
decoder's tests run it on CPU, the GPU tests compare the kernel with it.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from pdserve.kernels._triton import check_tensor, interpreting, num_sms
from pdserve.kernels.decode_attention import SplitPartials
from pdserve.kernels.fp8_gemv_tc_prologue import n_active, stage_act, stage_merged, stage_norm

PROLOGUES = {"none": 0, "norm": 1, "silu": 2, "merge": 3}
ROWS = 64  # wgmma's M: weight rows per tile
GROUP_K = 128  # K columns per tile, per weight scale and per activation scale


@dataclass(frozen=True)
class TcPlan:
    """split: K splits per row block; group: tiles whose wgmmas are in flight at once;
    stages: ring depth in tiles; grid: CTAs; prefill: tiles loaded before the PDL wait
    (while the kernel before runs; None: a whole ring); maxnreg: the consumer's registers."""
    split: int
    group: int
    stages: int
    grid: int
    prefill: int | None = None
    maxnreg: int = 128


@functools.cache
def tc_plan(N: int, K: int, sms: int, per_sm: int = 2, light_prefill: bool = False,
            prefer_tiles: int = 8) -> TcPlan:
    """The K split that spreads N / 64 row blocks x K / 128 tiles most evenly over
    per_sm * sms CTAs (a power of 2 tiles a split, as the kernel's vectors need; the grid
    the largest multiple of the split that fits: 260 CTAs for 5 or 10 splits of a 5120
    hidden size). Ties: prefer_tiles tiles per split, 8 the probe's best; the "merge"
    prologue asks for 4, half the heads' splits to merge in each CTA: Qwen3-8B's o_proj in
    8 splits, FP8 step 2.394 -> 2.350 ms, 2.395 with 4; bench/results/
    diag_merge_in_o_proj_h200_2026-12-01_s8.json), and the wgmmas in flight
    (up to 4). H200 at Qwen3-8B's shapes: q/k/v 8, o 8 (4 without the merge), gate_up 4,
    down 12 splits, each ~97% busy. Ring: 12 tiles for matrices of >= 32 MB, 8 below
    (Qwen3-8B FP8 step 2.414 -> 2.398 ms with gate_up's and down's 12, q/k/v's too
    2.416; bench/results/diag_tc_h200_2026-11-30.json). light_prefill (the launch before is
    latency-bound, as the decode attention before o_proj): all but 2 tiles of the ring
    before the PDL wait, since the attention's round trips queue behind the ring's loads
    (Qwen3-8B FP8 step 2.389 -> 2.363 ms with o_proj's 6 of 8; 4: 2.378, 2: 2.398;
    bench/results/diag_tc_o_prefill_h200_2026-11-30.json)."""
    stages = 12 if N * K >= (32 << 20) else 8
    full, blocks, tiles = sms * per_sm, triton.cdiv(N, ROWS), K // GROUP_K
    best, split, grid = None, 1, full
    for s in range(1, min(tiles, full) + 1):
        kts = tiles // s  # the kernel's per-CTA vectors of KTS tiles: a power of 2
        if tiles % s or kts & (kts - 1):
            continue
        g = full // s * s  # every K split of a row block in the grid (Qwen3-8B: all of it)
        eff = blocks * tiles / (full * triton.cdiv(blocks, g // s) * kts)
        key = (round(eff, 2), -abs(kts - prefer_tiles), -s)
        if best is None or key > best:
            best, split, grid = key, s, g
    if best is None:
        raise ValueError(f"K: {K} has no split into a power of 2 tiles a CTA over {full} "
                         f"CTAs (tc_fits refuses such weights)")
    group = min(tiles // split, 4)  # a power of 2: divides the split's tiles
    return TcPlan(split, group, stages, grid, prefill=stages - 2 if light_prefill else None)


@gluon.jit
def _gdc_wait():
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _gdc_launch():
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _loader(w_desc, ring, ready, empty, N, KTS: gl.constexpr, SPLIT: gl.constexpr,
            STAGES: gl.constexpr, PREFILL: gl.constexpr):
    """One warp: the CTA's [64, 128] weight tiles into the ring, in consumption order, the
    first PREFILL of them before the PDL wait (PREFILL >= STAGES: the loader never waits;
    the ring's empty slots hold it back, and weights are no output of the launch before)."""
    pid = gl.program_id(0)
    GS = gl.num_programs(0) // SPLIT
    first = pid // SPLIT
    total = ((gl.cdiv(N, 64) - first + GS - 1) // GS) * KTS
    for t in range(total):
        if PREFILL < STAGES:
            if t == PREFILL:
                _gdc_wait()
        s = t % STAGES
        mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), 64 * 128)
        tma.async_copy_global_to_shared(
            w_desc, [(first + (t // KTS) * GS) * 64, ((pid % SPLIT) * KTS + t % KTS) * 128],
            ready.index(s), ring.index(s))


@gluon.jit
def _zero(z_ptr, n, ZCH: gl.constexpr):
    """This CTA's ZCH-element slice of the fp32 buffer z [n] <- 0."""
    ZL: gl.constexpr = gl.BlockedLayout([4], [32], [4], [0])
    offs = gl.program_id(0) * ZCH + gl.arange(0, ZCH, layout=ZL)
    gl.store(z_ptr + offs, gl.zeros([ZCH], gl.float32, ZL), mask=offs < n)


@gluon.jit
def _row_scales(s_ptr, stride_s, rb, k0, N, KTS: gl.constexpr):
    """Row block rb's KTS weight block scales in the CTA's K split (groups k0..), in every
    thread: [KTS] (0 past the last row block)."""
    SV: gl.constexpr = gl.BlockedLayout([KTS], [32], [4], [0])
    k = gl.arange(0, KTS, layout=SV)
    return gl.load(s_ptr + (rb * 64 // 128) * stride_s + k0 + k, mask=rb * 64 < N, other=0.0)


@gluon.jit
def _tile_scale(sx_smem, wsc, kl, KTS: gl.constexpr):
    """The scale of the CTA's tile kl in a row block: its weight block scale (wsc, the row
    block's _row_scales) times the activation group's."""
    SL: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    SV: gl.constexpr = gl.BlockedLayout([KTS], [32], [4], [0])
    sx = gl.sum(sx_smem.index(kl * 8).load(SL), axis=0)
    return gl.sum(gl.where(gl.arange(0, KTS, layout=SV) == kl, wsc, 0.0), axis=0) * sx


@gluon.jit
def _issue(ring, ready, xq_smem, zero, u, kl, STAGES: gl.constexpr):
    """The wgmma [64, 128] @ [128, 8] of the tile at ring position u with the CTA's
    activation group kl, started once its ring slot is full: a token."""
    s = u % STAGES
    mbarrier.wait(ready.index(s), (u // STAGES) & 1)
    return warpgroup_mma(ring.index(s), xq_smem.index(kl).permute((1, 0)), zero,
                         use_acc=False, is_async=True)


@gluon.jit
def _add_rows(add_ptr, rb, rows, N, first_split, HAS_ADD: gl.constexpr):
    """Row block rb's residual [64] (split 0 only; zero elsewhere or without one)."""
    n = rb * 64 + rows
    return gl.load(add_ptr + n, mask=(n < N) & first_split & HAS_ADD, other=0.0).to(gl.float32)


@gluon.jit
def _out(out_ptr, acc, rb, rows, cols, N, rstd, addv, PROLOGUE: gl.constexpr):
    """Column 0 of acc [64, 8] is row block rb's partial: times rstd ("norm"), plus the
    residual addv (_add_rows), added into out (RED, fire and forget)."""
    n = rb * 64 + rows
    if PROLOGUE == 1:
        acc = acc * rstd
    acc += addv[:, None]
    keep = (n < N)[:, None] & (cols == 0)[None, :]
    gl.atomic_add(out_ptr + n[:, None] + cols[None, :] * 0, acc, mask=keep, sem="relaxed")


@gluon.jit
def _row_block(ring, ready, empty, xq_smem, sx_smem, u, wsc, KTS: gl.constexpr,
               STAGES: gl.constexpr, GROUP: gl.constexpr):
    """A row block's KTS tiles (the CTA's K split) from ring position u: per tile wgmma,
    times its weight and activation scales (wsc: the row block's _row_scales), summed;
    GROUP tiles' wgmmas in flight. Returns the partial [64, 8] (column 0 real)."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, 8, 32])
    acc = gl.zeros([64, 8], gl.float32, MMA)
    zero = gl.zeros([64, 8], gl.float32, MMA)
    for kl in range(0, KTS, GROUP):
        v = u + kl
        sc0 = _tile_scale(sx_smem, wsc, kl, KTS)
        tok0 = _issue(ring, ready, xq_smem, zero, v, kl, STAGES)
        if GROUP == 1:
            p0 = warpgroup_mma_wait(0, deps=[tok0])
            mbarrier.arrive(empty.index(v % STAGES), count=1)
            acc += p0 * sc0
        if GROUP == 2:
            sc1 = _tile_scale(sx_smem, wsc, kl + 1, KTS)
            tok1 = _issue(ring, ready, xq_smem, zero, v + 1, kl + 1, STAGES)
            p0 = warpgroup_mma_wait(1, deps=[tok0])
            mbarrier.arrive(empty.index(v % STAGES), count=1)
            p1 = warpgroup_mma_wait(0, deps=[tok1])
            mbarrier.arrive(empty.index((v + 1) % STAGES), count=1)
            acc += p0 * sc0 + p1 * sc1
        if GROUP == 4:
            sc1 = _tile_scale(sx_smem, wsc, kl + 1, KTS)
            sc2 = _tile_scale(sx_smem, wsc, kl + 2, KTS)
            sc3 = _tile_scale(sx_smem, wsc, kl + 3, KTS)
            tok1 = _issue(ring, ready, xq_smem, zero, v + 1, kl + 1, STAGES)
            tok2 = _issue(ring, ready, xq_smem, zero, v + 2, kl + 2, STAGES)
            tok3 = _issue(ring, ready, xq_smem, zero, v + 3, kl + 3, STAGES)
            p0 = warpgroup_mma_wait(3, deps=[tok0])
            mbarrier.arrive(empty.index(v % STAGES), count=1)
            p1 = warpgroup_mma_wait(2, deps=[tok1])
            mbarrier.arrive(empty.index((v + 1) % STAGES), count=1)
            p2 = warpgroup_mma_wait(1, deps=[tok2])
            mbarrier.arrive(empty.index((v + 2) % STAGES), count=1)
            p3 = warpgroup_mma_wait(0, deps=[tok3])
            mbarrier.arrive(empty.index((v + 3) % STAGES), count=1)
            acc += p0 * sc0 + p1 * sc1 + p2 * sc2 + p3 * sc3
    return acc


@gluon.jit
def _consume(ring, ready, empty, xq_smem, sx_smem, x_ptr, nw_ptr, res_ptr, s_ptr, out_ptr,
             add_ptr, lse_ptr, n_act, N, stride_s, eps, K: gl.constexpr, KTS: gl.constexpr,
             SPLIT: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr,
             PROLOGUE: gl.constexpr, HAS_ADD: gl.constexpr, RES_OUT: gl.constexpr,
             SPLITS: gl.constexpr, HD: gl.constexpr, KROW: gl.constexpr):
    """The CTA's share of the weight: prologue, then per row block its tiles and a RED into
    out. The next row block's weight scales and residual are loaded while this one's tiles
    stream: loaded where used, each was a round trip behind the weight stream's traffic
    (Qwen3-8B FP8 step 2.441-2.455 -> 2.428-2.444 ms, bench/results/
    diag_tc_prefetch_h200_2026-11-30.json)."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, 8, 32])
    pid = gl.program_id(0)
    GS = gl.num_programs(0) // SPLIT
    first = pid // SPLIT
    k0 = (pid % SPLIT) * KTS  # the CTA's first group
    blocks = (gl.cdiv(N, 64) - first + GS - 1) // GS
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
    cols = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    split0 = pid % SPLIT == 0
    wsc = _row_scales(s_ptr, stride_s, first, k0, N, KTS)
    addv = _add_rows(add_ptr, first, rows, N, split0, HAS_ADD)
    rstd = 1.0
    if PROLOGUE == 1:
        rstd = stage_norm(x_ptr, nw_ptr, res_ptr, xq_smem, sx_smem, k0, eps, K, KTS, RES_OUT,
                          KROW)
    elif PROLOGUE == 3:
        stage_merged(x_ptr, lse_ptr, n_act, xq_smem, sx_smem, k0, KTS, SPLITS, HD)
    else:
        stage_act(x_ptr, nw_ptr, xq_smem, sx_smem, k0, K, KTS, PROLOGUE)
    for i in range(blocks):
        rb = first + i * GS
        wsc_next = _row_scales(s_ptr, stride_s, rb + GS, k0, N, KTS)
        addv_next = _add_rows(add_ptr, rb + GS, rows, N, split0, HAS_ADD)
        acc = _row_block(ring, ready, empty, xq_smem, sx_smem, i * KTS, wsc, KTS, STAGES,
                         GROUP)
        _out(out_ptr, acc, rb, rows, cols, N, rstd, addv, PROLOGUE)
        wsc = wsc_next
        addv = addv_next


@gluon.jit
def _consumer(ring, ready, empty, xq_smem, sx_smem, x_ptr, nw_ptr, res_ptr, s_ptr, out_ptr,
              add_ptr, z1_ptr, z1_n, z2_ptr, z2_n, lse_ptr, len_ptr, N, stride_s, eps,
              K: gl.constexpr, KTS: gl.constexpr, SPLIT: gl.constexpr, STAGES: gl.constexpr,
              GROUP: gl.constexpr, PROLOGUE: gl.constexpr, HAS_ADD: gl.constexpr,
              RES_OUT: gl.constexpr, ZCH: gl.constexpr, HAS_Z: gl.constexpr,
              SPLITS: gl.constexpr, HD: gl.constexpr, KEYS: gl.constexpr, KROW: gl.constexpr):
    """One warpgroup: the module doc's lifecycle after the PDL wait."""
    _gdc_launch()  # the next launch may fill its ring while this one streams
    n_act = 0
    if PROLOGUE == 3:
        n_act = n_active(len_ptr, SPLITS, KEYS)
    _gdc_wait()
    if HAS_Z:
        _zero(z1_ptr, z1_n, ZCH)
        _zero(z2_ptr, z2_n, ZCH)
    _consume(ring, ready, empty, xq_smem, sx_smem, x_ptr, nw_ptr, res_ptr, s_ptr, out_ptr,
             add_ptr, lse_ptr, n_act, N, stride_s, eps, K, KTS, SPLIT, STAGES, GROUP, PROLOGUE,
             HAS_ADD, RES_OUT, SPLITS, HD, KROW)


@gluon.jit
def _fp8_gemv_tc_kernel(w_desc, x_ptr, nw_ptr, res_ptr, s_ptr, out_ptr, add_ptr, z1_ptr, z1_n,
                        z2_ptr, z2_n, lse_ptr, len_ptr, N, stride_s, eps, K: gl.constexpr,
                        KTS: gl.constexpr, SPLIT: gl.constexpr, STAGES: gl.constexpr,
                        GROUP: gl.constexpr, PROLOGUE: gl.constexpr, HAS_ADD: gl.constexpr,
                        RES_OUT: gl.constexpr, ZCH: gl.constexpr, HAS_Z: gl.constexpr,
                        PREFILL: gl.constexpr, KROW: gl.constexpr, SPLITS: gl.constexpr = 1,
                        HD: gl.constexpr = 128, KEYS: gl.constexpr = 64):
    ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 64, 128], w_desc.layout)
    xq_smem = gl.allocate_shared_memory(gl.float8e4nv, [KTS, 8, 128],
                                        gl.NVMMASharedLayout(128, 8, rank=2))
    sx_smem = gl.allocate_shared_memory(gl.float32, [KTS * 8, 1],
                                        gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_consumer, (ring, ready, empty, xq_smem, sx_smem, x_ptr, nw_ptr, res_ptr, s_ptr,
                     out_ptr, add_ptr, z1_ptr, z1_n, z2_ptr, z2_n, lse_ptr, len_ptr, N,
                     stride_s, eps, K, KTS, SPLIT, STAGES, GROUP, PROLOGUE, HAS_ADD, RES_OUT,
                     ZCH, HAS_Z, SPLITS, HD, KEYS, KROW)),
        (_loader, (w_desc, ring, ready, empty, N, KTS, SPLIT, STAGES, PREFILL)),
    ], [1], [40])


@functools.cache
def tc_available(device_index: int) -> bool:
    """The kernel runs here: compiled (not the interpreter) on a compute capability 9.0 GPU
    (wgmma and TMA as Gluon's Hopper module emits them)."""
    return not interpreting() and torch.cuda.get_device_capability(device_index) == (9, 0)


def tc_fits(weight: torch.Tensor, block: tuple[int, int] | None) -> bool:
    """The weight layouts this kernel takes: e4m3 [N, K] contiguous, K % 128 == 0, scales
    per 128 x 128 block, and K's tiles split into a power of 2 a CTA over 2 CTAs an SM
    (tc_plan; only an odd tile count above that many CTAs has none)."""
    if not (weight.dtype == torch.float8_e4m3fn and weight.is_contiguous()
            and weight.shape[1] % GROUP_K == 0 and tuple(block or ()) == (128, 128)):
        return False
    tiles = weight.shape[1] // GROUP_K
    sms = num_sms(weight.device.index or 0) if weight.is_cuda else 132
    return tiles // (tiles & -tiles) <= 2 * sms


def _check_partials(x: SplitPartials, K: int, device: torch.device) -> None:
    """The "merge" prologue's input: one sequence's unmerged attention splits covering K."""
    if not isinstance(x, SplitPartials):
        raise TypeError(f"x: the 'merge' prologue takes SplitPartials, got {type(x).__name__}")
    check_tensor("x.o", x.o, shape=(1, None, None, None), dtypes=(torch.float32,),
                 device=device)
    _, hq, splits, hd = x.o.shape
    if not x.o.is_contiguous() or hq * hd != K or hd % GROUP_K or splits & (splits - 1):
        raise ValueError(f"x.o: {tuple(x.o.shape)} must be contiguous [1, Hq, S, D] with "
                         f"Hq * D == {K}, D % {GROUP_K} == 0 and S a power of 2")
    check_tensor("x.lse", x.lse, shape=(1, hq, splits), dtypes=(torch.float32,),
                 device=device)
    if not x.lse.is_contiguous():
        raise ValueError("x.lse: must be contiguous")
    check_tensor("x.seq_lens", x.seq_lens, shape=(1,), dtypes=(torch.int32,), device=device)


def _check(x: torch.Tensor | SplitPartials, weight: torch.Tensor, scales: torch.Tensor,
           prologue: str, norm_weight: torch.Tensor | None, out: torch.Tensor,
           add: torch.Tensor | None, res_out: torch.Tensor | None,
           zero: tuple[torch.Tensor, ...]) -> None:
    N, K = weight.shape
    if prologue not in PROLOGUES:
        raise ValueError(f"prologue: {prologue!r} not in {sorted(PROLOGUES)}")
    if not tc_fits(weight, (128, 128)):
        raise ValueError(f"weight: {tuple(weight.shape)} {weight.dtype} must be contiguous "
                         f"float8_e4m3fn [N, K] with K % {GROUP_K} == 0")
    k_in = 2 * K if prologue == "silu" else K
    if prologue == "merge":
        _check_partials(x, K, weight.device)
    else:
        check_tensor("x", x, shape=(1, k_in), device=weight.device, last_contiguous=True)
    check_tensor("scales", scales, shape=(triton.cdiv(N, 128), K // 128),
                 dtypes=(torch.float32,), device=weight.device)
    check_tensor("out", out, shape=(1, N), dtypes=(torch.float32,), device=weight.device,
                 last_contiguous=True)
    if prologue == "norm":
        check_tensor("norm_weight", norm_weight, shape=(K,), device=weight.device)
    if add is not None:
        check_tensor("add", add, shape=(1, N), device=weight.device, last_contiguous=True)
    if res_out is not None:
        if prologue != "norm":
            raise ValueError("res_out: only the 'norm' prologue reads the whole row to copy")
        check_tensor("res_out", res_out, shape=(1, K), dtypes=(torch.float32,),
                     device=weight.device, last_contiguous=True)
    for i, z in enumerate(zero):
        check_tensor(f"zero[{i}]", z, dtypes=(torch.float32,), device=weight.device)
        if not z.is_contiguous() or any(z is t for t in (x, out, add, res_out)):
            raise ValueError(f"zero[{i}]: must be contiguous and not an input or output")
    if len(zero) > 2:
        raise ValueError(f"zero: at most 2 buffers, got {len(zero)}")


def fp8_gemv_tc(x: torch.Tensor | SplitPartials, weight: torch.Tensor, scales: torch.Tensor,
                prologue: str = "none", norm_weight: torch.Tensor | None = None,
                eps: float = 1e-6, *, out: torch.Tensor, add: torch.Tensor | None = None,
                res_out: torch.Tensor | None = None, zero: tuple[torch.Tensor, ...] = (),
                light_prefill: bool = False) -> torch.Tensor:
    """out [1, N] (fp32, zero on entry) += the module doc's product for x [1, K] ([1, 2K]
    = gate | up for "silu"), weight e4m3 [N, K] with scales [N / 128, K / 128]; plus add
    [1, N] (the residual); for "merge", x is the decode attention's unmerged splits
    (SplitPartials of one sequence, Hq * D = K), merged here; res_out [1, K] (fp32) <- x
    ("norm" only); each of `zero` (<= 2 fp32 buffers, never this launch's inputs) <- 0
    once the launch before has finished.
    light_prefill: the launch before is latency-bound (tc_plan). Off Hopper or on CPU:
    kernels.reference.fp8_gemv_tc_ref. Returns out."""
    _check(x, weight, scales, prologue, norm_weight, out, add, res_out, zero)
    if not (weight.is_cuda and tc_available(weight.device.index or 0)):
        from pdserve.kernels.reference import fp8_gemv_tc_ref
        return fp8_gemv_tc_ref(x, weight, scales, prologue, norm_weight, eps, out=out,
                               add=add, res_out=res_out, zero=zero)
    N, K = weight.shape
    plan = tc_plan(N, K, num_sms(weight.device.index or 0), light_prefill=light_prefill,
                   prefer_tiles=4 if prologue == "merge" else 8)
    layout = gl.NVMMASharedLayout.get_default_for([ROWS, GROUP_K], gl.float8e4nv)
    desc = TensorDescriptor(weight, [N, K], [K, 1], [ROWS, GROUP_K], layout)
    z = list(zero) + [out] * (2 - len(zero))  # placeholders: n = 0 stores nothing
    zn = [t.numel() if i < len(zero) else 0 for i, t in enumerate(z)]
    zch = max(128, triton.next_power_of_2(triton.cdiv(max(zn), plan.grid))) if zero else 128
    merge = {}
    if isinstance(x, SplitPartials):  # x's tensors as the kernel's x, lse and lengths
        merge = dict(SPLITS=x.num_splits, HD=x.o.shape[3], KEYS=x.block_n)
        x, lse, lens = x.o, x.lse, x.seq_lens
    else:
        lse = lens = out  # placeholders: read by "merge" only
    _fp8_gemv_tc_kernel[(plan.grid,)](
        desc, x, norm_weight if norm_weight is not None else x,
        res_out if res_out is not None else out, scales, out,
        add if add is not None else out, z[0], zn[0], z[1], zn[1], lse, lens, N,
        scales.stride(0), float(eps), K=K, KTS=K // GROUP_K // plan.split, SPLIT=plan.split,
        STAGES=plan.stages, GROUP=plan.group, PROLOGUE=PROLOGUES[prologue],
        HAS_ADD=add is not None, RES_OUT=res_out is not None, ZCH=zch, HAS_Z=bool(zero),
        PREFILL=plan.stages if plan.prefill is None else min(plan.prefill, plan.stages),
        KROW=triton.next_power_of_2(K), num_warps=4, launch_pdl=True, maxnreg=plan.maxnreg,
        **merge)
    return out

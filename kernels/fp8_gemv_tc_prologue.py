"""The tensor-core FP8 GEMV's prologues (kernels/fp8_gemv_tc.py): the CTA's K range of the
activation, through "norm" (the rmsnorm weight; rstd from the whole row), "silu" (silu(gate)
* up) or "merge" (the decode attention's unmerged splits), quantized to e4m3 per 128 columns
into shared memory as wgmma's B ([KTS][8, 128]: row 0 the group, rows 1..7 zero) with each
group's scale. Run by the consumer warpgroup after the PDL wait (n_active before it)."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared


@gluon.constexpr_function
def group_pass(kts):
    """Groups a prologue pass takes: up to 8 of the CTA's KTS (a power of 2, tc_plan), so a
    pass never reaches into the next K split's groups."""
    return min(kts, 8)


@gluon.constexpr_function
def merge_pass(kts):
    """stage_merged's groups a pass: at most 4, its tile [4, 8 splits, 128] already 32
    fp32 a thread."""
    return min(group_pass(kts), 4)


@gluon.constexpr_function
def pass_layout(gp):
    """[GP groups, 8, 128]: a warp per group (up to 4), each thread 8 x 4 of it, so that
    axis 1 (wgmma's B rows; merged splits in stage_merged) stays in-thread. Its slice over
    axis 1 holds a pass compactly: 4 values a thread per group, LDG.128 each."""
    w = min(gp, 4)
    return gl.BlockedLayout([1, 8, 4], [1, 1, 32], [w, 1, 4 // w], [2, 1, 0])


@gluon.jit
def _pass_offsets(k0, k8, K: gl.constexpr, GP: gl.constexpr):
    """Offsets [GP, 128] of groups k0 + k8 .. k0 + k8 + GP - 1 in a [K] row, and their
    mask, in pass_layout's slice over axis 1."""
    L2: gl.constexpr = gl.SliceLayout(1, pass_layout(GP))
    g = gl.arange(0, GP, layout=gl.SliceLayout(1, L2))
    c = gl.arange(0, 128, layout=gl.SliceLayout(0, L2))
    offs = (k0 + k8 + g)[:, None] * 128 + c[None, :]
    return offs, offs < K


@gluon.jit
def quantize_into(a, xq_smem, sx_smem, k8, KTS: gl.constexpr, GP: gl.constexpr):
    """a [GP, 1, 128] fp32 (pass_layout) to e4m3 per group, into xq_smem's rows k8 * 8 ..
    as wgmma's B (row g * 8 the group, rows g * 8 + 1 .. 7 zero) and each group's scale
    into sx_smem (row g * 8 holds it)."""
    L3: gl.constexpr = pass_layout(GP)
    j3 = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))[None, :, None]
    scale = gl.maximum(gl.max(gl.abs(a), axis=2, keep_dims=True), 1e-10) / 448.0
    q = gl.minimum(gl.maximum(a / scale, -448.0), 448.0)
    q = gl.where(j3 == 0, q, 0.0).to(gl.float8e4nv)  # [GP, 8, 128]: row 0 real
    xq_smem._reinterpret(gl.float8e4nv, [KTS * 8, 128], gl.NVMMASharedLayout(128, 8, rank=2)
                         ).slice(k8 * 8, GP * 8).store(gl.reshape(q, [GP * 8, 128]))
    sx = gl.reshape(gl.where(j3 == 0, scale, 0.0), [GP * 8])
    sx_smem._reinterpret(gl.float32, [KTS * 8], gl.SwizzledSharedLayout(1, 1, 1, [0])
                         ).slice(k8 * 8, GP * 8).store(sx)


@gluon.jit
def _stage_passes(x_ptr, nw_ptr, xq_smem, sx_smem, k0, K: gl.constexpr, KTS: gl.constexpr,
                  PROLOGUE: gl.constexpr, START: gl.constexpr):
    """stage_act's passes from group START on, each loaded compactly, through the prologue
    and quantized. A pass's loads take few registers, so all of them issue before its math:
    loaded as wgmma's B rows ([8 x groups, 128], 7 of 8 rows masked) they took 96-128
    registers and the compiler issued part after the math had waited for the rest (Qwen3-8B
    FP8 step 2.309 -> 2.204-2.227 ms, down 0.43 -> 0.36 ms a step; bench/results/
    diag_tc_compact_h200_2026-12-01.json)."""
    GP: gl.constexpr = group_pass(KTS)
    for k8 in gl.static_range(START, KTS, GP):
        offs, m = _pass_offsets(k0, k8, K, GP)
        a = gl.load(x_ptr + offs, mask=m, other=0.0).to(gl.float32)
        if PROLOGUE == 1:  # rmsnorm's weight here, its rstd on the outputs (it commutes)
            a = a * gl.load(nw_ptr + offs, mask=m, other=0.0).to(gl.float32)
        if PROLOGUE == 2:  # x = [gate | up]: silu(gate) * up
            up = gl.load(x_ptr + K + offs, mask=m, other=0.0).to(gl.float32)
            a = a / (1.0 + gl.exp(-a)) * up
        quantize_into(gl.expand_dims(a, 1), xq_smem, sx_smem, k8, KTS, GP)


@gluon.jit
def stage_act(x_ptr, nw_ptr, xq_smem, sx_smem, k0, K: gl.constexpr, KTS: gl.constexpr,
              PROLOGUE: gl.constexpr):
    """The CTA's KTS activation groups (columns k0 * 128 ..) through the prologue, quantized
    to e4m3 per group into xq_smem as wgmma's B ([KTS][8, 128]: row 0 the group, rows 1..7
    zero) and their scales into sx_smem [KTS * 8] (row g * 8 holds group g's)."""
    _stage_passes(x_ptr, nw_ptr, xq_smem, sx_smem, k0, K, KTS, PROLOGUE, 0)
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def stage_norm(x_ptr, nw_ptr, res_ptr, xq_smem, sx_smem, k0, eps, K: gl.constexpr,
               KTS: gl.constexpr, RES_OUT: gl.constexpr, KROW: gl.constexpr):
    """The "norm" prologue: stage_act's, and rstd of the whole row x [K] (KROW: K to a
    power of 2) for the outputs; CTA 0 copies x to res (fp32) for a later residual add.
    Every load of the first pass (the whole row, the CTA's groups and their norm weights)
    is issued before any value is used or stored: one round trip to L2 after the PDL
    wait. (The row read in chunks, each chunk's copy stored before the next chunk's load,
    took five dependent round trips where the copy was made, two elsewhere: the compiler
    cannot move a load past a store that may alias it, nor past the sum's barrier. Qwen3-8B
    FP8 step 2.344 -> 2.302-2.318 ms, bench/results/diag_tc_one_trip_h200_2026-12-01.json.
    rstd computed where a row block's output is added instead, its loads waiting while the
    ring streams on, was slower: 2.414 -> 2.478 ms, diag_tc_h200_2026-11-30.json.) The row
    takes KROW / 128 registers a thread: 32 at a 4096 hidden size."""
    CL: gl.constexpr = gl.BlockedLayout([8], [32], [4], [0])
    GP: gl.constexpr = group_pass(KTS)
    row = gl.arange(0, KROW, layout=CL)
    x = gl.load(x_ptr + row, mask=row < K, other=0.0).to(gl.float32)
    offs, m = _pass_offsets(k0, 0, K, GP)
    a = gl.load(x_ptr + offs, mask=m, other=0.0)
    w = gl.load(nw_ptr + offs, mask=m, other=0.0)
    rstd = gl.rsqrt(gl.sum(x * x, axis=0) / K + eps)
    if RES_OUT:
        gl.store(res_ptr + row, x, mask=(row < K) & (gl.program_id(0) == 0))
    a = a.to(gl.float32) * w.to(gl.float32)
    quantize_into(gl.expand_dims(a, 1), xq_smem, sx_smem, 0, KTS, GP)
    _stage_passes(x_ptr, nw_ptr, xq_smem, sx_smem, k0, K, KTS, 1, GP)
    fence_async_shared()
    gl.thread_barrier()
    return rstd


@gluon.jit
def n_active(len_ptr, SPLITS: gl.constexpr, KEYS: gl.constexpr):
    """kernels/decode_attention.active_splits of sequence 0: its lengths are host copies, no
    launch's output, so this load may come before the PDL wait."""
    seq_len = gl.load(len_ptr)
    tiles = (seq_len + KEYS - 1) // KEYS
    per = gl.maximum((tiles + SPLITS - 1) // SPLITS, 1)
    return (tiles + per - 1) // per


@gluon.jit
def stage_merged(o_ptr, lse_ptr, n_act, xq_smem, sx_smem, k0, KTS: gl.constexpr,
                 SPLITS: gl.constexpr, HD: gl.constexpr):
    """The "merge" prologue: the CTA's KTS activation groups (columns k0 * 128 ..) merged
    from the decode attention's unmerged splits (kernels/decode_attention.SplitPartials at
    batch 1: o [Hq, SPLITS, HD] fp32, lse [Hq, SPLITS]; the first n_act hold keys), then
    quantized as stage_act does. Tiles [GP groups, 8 splits, 128] (pass_layout): a warp per
    group, 8 splits at a time in each thread's registers, so the merge sums in-thread (over
    lanes it took 412 shuffles a thread). HD % 128 == 0: a group is (part of) one head."""
    GP: gl.constexpr = merge_pass(KTS)
    L3: gl.constexpr = pass_layout(GP)
    L2: gl.constexpr = gl.SliceLayout(2, L3)
    HG: gl.constexpr = HD // 128  # groups a head
    g3 = gl.arange(0, GP, layout=gl.SliceLayout(1, L2))[:, None, None]
    j3 = gl.arange(0, 8, layout=gl.SliceLayout(0, L2))[None, :, None]
    c3 = gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))[None, None, :]
    for k4 in gl.static_range(0, KTS, GP):
        grp = k0 + k4 + g3  # [GP, 1, 1]
        row0 = (grp // HG) * SPLITS  # its head's first split row of o / lse
        d3 = (grp % HG) * 128 + c3  # [GP, 1, 128]; written so as 128-aligned (LDG.128)
        m = gl.full([GP, 1, 1], float("-inf"), gl.float32, L3)
        total = gl.zeros([GP, 1, 1], gl.float32, L3)
        acc = gl.zeros([GP, 1, 128], gl.float32, L3)
        for c in gl.static_range(0, SPLITS, 8):  # online softmax over chunks of 8 splits
            live = (c + j3 < n_act) & (c + j3 < SPLITS)  # [1, 8, 1]
            lse = gl.load(lse_ptr + row0 + c + j3, mask=live, other=float("-inf"))
            o = gl.load(o_ptr + (row0 + c + j3) * HD + d3, mask=live, other=0.0)
            m_new = gl.maximum(m, gl.max(lse, axis=1, keep_dims=True))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m - m_safe)
            w = gl.exp2(lse - m_safe)  # [GP, 8, 1]; 0 for splits without keys
            total = total * alpha + gl.sum(w, axis=1, keep_dims=True)
            acc = acc * alpha + gl.sum(w * o.to(gl.float32), axis=1, keep_dims=True)
            m = m_new
        a = acc / gl.where(total > 0.0, total, 1.0)  # [GP, 1, 128]
        quantize_into(a, xq_smem, sx_smem, k4, KTS, GP)
    fence_async_shared()
    gl.thread_barrier()

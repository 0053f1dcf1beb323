"""Skinny matmul (GEMV) for decode-sized batches, with the op before it fused in.

At batch 1 a decode step is a chain of matrix-vector products, each bound by reading its
weight once. cuBLAS runs the small ones (q/k/v, o) at 65-75% of copy bandwidth and adds a
split-K reduce kernel; the norm and SiLU-and-mul before them are kernels of their own. Here one
kernel per projection streams W [N, K] once and computes, for T <= MAX_ROWS rows,

    y[T, N] = prologue(x)[T, K] @ W[N, K]^T            (fp32 accumulate, y in x.dtype)

with the prologue one of
    "none":  a = x
    "norm":  h = x + residual (stored once, rounded to x.dtype), a = rmsnorm(h) * norm_weight;
             one pass: the loop accumulates (h * norm_weight) . W and sum(h^2) together and
             scales by rsqrt(mean(h^2) + eps) at the end (so, unlike the unfused layer, the
             normalised activation is never rounded to x.dtype: slightly more exact)
    "silu":  x = [gate | up] [T, 2K], a = silu(gate) * up, as kernels.silu_and_mul
and, optionally, an epilogue that adds the residual stream (o_proj and down_proj end the two
residual branches), so a decoder layer's batch-1 decode step is 4 of these + one attention
kernel (prologue included, kernels/decode_attention.py): 5 kernels, where it was 12.

Kernels: one row (batch-1 decode) runs kernels/gemv_row.py's kernel; 2..4 rows on the CUDA
cores the kernel here, where one program owns BLOCK_N output columns for all T rows and walks
K in BLOCK_K steps, accumulating a [T, BLOCK_N, BLOCK_K] fp32 tile that is reduced once at
the end (no cross-lane shuffles inside the loop); 2..16 rows the tensor-core kernel here.
Enough programs must be in flight to cover HBM latency, so BLOCK_N shrinks for narrow
matrices (tile choice: kernels/gemv_configs.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._triton import (
    FLOAT_DTYPES,
    arrival_counters,
    check_launchable,
    check_tensor,
    dot_dtype,
    dot_precision,
    interpreting,
    jit,
    l2_prefetch_rows,
    next_pow2,
    pdl_enter,
    pdl_launch,
    prefetch_lines,
    scratch_fp32,
)
from pdserve.kernels.fp8_scales import (
    BITS_HI,
    BITS_LO,
    FP8_DTYPE,
    Block,
    check_scales,
    fit_block_k,
    fp8_bits_f32,
    fp8_dequant_tile,
    fp8_n_scales,
    fp8_scale_k,
    kernel_block,
    scale_mode,
)
from pdserve.kernels.gemv_configs import (  # noqa: F401  (re-exported: kernels.gemv's API)
    DEVICE_TILES,
    FP8_DEVICE_TILES,
    PREFETCH_SHARE,
    GemvConfig,
    device_entry,
    device_tile,
    pick_config,
    pick_dot_config,
)
from pdserve.kernels.gemv_row import gemv_one_row
from pdserve.kernels.rmsnorm import fused_add_rmsnorm
from pdserve.kernels.silu_mul import silu_and_mul

MAX_ROWS = 16  # the tensor-core kernel pads rows to tl.dot's M = 16
CUDA_CORE_ROWS = 4  # the CUDA-core kernel keeps a [T, BLOCK_N, BLOCK_K] fp32 accumulator
# What the model sends here: batch-1 decode steps and MTP verify steps of up to 3 drafts
# (2-4 rows), whose layers then run as PDL-chained Triton kernels instead of cuBLAS GEMMs
# with separate norm / SiLU kernels between them.
MODEL_ROWS = 4
PROLOGUES = {"none": 0, "norm": 1, "silu": 2}


@jit
def _activation(x, x_ptr, nw_ptr, rows, row_ok, offs_k, K, stride_x, PROLOGUE: tl.constexpr):
    """The prologue's output a[TP, BLOCK_K] in fp32 from the loaded input tile x (for "norm":
    h = x + residual, already summed and rounded, times the norm weight, without rstd)."""
    k_ok = offs_k < K
    m = row_ok[:, None] & k_ok[None, :]
    io = x_ptr.dtype.element_ty
    if PROLOGUE == 2:  # silu(gate) * up; up sits K columns right of gate
        up = tl.load(x_ptr + rows[:, None] * stride_x + K + offs_k[None, :], mask=m, other=0.0)
        g = x.to(tl.float32)
        a = (g / (1.0 + tl.exp(-g)) * up.to(tl.float32)).to(io).to(tl.float32)
    elif PROLOGUE == 1:  # h * norm_weight; the row's rstd is applied to the dot products
        nw = tl.load(nw_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        a = x.to(tl.float32) * nw[None, :]
    else:
        a = x.to(tl.float32)
    return a


@jit
def _gemv_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, y_ptr, res_out_ptr, add_ptr, s_ptr, N, K,
                 stride_x, stride_res, stride_w, stride_y, stride_ro, stride_add, stride_s, eps,
                 T: tl.constexpr, TP: tl.constexpr, PROLOGUE: tl.constexpr,
                 HAS_RESIDUAL: tl.constexpr, HAS_ADD: tl.constexpr, SCALE: tl.constexpr,
                 S_BN: tl.constexpr, S_BK: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, W_EVICT: tl.constexpr, PF_LINES: tl.constexpr,
                 PF_LINE: tl.constexpr, USE_PDL: tl.constexpr):
    """FP8 (SCALE > 0): w_ptr holds the e4m3 bytes as int8, decoded by fp8_bits_f32 to the
    value times 2^-120; the scales are taken times BITS_HI and y times BITS_LO."""
    pid = tl.program_id(0)
    rows = tl.arange(0, TP)
    row_ok = rows < T
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k0 = tl.arange(0, BLOCK_K)
    # "norm": h^2 per row and lane, summed once after the loop for rstd (a cross-lane sum
    # per K step put a shuffle + barrier in every iteration: q/k/v 0.85 -> 0.72 ms per step)
    ss = tl.zeros([TP, BLOCK_K], tl.float32)
    acc = tl.zeros([TP, BLOCK_N, BLOCK_K], tl.float32)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_w
    # Everything after the PDL wait. Loading the first weight tile before the wait (weights
    # are never written) with a hand-written prefetch of each next tile measured 16% SLOWER
    # over a whole Qwen3-8B decode step on an H100 (6.96 vs 5.98 ms; loading only the first
    # tile early: 6.88): the waiting programs hold registers the running kernel needs
    # (bench/lab/diag_decode.py, bench/results/diag_decode_h100_2026-11-23.json). An L2-only
    # prefetch (prefetch.global.L2) of each program's slice before the wait: 6.94 ms (_run2).
    # That was every GEMV, each behind another GEMV that already keeps HBM busy; PF_LINES is
    # for one behind a latency-bound kernel (o_proj behind the decode attention).
    if PF_LINES > 0:
        l2_prefetch_rows(w_ptr, offs_n, N, K, stride_w, 0, 1, PF_LINES, PF_LINE)
    pdl_enter(USE_PDL)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + offs_k0
        m = row_ok[:, None] & (offs_k < K)[None, :]
        w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & (offs_k < K)[None, :],
                    other=0, eviction_policy=W_EVICT)
        x = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :], mask=m, other=0.0)
        if PROLOGUE == 1:
            if HAS_RESIDUAL:  # h = x + residual, rounded as stored; program 0 stores it
                r = tl.load(res_ptr + rows[:, None] * stride_res + offs_k[None, :], mask=m,
                            other=0.0)
                x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
                tl.store(res_out_ptr + rows[:, None] * stride_ro + offs_k[None, :], x,
                         mask=m & (pid == 0))
            hf = x.to(tl.float32)
            ss += hf * hf
        a = _activation(x, x_ptr, nw_ptr, rows, row_ok, offs_k, K, stride_x, PROLOGUE)
        if SCALE == 1:  # FP8, one row block per program: the K lanes' scales scale a
            a = fp8_scale_k(a, s_ptr, pid * BLOCK_N // S_BN, k0, K, stride_s, BITS_HI, TP,
                            BLOCK_K, S_BK)
        if SCALE != 0:  # FP8: integer-op decode (Triton's conversion: 2 cvt per element)
            wf = fp8_bits_f32(w)
        else:
            wf = w.to(tl.float32)
        if SCALE == 2:  # FP8, one K block per step: each row's scale scales its weights
            wf = wf * (fp8_n_scales(s_ptr, offs_n, N, k0, stride_s, S_BN, S_BK) * BITS_HI)[:, None]
        acc += a[:, None, :] * wf[None, :, :]
    y = tl.sum(acc, axis=2)
    if SCALE != 0:
        y = y * BITS_LO
    if PROLOGUE == 1:  # rmsnorm's per-row scale commutes with the dot product
        y = y * tl.rsqrt(tl.sum(ss, axis=1) / K + eps)[:, None]
    out_mask = row_ok[:, None] & n_ok[None, :]
    if HAS_ADD:  # epilogue: the residual add after this projection
        y += tl.load(add_ptr + rows[:, None] * stride_add + offs_n[None, :], mask=out_mask,
                     other=0.0).to(tl.float32)
    tl.store(y_ptr + rows[:, None] * stride_y + offs_n[None, :], y, mask=out_mask)


@jit
def _gemv_dot_kernel(x_ptr, w_ptr, y_ptr, add_ptr, part_ptr, count_ptr, s_ptr, N, K, T,
                     stride_x, stride_w, stride_y, stride_add, stride_s, HAS_ADD: tl.constexpr,
                     SCALE: tl.constexpr, S_BN: tl.constexpr, S_BK: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT_K: tl.constexpr, PREC: tl.constexpr, DOT_DTYPE: tl.constexpr,
                     W_EVICT: tl.constexpr, PF_LINES: tl.constexpr, PF_LINE: tl.constexpr,
                     USE_PDL: tl.constexpr):
    """y[T, N] = x[T, K] @ W[N, K]^T (+ add) for 2..BLOCK_M rows on the tensor cores: the rows
    are padded to tl.dot's minimum M (16; padding rows cost no memory traffic) and each K step
    is one [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N] dot, software-pipelined by Triton. (With a
    norm or SiLU prologue computed inside the loop, Triton stopped pipelining the loads: 4-5x
    slower on an H100, bench/results/gemv_dot_fused_prologue_sweep_h100_2026-11-23.json; gemv() runs those
    prologues as their own small kernel first. Removing those small kernels does not pay
    either: a SiLU-and-mul epilogue (two accumulators: forced k=1 step 6.79 -> 7.56 ms,
    bench/results/diag_verify_glu_h100_2026-11-23.json; gate and up rows gathered into one
    tile: 6.57 -> 6.74, diag_verify_glu_gather_h100_2026-11-24.json), each norm split across
    the GEMVs around it (6.74 -> 6.89, diag_verify_handoff_h100_2026-11-24.json), and even a
    timing-only layer with no norm or SiLU kernels at all (6.56 -> 6.63-6.73,
    diag_verify_no_small_kernels_h100_2026-11-24.json) were slower.)

    SPLIT_K > 1: program (n, s) sums K steps s, s + SPLIT_K, ... into a partial [BLOCK_M,
    BLOCK_N] tile, stores it to part_ptr [SPLIT_K, BLOCK_M, N] and bumps tile n's arrival
    counter; the last of the SPLIT_K to arrive adds the partials up and runs the epilogue."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < T
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k0 = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_w
    if PF_LINES > 0:  # this program's share of the tile's columns (the union covers W)
        l2_prefetch_rows(w_ptr, offs_n, N, K, stride_w, split, SPLIT_K, PF_LINES, PF_LINE)
    pdl_enter(USE_PDL)
    for k0 in range(split * BLOCK_K, K, SPLIT_K * BLOCK_K):
        offs_k = k0 + offs_k0
        k_ok = offs_k < K
        w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0,
                    eviction_policy=W_EVICT)
        x = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if SCALE != 0:  # FP8 (int8 bytes): dequantize in registers (fp32, then DOT_DTYPE)
            w = fp8_dequant_tile(w, s_ptr, offs_n, N, K, k0, stride_s, pid * BLOCK_N // S_BN,
                                 SCALE, S_BN, S_BK, BLOCK_N, BLOCK_K)
        acc += tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), input_precision=PREC)
    out_mask = row_ok[:, None] & n_ok[None, :]
    tile = rows[:, None] * N + offs_n[None, :]  # [BLOCK_M, BLOCK_N] offsets in one partial
    last = True
    if SPLIT_K > 1:
        tl.store(part_ptr + split * BLOCK_M * N + tile, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial stored before the release below
        last = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel") == SPLIT_K - 1
    if last:
        if SPLIT_K > 1:
            tl.store(count_ptr + pid, 0)  # all have arrived: reset for the next launch
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in tl.static_range(SPLIT_K):
                acc += tl.load(part_ptr + s * BLOCK_M * N + tile, mask=out_mask, other=0.0,
                               cache_modifier=".cg")
        if HAS_ADD:
            acc += tl.load(add_ptr + rows[:, None] * stride_add + offs_n[None, :],
                           mask=out_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows[:, None] * stride_y + offs_n[None, :], acc, mask=out_mask)



def _check(x: torch.Tensor, weight: torch.Tensor, prologue: str, residual: torch.Tensor | None,
           norm_weight: torch.Tensor | None, eps: float, add: torch.Tensor | None,
           scales: torch.Tensor | None, block: Block | None) -> None:
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, last_contiguous=True)
    check_launchable("x", x)
    check_tensor("weight", weight, ndim=2, dtypes=(x.dtype, FP8_DTYPE), device=x.device,
                 last_contiguous=True)
    check_scales(weight, scales, block)
    if prologue not in PROLOGUES:
        raise ValueError(f"prologue: {prologue!r} not in {sorted(PROLOGUES)}")
    T, k_in = x.shape
    N, K = weight.shape
    if not 1 <= T <= MAX_ROWS:
        raise ValueError(f"x: {T} rows; gemv takes 1..{MAX_ROWS} (use a matmul above that)")
    if k_in != (2 * K if prologue == "silu" else K):
        raise ValueError(f"x: last dim {k_in} does not fit weight [N, K] = {tuple(weight.shape)} "
                         f"with prologue {prologue!r}")
    if prologue == "norm":
        if norm_weight is None:
            raise ValueError("norm_weight: required with prologue 'norm'")
        check_tensor("norm_weight", norm_weight, shape=(K,), dtypes=FLOAT_DTYPES,
                     device=x.device, last_contiguous=True)
        if residual is not None:
            check_tensor("residual", residual, shape=(T, K), dtypes=(x.dtype,), device=x.device,
                         last_contiguous=True)
        if not eps > 0:
            raise ValueError(f"eps: must be > 0, got {eps}")
    elif residual is not None or norm_weight is not None:
        raise ValueError("residual: only used with prologue 'norm'")
    if add is not None:
        check_tensor("add", add, shape=(T, N), dtypes=(x.dtype,), device=x.device,
                     last_contiguous=True)


def gemv(x: torch.Tensor, weight: torch.Tensor, prologue: str = "none",
         residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
         eps: float = 1e-6, add: torch.Tensor | None = None, config: GemvConfig | None = None,
         prefetch: bool = False, scales: torch.Tensor | None = None, block: Block | None = None
         ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """y = prologue(x) @ weight.T (+ add) for x [T, K_in] with T <= MAX_ROWS, weight [N, K].

    prologue "none": K_in = K. "silu": K_in = 2K ([gate | up]). "norm": K_in = K, needs
    norm_weight [K]; returns (y, new_residual) where new_residual = x + residual (a new tensor)
    or x itself when residual is None. Rows of x may be strided; the last dims must be
    contiguous. add [T, N] (the residual stream) is summed in fp32 before y is rounded.
    y is a new contiguous [T, N] tensor in x.dtype. One row runs on the CUDA cores
    (kernels/gemv_row.py), 2..16 on the tensor cores (or 2..4 on the CUDA cores here, by
    config).

    prefetch=True is for a launch right behind a latency-bound kernel (o_proj behind the decode
    attention, which reads a few MB in ~7 us and leaves HBM idle): the programs that PDL
    schedules while that kernel runs ask L2 for their weight slice before they wait on it, so
    the weights stream in during the attention instead of after it. (Behind a GEMV, which
    already keeps HBM busy, the same prefetch was slower; see _gemv_kernel.)

    FP8: weight float8_e4m3fn [N, K] with scales float32 [ceil(N / bn), ceil(K / bk)] for
    block = (bn, bk) (kernels/fp8_scales.py); the tile is dequantized in registers, fp32
    accumulate, the same prologues and epilogue.
    """
    _check(x, weight, prologue, residual, norm_weight, eps, add, scales, block)
    T, N, K = x.shape[0], weight.shape[0], weight.shape[1]
    cfg = config or pick_config(N, K, T, weight.element_size(), prefetch, x.device)
    fp8 = _fp8_args(cfg, weight, scales, block)
    if T > 1 and cfg.tensor_cores:
        return _gemv_rows(x, weight, prologue, residual, norm_weight, eps, add, cfg, fp8)
    if T > CUDA_CORE_ROWS:
        raise ValueError(f"config: the CUDA-core kernel takes 1..{CUDA_CORE_ROWS} rows, got {T} "
                         f"(set tensor_cores=True)")
    if T == 1 and cfg.one_row:
        y, res_out = gemv_one_row(x, weight, PROLOGUES[prologue], residual, norm_weight, eps,
                                  add, cfg, fp8, _prefetch_args(cfg, K, 1, weight))
        return (y, res_out) if prologue == "norm" else y
    res_out = x
    if prologue == "norm" and residual is not None:
        res_out = torch.empty((T, K), dtype=x.dtype, device=x.device)
    y = torch.empty((T, N), dtype=x.dtype, device=x.device)
    res = residual if residual is not None else x
    nw = norm_weight if norm_weight is not None else weight
    out = y if add is None else add
    _gemv_kernel[(triton.cdiv(N, cfg.block_n),)](
        x, res, nw, fp8["w"], y, res_out, out, fp8["s"], N, K, x.stride(0), res.stride(0),
        weight.stride(0), y.stride(0), res_out.stride(0), out.stride(0), fp8["stride"],
        float(eps), T=T, TP=next_pow2(T),
        PROLOGUE=PROLOGUES[prologue], HAS_RESIDUAL=residual is not None,
        HAS_ADD=add is not None, **fp8["consts"], BLOCK_N=cfg.block_n, BLOCK_K=fp8["block_k"],
        W_EVICT="evict_first" if cfg.stream_weights else "",
        **_prefetch_args(cfg, K, 1, weight), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl_launch(x))
    return (y, res_out) if prologue == "norm" else y


def _fp8_args(cfg: GemvConfig, weight: torch.Tensor, scales: torch.Tensor | None,
              block: Block | None) -> dict:
    """The kernels' weight and scale arguments: w (the weight; FP8 bytes as int8), s
    (pointer), stride, block_k (the config's, shrunk where the scales need it) and the
    constexprs SCALE, S_BN, S_BK (kernels/fp8_scales.py)."""
    if scales is None:
        return {"w": weight, "s": weight, "stride": 0, "block_k": cfg.block_k,
                "consts": {"SCALE": 0, "S_BN": 1, "S_BK": 1}}
    N, K = weight.shape
    block_k = fit_block_k(block, N, K, cfg.block_n, cfg.block_k)
    s_bn, s_bk = kernel_block(block, N, K)
    return {"w": weight.view(torch.int8), "s": scales, "stride": scales.stride(0),
            "block_k": block_k,
            "consts": {"SCALE": scale_mode(block, N, K, cfg.block_n, block_k), "S_BN": s_bn,
                       "S_BK": s_bk}}


def _prefetch_args(cfg: GemvConfig, K: int, parts: int, weight: torch.Tensor) -> dict:
    """PF_LINES / PF_LINE: cache lines (of 128 bytes) per weight row each program prefetches."""
    lines = 0 if interpreting() else prefetch_lines(K, parts, cfg.l2_prefetch,
                                                     weight.element_size())
    return {"PF_LINES": lines, "PF_LINE": 128 // weight.element_size()}


def _gemv_rows(x: torch.Tensor, weight: torch.Tensor, prologue: str,
               residual: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float,
               add: torch.Tensor | None, cfg: GemvConfig, fp8: dict
               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """2..16 rows: the prologue as its own kernel (activation rounded to x.dtype, as in an
    unfused layer), then the tensor-core kernel."""
    if min(cfg.block_n, cfg.block_k) < 16 or not 1 <= cfg.split_k <= 16:
        raise ValueError(f"config: the tensor-core kernel needs block_n and block_k >= 16 "
                         f"and split_k in 1..16, got {cfg}")
    h = x
    if prologue == "norm":  # PDL-chained: between Triton kernels of a verify step
        x, h = fused_add_rmsnorm(x, residual, norm_weight, eps, pdl=True)
    elif prologue == "silu":
        x = silu_and_mul(x, pdl=True)
    T, N, K = x.shape[0], weight.shape[0], weight.shape[1]
    y = torch.empty((T, N), dtype=x.dtype, device=x.device)
    out = y if add is None else add
    grid_n = triton.cdiv(N, cfg.block_n)
    parts, counts = y, y
    if cfg.split_k > 1:
        parts = scratch_fp32(x.device, cfg.split_k * 16 * N)
        counts = arrival_counters(x.device, grid_n)
    _gemv_dot_kernel[(grid_n, cfg.split_k)](
        x, fp8["w"], y, out, parts, counts, fp8["s"], N, K, T, x.stride(0), weight.stride(0),
        y.stride(0), out.stride(0), fp8["stride"], HAS_ADD=add is not None, **fp8["consts"],
        BLOCK_M=16, BLOCK_N=cfg.block_n, BLOCK_K=fp8["block_k"], SPLIT_K=cfg.split_k,
        PREC=dot_precision(x.dtype), DOT_DTYPE=dot_dtype(x.dtype),
        W_EVICT="evict_first" if cfg.stream_weights else "",
        **_prefetch_args(cfg, K, cfg.split_k, weight), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl_launch(x))
    return (y, h) if prologue == "norm" else y

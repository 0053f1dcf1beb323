"""The one-row GEMV (batch-1 decode) on the CUDA cores, 16-bit or FP8 weights, with
kernels/gemv.py's prologues ("none", "norm", "silu") and residual-add epilogue:

    y[1, N] = prologue(x)[1, K] @ W[N, K]^T            (fp32 accumulate, y in x.dtype)

Why a kernel of its own (kernels/gemv.py's CUDA-core kernel takes 1..4 rows): that kernel's
accumulator is [rows, BLOCK_N, BLOCK_K], and broadcasting the activation rows against the
weight tile in 3-D made Triton move every weight tile through shared memory each K step
(st.shared + ldmatrix + 4 barriers) and keep a 64-register accumulator. In SASS compiled for
sm_90 (Triton 3.6, 8 x 1024 FP8 tile, "norm" prologue): 440 instructions per thread per K step
for 64 weights (6.9 per weight: 283 integer ops for the e4m3 decode, the rest FMAs, the
shared-memory round trip and barriers); an FP8 GEMV at 4 TB/s must take 16 weights per clock
per SM, more than that leaves issue slots for. Here, with one row:
  - the weight tile and the activation vector share one register layout (each thread holds
    VEC = 8 consecutive K columns of its rows; the weight pointer's contiguity is capped at
    VEC so a bf16 activation load and an FP8 or bf16 weight load both take VEC per thread),
    so nothing goes through shared memory and the prologue's work (residual add, norm weight,
    SiLU, FP8 K-scales) is done once per column and reused by all BLOCK_N rows;
  - each thread sums its VEC products at once, so the accumulator is [BLOCK_N, BLOCK_K / VEC]
    (8 registers at 8 x 1024, was 64): more programs fit an SM, more weight bytes in flight;
  - FP8 is decoded by Triton's conversion: cvt e4m3x2 -> f16x2 (one F2FP per two weights)
    and f16 -> f32 (HADD2.F32, on the FMA pipe), no integer ops.
Same tile: 323 instructions per 64 weights with the residual-add "norm" prologue, 262 with
none (no shared memory, no integer decode); registers 128 -> 59. Measured on an H200 at
Qwen3-8B's shapes (bench/results/gemv_one_row_h200_2026-11-25.json, us before -> after):
FP8 qkv 13.5 -> 9.8, o 8.4 -> 6.6, gate_up 39.8 -> 27.3, down 23.1 -> 14.7 (2.6-3.7 TB/s);
bf16 qkv 15.5 -> 14.5, o 12.5 -> 11.4, gate_up 51.2 -> 49.1, down 26.0 -> 25.4.
What did not pay (same benchmark): num_stages > 1, the K loop as tl.range(num_stages=...)
(a launch-wide num_stages does not pipeline a loop without tl.dot), which streams the next
tiles into shared memory with cp.async: FP8 1.4-2x slower at every tile and depth 2-4, bf16
within 3-6% (bench/results/fp8_h200_2026-11-25_qwen3-8b_gemv_stages.json), so the default
is 1; a hand-written double buffer (the next tile carried through the loop in registers):
Triton moved the carried tile through shared memory again; an L2 prefetch of the weight
slice before the PDL wait for the projections behind a GEMV: share 0.25 neutral, 1.0 5-30%
slower (bench/results/gemv_one_row_extra_h200_2026-11-25.json).
What did pay (in the whole decode step, not alone): the first K step's tile loaded before the
PDL wait (PRELOAD), so a launch's first bytes are in flight while the kernel before it
drains: Qwen3-8B bf16 step 4.059 -> 3.929 ms, Qwen3-30B-A3B 2.590 -> 2.515; FP8 2.552 ->
2.649, so FP8 GEMVs do not (kernels/gemv_configs.py pick_config,
bench/results/diag_preload_h200_2026-11-25.json).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._triton import interpreting, jit, l2_prefetch_rows, pdl_enter, pdl_launch
from pdserve.kernels.fp8_scales import fp8_n_scales
from pdserve.kernels.gemv_configs import GemvConfig


@jit
def _load_w(w_rows, n_ok, offs_k0, k0, K, VEC: tl.constexpr, W_EVICT: tl.constexpr):
    """The weight tile [BLOCK_N, BLOCK_K] at columns k0.. (zeros past K): VEC consecutive
    columns per thread, the layout of the activation vector (see the module doc). Masked
    even where the tiles divide W: without masks (14% fewer instructions per step) ptxas
    interleaved the tile's loads with the FMAs of its first rows instead of issuing them
    all first, and o_proj went 6.5 -> 8.4 us on an H200 (FP8, 4 x 2048)."""
    offs = tl.max_contiguous(tl.multiple_of(k0 + offs_k0, VEC), VEC)
    return tl.load(w_rows + offs[None, :], mask=n_ok[:, None] & (offs < K)[None, :], other=0,
                   eviction_policy=W_EVICT)


@jit
def _row_activation(x_ptr, res_ptr, nw_ptr, res_out_ptr, offs_k, k_ok, K, store_h,
                    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """(a, h): the prologue's output a [BLOCK_K] fp32 (for "norm" without rstd, which is
    applied to the dot products) and h [BLOCK_K] fp32, the normed input (for sum(h^2))."""
    x = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0)
    if PROLOGUE == 2:  # silu(gate) * up, rounded to x.dtype as silu_and_mul stores it
        up = tl.load(x_ptr + K + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        g = x.to(tl.float32)
        a = (g / (1.0 + tl.exp(-g)) * up).to(x_ptr.dtype.element_ty).to(tl.float32)
        return a, a
    if PROLOGUE == 1:
        if HAS_RESIDUAL:  # h = x + residual, rounded as stored; program 0 stores it
            r = tl.load(res_ptr + offs_k, mask=k_ok, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
            tl.store(res_out_ptr + offs_k, x, mask=k_ok & store_h)
        h = x.to(tl.float32)
        nw = tl.load(nw_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        return h * nw, h
    a = x.to(tl.float32)
    return a, a


@jit
def _row_step(w, k0, acc, ss, pid, offs_n, n_ok, offs_k0, x_ptr, res_ptr, nw_ptr, res_out_ptr,
              s_ptr, N, K, stride_s, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
              SCALE: tl.constexpr, S_BN: tl.constexpr, S_BK: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr):
    """One K step on the loaded weight tile w [BLOCK_N, BLOCK_K] at columns k0..: returns
    (acc [BLOCK_N, BLOCK_K / VEC] + this step's VEC-sums, ss [BLOCK_K / VEC] + the VEC-sums
    of h^2 for "norm")."""
    offs_k = k0 + offs_k0
    k_ok = offs_k < K
    a, h = _row_activation(x_ptr, res_ptr, nw_ptr, res_out_ptr, offs_k, k_ok, K, pid == 0,
                           PROLOGUE, HAS_RESIDUAL)
    if PROLOGUE == 1:
        ss += tl.sum(tl.reshape(h * h, [BLOCK_K // VEC, VEC]), axis=1)
    if SCALE == 1:  # one scale per column: k0 // S_BK + lane // S_BK keeps the lanes of
        # a thread provably equal (one load per thread, not one per lane)
        a = a * tl.load(s_ptr + (pid * BLOCK_N // S_BN) * stride_s + k0 // S_BK
                        + offs_k0 // S_BK, mask=k_ok, other=0.0)
    if SCALE != 0:
        wf = w.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        wf = w.to(tl.float32)
    part = tl.sum(tl.reshape(wf * a[None, :], [BLOCK_N, BLOCK_K // VEC, VEC]), axis=2)
    if SCALE == 2:  # one scale per row for the whole step
        part = part * fp8_n_scales(s_ptr, offs_n, N, k0, stride_s, S_BN, S_BK)[:, None]
    return acc + part, ss


@jit
def _gemv_row_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, y_ptr, res_out_ptr, add_ptr, s_ptr, N, K,
                     stride_w, stride_s, eps, PROLOGUE: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr, HAS_ADD: tl.constexpr, SCALE: tl.constexpr,
                     S_BN: tl.constexpr, S_BK: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, VEC: tl.constexpr, STAGES: tl.constexpr,
                     PRELOAD: tl.constexpr, W_EVICT: tl.constexpr, PF_LINES: tl.constexpr,
                     PF_LINE: tl.constexpr, USE_PDL: tl.constexpr):
    """Program p: outputs p * BLOCK_N ..; x, residual, add, y are single rows. FP8 (SCALE >
    0): w_ptr holds the e4m3 bytes as int8; SCALE 1 multiplies the activation by the K
    scales of the program's row block, SCALE 2 each row's VEC-sums by its scale for the step
    (kernels/fp8_scales.py). PRELOAD: the first K step's weight tile is loaded before the PDL
    wait (weights are never written; the step is peeled off the loop, so no tile is carried
    through it)."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k0 = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    # "norm": h^2 summed per thread's VEC columns (like acc, [BLOCK_K] would hold BLOCK_K /
    # threads registers through the loop: qkv 4 x 2048 80 -> 72 registers), summed after it
    ss = tl.zeros([BLOCK_K // VEC], tl.float32)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_w
    if PF_LINES > 0:  # o_proj behind the decode attention (see kernels/gemv.py gemv)
        l2_prefetch_rows(w_ptr, offs_n, N, K, stride_w, 0, 1, PF_LINES, PF_LINE)
    start = 0
    if PRELOAD:
        w0 = _load_w(w_rows, n_ok, offs_k0, 0, K, VEC, W_EVICT)
        pdl_enter(USE_PDL)
        acc, ss = _row_step(w0, 0, acc, ss, pid, offs_n, n_ok, offs_k0, x_ptr, res_ptr,
                            nw_ptr, res_out_ptr, s_ptr, N, K, stride_s, PROLOGUE, HAS_RESIDUAL,
                            SCALE, S_BN, S_BK, BLOCK_N, BLOCK_K, VEC)
        start = BLOCK_K
    else:
        pdl_enter(USE_PDL)
    for k0 in tl.range(start, K, BLOCK_K, num_stages=STAGES):
        w = _load_w(w_rows, n_ok, offs_k0, k0, K, VEC, W_EVICT)
        acc, ss = _row_step(w, k0, acc, ss, pid, offs_n, n_ok, offs_k0, x_ptr, res_ptr, nw_ptr,
                            res_out_ptr, s_ptr, N, K, stride_s, PROLOGUE, HAS_RESIDUAL, SCALE,
                            S_BN, S_BK, BLOCK_N, BLOCK_K, VEC)
    y = tl.sum(acc, axis=1)
    if PROLOGUE == 1:  # rmsnorm's per-row scale commutes with the dot product
        y = y * tl.rsqrt(tl.sum(ss, axis=0) / K + eps)
    if HAS_ADD:  # epilogue: the residual add after this projection
        y += tl.load(add_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y, mask=n_ok)


def gemv_one_row(x: torch.Tensor, weight: torch.Tensor, prologue: int,
                 residual: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float,
                 add: torch.Tensor | None, cfg: GemvConfig, fp8: dict, prefetch: dict
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch for one row, inputs already checked by kernels.gemv.gemv: x [1, K_in], weight
    [N, K] (fp8: the arguments of gemv's _fp8_args), prologue as gemv.PROLOGUES' number,
    prefetch the PF_LINES / PF_LINE constexprs; cfg.num_stages > 1 pipelines the K loop;
    cfg.preload loads the first weight tile before the PDL wait.
    Returns (y [1, N], new residual: a new [1, K] tensor for "norm" with residual, else x)."""
    N, K = weight.shape
    res_out = x
    if prologue == 1 and residual is not None:
        res_out = torch.empty((1, K), dtype=x.dtype, device=x.device)
    y = torch.empty((1, N), dtype=x.dtype, device=x.device)
    # VEC columns per thread: one 16-byte load of the activation (8 for 16-bit x)
    vec = min(cfg.vec or 16 // x.element_size(), fp8["block_k"])
    _gemv_row_kernel[(triton.cdiv(N, cfg.block_n),)](
        x, residual if residual is not None else x,
        norm_weight if norm_weight is not None else x, fp8["w"], y, res_out,
        add if add is not None else y, fp8["s"], N, K, weight.stride(0), fp8["stride"],
        float(eps), PROLOGUE=prologue, HAS_RESIDUAL=residual is not None,
        HAS_ADD=add is not None, **fp8["consts"], BLOCK_N=cfg.block_n,
        BLOCK_K=fp8["block_k"], VEC=vec,
        STAGES=cfg.num_stages, PRELOAD=cfg.preload,
        W_EVICT="evict_first" if cfg.stream_weights else "", **prefetch,
        num_warps=cfg.num_warps, num_stages=1, **pdl_launch(x),
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg and not interpreting() else {}))
    return y, res_out

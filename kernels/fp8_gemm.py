"""FP8 GEMM for prefill and batched decode: y[M, N] = x[M, K] @ W[N, K]^T with W in e4m3 and
block scales (kernels/fp8_scales.py), the activations quantized on the fly.

Two launches. quant_act: dynamic per-token-group quantization of x, one float32 scale per
row and `group` columns (amax / 448, as DeepSeek-V3's and vLLM's W8A8 block recipe), x8 in
e4m3. Then either
  - the Triton kernel here: each K step is one group, so the step's fp8 x fp8 tl.dot (wgmma
    on Hopper) is promoted into the fp32 accumulator times the group's activation scale per
    row and the weight block's scale per column. Any weight block whose K side is a multiple
    of the group, or covers K (per channel, per tensor), works; or
  - torch._scaled_mm's DeepSeek recipe (cuBLAS >= 12.9, compute capability 9.0 only): 1 x 128
    activation scales (column-major, rows padded to a multiple of 4) with 128 x 128 weight
    blocks; used for exactly that layout on such a device (scaled_mm_fits).
The torch reference is kernels.reference.quant_act_ref + fp8_gemm_ref.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdserve.kernels._triton import (
    FLOAT_DTYPES,
    check_launchable,
    check_tensor,
    interpreting,
    jit,
    next_pow2,
)
from pdserve.kernels.fp8_scales import FP8_DTYPE, Block, check_scales, fp8_n_scales, kernel_block

GROUP = 128  # activation quantization group (the K step) where the weight block allows it


@dataclass(frozen=True)
class Fp8GemmConfig:
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8  # programs walk GROUP_M row tiles per column tile (L2 reuse of W)


def act_group(block: Block, K: int) -> int:
    """The activation group (= the GEMM's K step) for a weight block: GROUP, or the weight's
    K block where that is narrower (each step must lie in one weight K block)."""
    return min(GROUP, kernel_block(block, 1, K)[1])


def pick_gemm_config(M: int, N: int) -> Fp8GemmConfig:
    if interpreting():
        return Fp8GemmConfig(min(64, max(16, next_pow2(M))), min(64, max(16, next_pow2(N))))
    if M <= 64:
        return Fp8GemmConfig(max(16, next_pow2(M)), 128, num_warps=4, num_stages=4)
    return Fp8GemmConfig(128, 128, num_warps=8, num_stages=3)


@jit
def _quant_act_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_x, stride_q, stride_sm, stride_sg,
                      GROUP_SIZE: tl.constexpr, GROUPS: tl.constexpr,
                      ROUND_BY_HAND: tl.constexpr):
    """Program (m, c): row m's groups c * GROUPS .. + GROUPS, a [GROUPS, GROUP_SIZE] tile.
    ROUND_BY_HAND (the interpreter): Triton 3.6's interpreter converts fp32 to e4m3 without
    carrying a mantissa round-up into the exponent (-1.943 -> -1.0), so values are put on
    the e4m3 grid first, where the conversion is exact."""
    m = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = g[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]
    ok = cols < K
    x = tl.load(x_ptr + m * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10) / 448.0  # [GROUPS]
    q = tl.clamp(x / scale[:, None], -448.0, 448.0)
    if ROUND_BY_HAND:  # to the e4m3 grid (3 mantissa bits, subnormal step 2^-9), half up
        step = tl.exp2(tl.maximum(tl.floor(tl.log2(tl.abs(q))), -6.0) - 3.0)
        q = tl.floor(q / step + 0.5) * step
    tl.store(q_ptr + m * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + m * stride_sm + g * stride_sg, scale, mask=g * GROUP_SIZE < K)


def quant_act(x: torch.Tensor, group: int = GROUP, column_major: bool = False,
              pad_rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows may be strided) -> (x8 float8_e4m3fn [M', K], scales float32
    [M', ceil(K / group)]) as kernels.reference.quant_act_ref, M' = M rounded up to pad_rows
    (padding rows unwritten). column_major: scales stored with strides (1, M'), as
    torch._scaled_mm's blockwise recipe takes them. One launch."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, last_contiguous=True)
    check_launchable("x", x)
    if group < 16 or group & (group - 1):
        raise ValueError(f"group: must be a power of two >= 16, got {group}")
    M, K = x.shape
    rows = -(-M // pad_rows) * pad_rows
    g = -(-K // group)
    x8 = torch.empty((rows, K), dtype=FP8_DTYPE, device=x.device)
    scales = (torch.empty((g, rows), dtype=torch.float32, device=x.device).t() if column_major
              else torch.empty((rows, g), dtype=torch.float32, device=x.device))
    if M == 0:
        return x8, scales
    per = min(8, next_pow2(g))
    _quant_act_kernel[(M, triton.cdiv(g, per))](
        x, x8, scales, M, K, x.stride(0), x8.stride(0), scales.stride(0), scales.stride(1),
        GROUP_SIZE=group, GROUPS=per, ROUND_BY_HAND=interpreting(), num_warps=4)
    return x8, scales


@jit
def _fp8_gemm_kernel(a_ptr, sa_ptr, w_ptr, sw_ptr, y_ptr, bias_ptr, M, N, K, stride_a,
                     stride_sam, stride_w, stride_sw, stride_y, HAS_BIAS: tl.constexpr,
                     S_BN: tl.constexpr, S_BK: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n  # grouped order: GROUP_M row tiles share each W column tile
    first_m = (pid // width) * GROUP_M
    rows_here = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % rows_here
    pid_n = (pid % width) // rows_here
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    offs_k0 = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + offs_m[:, None].to(tl.int64) * stride_a
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_w
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + offs_k0
        k_ok = offs_k < K
        a = tl.load(a_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        sa = tl.load(sa_ptr + offs_m * stride_sam + k0 // BLOCK_K, mask=m_ok, other=0.0)
        sw = fp8_n_scales(sw_ptr, offs_n, N, k0, stride_sw, S_BN, S_BK)
        acc += tl.dot(a, tl.trans(w)) * sa[:, None] * sw[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_y + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def scaled_mm_fits(x: torch.Tensor, weight: torch.Tensor, block: Block) -> bool:
    """Whether torch._scaled_mm's 1 x 128 / 128 x 128 recipe takes this GEMM: a CUDA device of
    compute capability 9.0 (its only implementation), 128 x 128 blocks, K and N multiples of
    16 (cuBLAS's fp8 alignment), and K's 128-column blocks a multiple of 4. cuBLASLt reads
    the weight's scales K-major with that count padded to 4 (pytorch/pytorch#166752); torch
    2.11 neither pads them nor takes them padded, and the product is silently wrong
    otherwise: relative error 0.37 at GLM-4.5-Air's dense down_proj (K 10944) on an H200,
    3.6 at K 256 (tests/kernels/test_fp8_gemm.py). Those take the Triton kernel."""
    N, K = weight.shape
    return (x.is_cuda and not interpreting() and tuple(block) == (128, 128)
            and K % 16 == 0 and N % 16 == 0 and -(-K // 128) % 4 == 0
            and hasattr(torch, "_scaled_mm")
            and torch.cuda.get_device_capability(x.device) == (9, 0))


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, block: Block,
             bias: torch.Tensor | None = None, config: Fp8GemmConfig | None = None,
             backend: str = "auto") -> torch.Tensor:
    """x [M, K] (float, rows may be strided) @ (W8 [N, K] * block scales)^T (+ bias [N]) ->
    a new [M, N] in x.dtype, activations quantized per token and group (quant_act).
    backend: "triton", "scaled_mm" (see scaled_mm_fits) or "auto" (scaled_mm where it fits)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, last_contiguous=True)
    check_launchable("x", x)
    check_tensor("weight", weight, shape=(None, x.shape[1]), dtypes=(FP8_DTYPE,),
                 device=x.device, last_contiguous=True)
    check_scales(weight, scales, block)
    if bias is not None:
        check_tensor("bias", bias, shape=(weight.shape[0],), dtypes=FLOAT_DTYPES,
                     device=x.device)
    if backend not in ("auto", "triton", "scaled_mm"):
        raise ValueError(f"backend: {backend!r} not in ['auto', 'scaled_mm', 'triton']")
    fits = scaled_mm_fits(x, weight, block)
    if backend == "scaled_mm" and not fits:
        raise ValueError("backend: torch._scaled_mm does not take this GEMM (see scaled_mm_fits)")
    if backend != "triton" and fits:
        return _scaled_mm(x, weight, scales, bias)
    return _triton_gemm(x, weight, scales, block, bias, config)


def _triton_gemm(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, block: Block,
                 bias: torch.Tensor | None, config: Fp8GemmConfig | None) -> torch.Tensor:
    (M, K), N = x.shape, weight.shape[0]
    group = act_group(block, K)
    x8, sx = quant_act(x, group)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    cfg = config or pick_gemm_config(M, N)
    s_bn, s_bk = kernel_block(block, N, K)
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
    _fp8_gemm_kernel[grid](
        x8, sx, weight, scales, y, bias if bias is not None else y, M, N, K, x8.stride(0),
        sx.stride(0), weight.stride(0), scales.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, S_BN=s_bn, S_BK=s_bk, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=group, GROUP_M=cfg.group_m, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return y


def _scaled_mm(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    """torch._scaled_mm's blockwise recipe: A row-major, B = W8^T (column-major), scale_a
    column-major [M', K / 128] (M' a multiple of 4), scale_b = W scales^T."""
    M = x.shape[0]
    x8, sx = quant_act(x, GROUP, column_major=True, pad_rows=4)
    y = torch._scaled_mm(x8, weight.t(), scale_a=sx, scale_b=scales.t(), out_dtype=x.dtype)
    y = y[0] if isinstance(y, tuple) else y
    y = y[:M]
    return y if bias is None else y + bias

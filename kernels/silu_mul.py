"""SiLU-and-mul for the SwiGLU MLP: x [T, 2I] = [gate | up] -> silu(gate) * up, [T, I].

One fused pass instead of silu, a copy and a multiply; fp32 math, output in x.dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._triton import (
    FLOAT_DTYPES,
    check_launchable,
    check_tensor,
    jit,
    next_pow2,
    pdl_enter,
    pdl_launch,
)

BLOCK_MAX = 1024  # columns per program: enough programs to fill the GPU even at T = 1


@jit
def _silu_and_mul_kernel(x_ptr, out_ptr, I, stride_x, stride_out, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)  # chained early launch between the MLP's projections
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    silu = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + row * stride_out + cols, silu * up, mask=mask)


def silu_and_mul(x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """x [T, 2I] -> silu(x[:, :I]) * x[:, I:] as a new contiguous [T, I] tensor.
    pdl: as kernels.rmsnorm.fused_add_rmsnorm's (only between PDL-chained Triton kernels).

    Rows of x may be strided (e.g. a slice of a larger projection); columns must be contiguous.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, last_contiguous=True)
    check_launchable("x", x)
    T, two_i = x.shape
    if two_i % 2:
        raise ValueError(f"x: last dim {two_i} must be even ([gate | up])")
    inter = two_i // 2
    out = torch.empty((T, inter), dtype=x.dtype, device=x.device)
    if T == 0 or inter == 0:
        return out
    block = min(BLOCK_MAX, next_pow2(inter))
    grid = (T, triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](x, out, inter, x.stride(0), out.stride(0), BLOCK=block,
                               num_warps=4, **(pdl_launch(x) if pdl else {"USE_PDL": False}))
    return out

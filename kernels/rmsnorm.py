"""Fused residual-add + RMSNorm: one read of x and residual, one write of each output.

A decoder layer does `residual = x + residual; x = rmsnorm(residual)` twice; unfused that is
three kernels and five passes over [T, H]. Here one program normalises one row.
"""
from __future__ import annotations

import torch
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

MAX_HIDDEN = 65536  # one row must fit one program's registers


@jit
def _add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, rows_ptr, H, stride_x,
                        stride_res, stride_out, stride_res_out, eps, HAS_RESIDUAL: tl.constexpr,
                        HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    # PDL (pdl=True): between the GEMVs of a verify step (2..4 rows) this kernel is scheduled
    # while the projection before it drains instead of breaking the chain of early launches
    row = tl.program_id(0).to(tl.int64)
    src = tl.load(rows_ptr + row).to(tl.int64) if HAS_ROWS else row  # before the wait
    pdl_enter(USE_PDL)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    h = tl.load(x_ptr + src * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(res_ptr + src * stride_res + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL or HAS_ROWS:  # new_residual: the sum, or the gathered rows of x
        # Normalise the sum as stored (rounded to the activation dtype), so the fused layer
        # computes exactly what the unfused one would.
        h_io = h.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + offs, h_io, mask=mask)
        h = h_io.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / H + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, h * rstd * w, mask=mask)


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                      eps: float, pdl: bool = False, out: torch.Tensor | None = None,
                      rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new_residual) for x [T, H], residual [T, H] or None, weight [H].
    rows: int64 [R] (on the device, not checked there: each in [0, T)) picks the rows to
    normalise, in that order: both outputs are [R, H] (x[rows] + residual[rows] ...), the
    gather done by the same kernel (an MTP layer's output at the accepted positions). rows
    is read before a PDL wait: with pdl=True it must not come from the kernel just before.
    out: where normed goes, [T, H] in x.dtype with contiguous rows, e.g. one half of a
    concatenation (an MTP layer's [enorm(e) | hnorm(h)]: no cat kernel); default a new tensor.

    pdl=True launches it as a programmatic dependent launch: only between PDL-chained Triton
    kernels (the GEMVs of a verify step). After a cuBLAS GEMM it invalidated CUDA graph
    captures on an H100 (cudaErrorStreamCaptureInvalidated), so it is off by default.

    new_residual = x + residual (fp32 add, stored in x.dtype; x itself when residual is None),
    normed = new_residual * rsqrt(mean(new_residual^2) + eps) * weight, in x.dtype.
    Rows may be strided; the hidden dim must be contiguous. Outputs are new tensors (but out).
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, last_contiguous=True)
    check_launchable("x", x)
    T, H = x.shape
    if residual is not None:
        check_tensor("residual", residual, shape=(T, H), dtypes=(x.dtype,), device=x.device,
                     last_contiguous=True)
    check_tensor("weight", weight, shape=(H,), dtypes=FLOAT_DTYPES, device=x.device,
                 last_contiguous=True)
    if H > MAX_HIDDEN:
        raise ValueError(f"x: hidden size {H} exceeds {MAX_HIDDEN}")
    if not eps > 0:
        raise ValueError(f"eps: must be > 0, got {eps}")
    if rows is not None:
        check_tensor("rows", rows, ndim=1, dtypes=(torch.int64,), device=x.device)
    R = T if rows is None else rows.shape[0]
    if out is None:
        out = torch.empty((R, H), dtype=x.dtype, device=x.device)
    else:
        check_tensor("out", out, shape=(R, H), dtypes=(x.dtype,), device=x.device,
                     last_contiguous=True)
    if residual is not None or rows is not None:
        new_res = torch.empty((R, H), dtype=x.dtype, device=x.device)
    else:
        new_res = x
    if R == 0:
        return out, new_res
    block = next_pow2(H)
    res = x if residual is None else residual
    _add_rmsnorm_kernel[(R,)](
        x, res, weight, out, new_res, x if rows is None else rows, H, x.stride(0),
        res.stride(0), out.stride(0), new_res.stride(0), float(eps),
        HAS_RESIDUAL=residual is not None, HAS_ROWS=rows is not None, BLOCK=block,
        num_warps=min(16, max(1, block // 512)),
        **(pdl_launch(x) if pdl else {"USE_PDL": False}))
    return out, new_res

"""The decode-sized projection of one linear module, whatever its weight format.

DecoderLayer._forward_gemv calls linear_gemv(x, module, ...) for each projection; the format
of the module's weight (a float nn.Linear today; FP8 weights with block scales, a
tensor-parallel shard) is this file's concern, so the decoder reads the same for all.
"""
from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.model.fp8 import Fp8Linear
from pdserve.engine.model.layers import fused_kernels


def linear_gemv(x: torch.Tensor, module: nn.Module, prologue: str = "none",
                residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                eps: float = 1e-6, add: torch.Tensor | None = None, prefetch: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """kernels.gemv with `module`'s weight: x [T, K_in] (T <= GEMV_ROWS) -> [T, N], the
    prologue/residual/add fusions as kernels/gemv.py documents them. The bias is not added.
    An Fp8Linear's e4m3 weight goes in with its block scales (the kernel dequantizes tiles in
    registers)."""
    fp8 = {"scales": module.weight_scale, "block": module.block} \
        if isinstance(module, Fp8Linear) else {}
    return fused_kernels().gemv(x, module.weight, prologue, residual, norm_weight, eps, add,
                                prefetch=prefetch, **fp8)

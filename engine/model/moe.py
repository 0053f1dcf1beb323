"""The MLP part of a decoder layer: the dense SwiGLU MLP or a mixture of experts, chosen once
per layer at build time (make_mlp) from ModelConfig.moe.

MoEBlock (Qwen3-MoE, GLM-4.5): a router scores E experts per token, the top_k run as SiLU-gated
MLPs and their outputs are summed with the routing weights; GLM adds a shared expert (a plain
SwiGLU MLP every token runs). Parameter names follow transformers' modules (mlp.gate.weight,
mlp.gate.e_score_correction_bias, mlp.shared_experts.*), except that the experts are stacked:
w13 [E, 2I, H] (each expert's gate rows over its up rows) and w2 [E, H, I] (down), the layout
of kernels/reference.py, which engine/model/weights.py fills from the per-expert tensors.

One seam for the fused kernel: MoEBlock.routed_experts calls pdserve.kernels.ops.fused_moe
when the fused path is on and kernels/ has it; otherwise the torch references
moe_route_ref + moe_experts_ref (kernels/reference.py: the kernel's contract) compute the same
function. The reference reads the chosen expert ids on the host, so it cannot be captured in a
CUDA graph: MoE models need the fused kernel for CUDA-graph decoding.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pdserve.engine.core.config import ModelConfig, MoEConfig
from pdserve.engine.model.layers import RMSNorm, SwiGLUMLP, fused_kernels
from pdserve.kernels.reference import moe_experts_ref, moe_route_ref


def make_mlp(cfg: ModelConfig, layer: int) -> nn.Module:
    """The MLP of decoder layer `layer` (MTP layers: num_layers + i): MoE where cfg.moe says
    so, else the dense SwiGLU MLP of cfg.intermediate_size."""
    if cfg.moe is None or not cfg.moe.is_moe_layer(layer):
        return SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)
    return MoEBlock(cfg.hidden_size, cfg.moe)


class Router(nn.Module):
    """weight [E, H] and, for GLM-4.5, e_score_correction_bias [E]. Both stay float32 whatever
    the model's dtype (cast_model): routing ranks scores across experts, and bf16 would swap
    close ones (transformers keeps GLM's router in float32 for the same reason)."""

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(moe.num_experts))
                                        if moe.correction_bias else None)


class Experts(nn.Module):
    """E SiLU-gated MLPs stacked: w13 [E, 2I, H] = gate rows over up rows, w2 [E, H, I].
    FP8 (engine/model/fp8.py): w13/w2 float8_e4m3fn with per-expert scale grids w13_scale
    [E, ceil(2I / bn), ceil(H / bk)] and w2_scale, in blocks[0] and blocks[1]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.register_parameter("w13_scale", None)
        self.register_parameter("w2_scale", None)
        self.blocks: tuple[tuple[int, int], tuple[int, int]] | None = None

    def dense(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) in `dtype`: FP8 ones dequantized (all experts; the torch reference path)."""
        if self.w13_scale is None:
            return self.w13, self.w2
        from pdserve.engine.model.fp8 import dequantize

        return (dequantize(self.w13, self.w13_scale, self.blocks[0], dtype),
                dequantize(self.w2, self.w2_scale, self.blocks[1], dtype))


class MoEBlock(nn.Module):
    """Routed experts (+ a shared expert): normed rows [T, H] -> [T, H]."""

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.gate = Router(hidden_size, moe)
        self.experts = Experts(moe.num_experts, hidden_size, moe.intermediate_size)
        shared = moe.intermediate_size * moe.num_shared_experts
        self.shared_experts = SwiGLUMLP(hidden_size, shared) if shared else None
        self.top_k = moe.top_k
        # moe_route_ref / fused_moe keyword arguments, fixed per model
        self.routing = dict(scoring=moe.scoring, n_group=moe.n_group, topk_group=moe.topk_group,
                            renormalize=moe.norm_topk_prob,
                            routed_scaling=moe.routed_scaling_factor)
        self.fused = False  # Model.use_fused_ops: the fused MoE kernel, where kernels/ has one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.routed_experts(x)
        if self.shared_experts is not None:  # GLM: every token also runs the shared expert
            out = out + self.shared_experts(x)
        return out

    def forward_normed(self, h: torch.Tensor, norm: RMSNorm, pdl: bool = False) -> torch.Tensor:
        """self(norm(h)) for un-normed rows h [T, H] (the decoder's batch-1 GEMV path). With the
        fused kernel and no shared expert the block takes h and the norm's weight and eps:
        at batch 1 the router normalises in its prologue and stores the normed rows for the
        experts, so no norm kernel runs (kernels.fused_moe norm). pdl: the kernel before is
        a pdserve GEMV (no all-reduce between), so the router may be a PDL launch."""
        kernel = fused_moe_kernel() if self.fused else None
        if kernel is None or self.shared_experts is not None:  # GLM's shared expert: norm(h)
            return self(norm(h))
        return self.routed_experts(h, norm=(norm.weight, norm.eps), pdl=pdl)

    def routed_experts(self, x: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None,
                       pdl: bool = False) -> torch.Tensor:
        """x [T, H] -> sum over the top_k experts of weight * expert(x), [T, H] in x.dtype.
        norm, pdl: fused_moe's (x un-normed; forward_normed's, fused kernel only)."""
        bias = self.gate.e_score_correction_bias
        kernel = fused_moe_kernel() if self.fused else None
        if kernel is None and norm is not None:
            raise ValueError("norm: only the fused MoE kernel takes un-normed rows")
        if kernel is not None:  # the seam: router, grouped GEMMs and the top-k sum fused
            prologue = {} if norm is None else {"norm": norm, "pdl": pdl}
            ex = self.experts
            fp8 = None if ex.w13_scale is None else fused_kernels().Fp8Experts(
                ex.w13_scale, ex.w2_scale, ex.blocks)  # FP8 experts: their scales too
            extra = {"fp8": fp8} if fp8 is not None else {}  # float experts: routing only
            return kernel(x, self.gate.weight, ex.w13, ex.w2, self.top_k, correction_bias=bias,
                          **extra, **prologue, **self.routing)
        weights, ids = moe_route_ref(x, self.gate.weight, self.top_k, correction_bias=bias,
                                     **self.routing)  # [T, top_k] each
        return moe_experts_ref(x, *self.experts.dense(x.dtype), weights, ids)


def fused_moe_kernel() -> Callable[..., torch.Tensor] | None:
    """pdserve.kernels.ops.fused_moe, or None while kernels/ does not have it yet (the torch
    references then serve the fused path too)."""
    return getattr(fused_kernels(), "fused_moe", None)


def cast_model(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """module.to(dtype), but routers stay float32 (see Router). Cheap on the meta device,
    where models are built before their one allocation."""
    module.to(dtype)
    for m in module.modules():
        if isinstance(m, Router):
            m.float()
    return module

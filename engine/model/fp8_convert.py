"""FP8 layers in a Model: swap the decoder's linear layers and stacked experts for FP8 ones
(empty, for an FP8 checkpoint to fill; or by quantizing a loaded model), and read back which
scale parameters carry which block. The maths and the layer are engine/model/fp8.py; this
module is the part that knows the model's modules (it imports engine/model/moe.py, which
imports fp8.py for dequantization: the arrow goes one way).
"""
from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.core.config import ConfigError
from pdserve.engine.model.fp8 import (
    DEFAULT_BLOCK,
    FP8_DTYPE,
    Block,
    Fp8Linear,
    QuantSpec,
    grid_shape,
    merged_block,
    quantize_blockwise,
    quantize_sources,
)
from pdserve.engine.model.moe import Experts

# -- FP8 layers in a Model ---------------------------------------------------------------------

# our merged projections -> the checkpoint modules whose rows they stack, in order
_SOURCES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _targets(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules that take FP8 weights: every nn.Linear of the decoder layers (attention,
    dense and shared-expert MLPs) and the stacked experts. The LM head, embeddings, norms and
    routers stay in the model dtype, as in the FP8 checkpoints."""
    return [(name, m) for name, m in model.named_modules()
            if name.startswith("layers.") and isinstance(m, (nn.Linear, Experts))]


def _row_starts(model: nn.Module, name: str, rows: int) -> list[int]:
    """First row of each checkpoint source inside our parameter [rows, in] `name`."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "qkv_proj":
        cfg = model.config
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return [0, q, q + kv]
    return [0, rows // 2] if leaf == "gate_up_proj" else [0]


def _ignored(spec: QuantSpec, name: str, module: nn.Module) -> bool:
    """Whether the checkpoint keeps module `name` unquantized; ConfigError when it keeps only
    some of the sources we merge into it."""
    parent, leaf = name.rsplit(".", 1)
    if isinstance(module, Experts):
        hf = [f"model.{name}.0.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    else:
        hf = [f"model.{parent}.{src}" for src in _SOURCES.get(leaf, (leaf,))]
    flags = {spec.ignores(h) for h in hf}
    if len(flags) > 1:
        raise ConfigError(f"quantization_config: ignores some but not all of {hf}, which "
                          f"pdserve merges into {name}")
    return flags.pop()


def convert_empty(model: nn.Module, spec: QuantSpec) -> None:
    """Swap the target modules of a (meta-device) model for FP8 ones of the checkpoint's
    layout, before the model's one allocation; the loader then fills weights and scales."""
    for name, module in _targets(model):
        if _ignored(spec, name, module):
            continue
        if isinstance(module, Experts):
            e, two_i, h = module.w13.shape
            blocks = (merged_block(spec, [0, two_i // 2], two_i, h),
                      merged_block(spec, [0], h, two_i // 2))
            _set_experts(module, torch.empty(e, two_i, h, dtype=FP8_DTYPE),
                         torch.empty(e, h, two_i // 2, dtype=FP8_DTYPE),
                         torch.empty(e, *grid_shape(two_i, h, blocks[0])),
                         torch.empty(e, *grid_shape(h, two_i // 2, blocks[1])), blocks)
            continue
        rows, cols = module.weight.shape
        block = merged_block(spec, _row_starts(model, name, rows), rows, cols)
        _replace(model, name, Fp8Linear(cols, rows, block, module.bias))


@torch.no_grad()
def quantize_model(model: nn.Module, block: Block = DEFAULT_BLOCK) -> int:
    """--quantization fp8: quantize a loaded float model's target modules block-wise in place,
    each merged source (q/k/v, gate/up) on its own grid as an FP8 checkpoint of the model
    would hold it (fp8.quantize_sources: no block mixes two sources). Returns how many
    modules were quantized; FP8 ones already there are left as they are."""
    done = 0
    for name, module in _targets(model):
        if isinstance(module, Experts):
            if module.w13_scale is None:
                inter = module.w13.shape[1] // 2
                w13, s13, b13 = quantize_sources(module.w13, [0, inter], block)
                w2, s2 = quantize_blockwise(module.w2, block)
                _set_experts(module, w13, w2, s13, s2, (b13, block))
                done += 1
            continue
        w8, scales, blk = quantize_sources(module.weight,
                                           _row_starts(model, name, module.weight.shape[0]),
                                           block)
        fp8 = Fp8Linear(module.in_features, module.out_features, blk, module.bias)
        fp8.weight.data, fp8.weight_scale.data = w8, scales
        _replace(model, name, fp8.to(w8.device))
        done += 1
    return done


def _set_experts(experts: Experts, w13: torch.Tensor, w2: torch.Tensor, s13: torch.Tensor,
                 s2: torch.Tensor, blocks: tuple[Block, Block]) -> None:
    device = experts.w13.device  # meta while the model is being built
    for leaf, value in (("w13", w13), ("w2", w2), ("w13_scale", s13), ("w2_scale", s2)):
        setattr(experts, leaf, nn.Parameter(value.to(device), requires_grad=False))
    experts.blocks = blocks


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, leaf = name.rsplit(".", 1)
    setattr(model.get_submodule(parent), leaf, module)


def scale_blocks(model: nn.Module) -> dict[str, Block]:
    """Every FP8 scale parameter of `model` ("layers.0.self_attn.qkv_proj.weight_scale",
    "layers.1.mlp.experts.w13_scale") -> its block."""
    out: dict[str, Block] = {}
    for name, m in model.named_modules():
        if isinstance(m, Fp8Linear):
            out[f"{name}.weight_scale"] = m.block
        elif isinstance(m, Experts) and m.blocks is not None:
            out[f"{name}.w13_scale"], out[f"{name}.w2_scale"] = m.blocks
    return out


def has_fp8(model: nn.Module) -> bool:
    return any(isinstance(m, Fp8Linear) or getattr(m, "w13_scale", None) is not None
               for m in model.modules())


def check_fp8_kernels(model: nn.Module, use_triton: bool) -> None:
    """Refuse an FP8 model the fused path's kernels cannot run, naming the parameter: the
    FP8 GEMV, GEMM and fused-MoE kernels step through K in powers of two, each step inside
    one scale block, so a block's K side must be a power of two >= 16 or cover the whole row
    (per channel, per tensor). The torch path (dequantizing) takes any block."""
    if not use_triton:
        return
    for name, block in scale_blocks(model).items():
        cols = model.get_parameter(name.rsplit("_scale", 1)[0]).shape[-1]
        bk = block[1]
        if bk < cols and (bk < 16 or bk & (bk - 1)):
            raise ConfigError(f"quantization: {name} has scale block {block}; the FP8 kernels "
                              f"need a K side that is a power of two >= 16 or covers all "
                              f"{cols} columns; turn use_triton off for this checkpoint")

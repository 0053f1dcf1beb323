"""Per-tensor static KV-cache scales shipped by FP8-KV checkpoints.

vLLM / llm-compressor checkpoints with a kv_cache_scheme store one float32 scalar per layer
for K and one for V: `layers.{i}.self_attn.k_scale` / `v_scale` (older exports:
`...self_attn.{k,v}_proj.{k,v}_scale`). The real value is e4m3 x scale. With
`--kv-cache-dtype fp8` every block of that layer takes them as its scales (Attention.
kv_static_scales, read by engine/exec/kv_cache.py layer_views) instead of computing a
scale from each block's values; a float KV cache ignores them.
"""
from __future__ import annotations

import math
import re

import torch
from torch import nn

_NAME = re.compile(r"(layers\.\d+\.self_attn)\.(?:[kv]_proj\.)?([kv])_scale")


class KVScaleCollector:
    """Takes the k_scale / v_scale tensors out of a checkpoint's stream and sets them on the
    attention modules once every tensor has been read."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.scales: dict[str, dict[str, float]] = {}  # "layers.3.self_attn" -> {"k": .., "v": ..}

    def take(self, name: str, tensor: torch.Tensor) -> bool:
        """Whether `name` is a KV scale (then kept here); a bad one raises ValueError naming it."""
        m = _NAME.fullmatch(name)
        if m is None:
            return False
        value = float(tensor.float().reshape(-1)[0]) if tensor.numel() == 1 else math.nan
        if tensor.numel() != 1 or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{self.source}: tensor {name!r} must be one finite scale > 0, got "
                             f"shape {tuple(tensor.shape)}" + (f" value {value}" if
                                                               tensor.numel() == 1 else ""))
        self.scales.setdefault(m.group(1), {})[m.group(2)] = value
        return True

    def apply(self, model: nn.Module) -> None:
        """Set (k_scale, v_scale) on each attention module; a layer with only one of the two,
        or a name outside the model, raises ValueError naming it."""
        for module_name, kv in sorted(self.scales.items()):
            if set(kv) != {"k", "v"}:
                missing = ({"k", "v"} - set(kv)).pop()
                raise ValueError(f"{self.source}: {module_name}.{missing}_scale is missing "
                                 f"(the checkpoint has only its {set(kv).pop()}_scale)")
            try:
                attn = model.get_submodule(module_name)
            except AttributeError as e:
                raise ValueError(f"{self.source}: unexpected tensor {module_name}.k_scale "
                                 "(not part of this model)") from e
            attn.kv_static_scales = (kv["k"], kv["v"])

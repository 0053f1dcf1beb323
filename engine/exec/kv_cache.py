"""The paged KV cache's memory: one tensor, one region per block (what KV transfer moves),
and inside a block one region per KV head (layout version 2, heads outermost):

    kv_cache: [num_blocks, num_kv_heads, num_kv_layers + S, 2, block_size, head_dim]

"auto" (S = 0): the model's dtype. "fp8" (kernels/kv_quant.py): float8_e4m3fn values, and
S = scale_layers(...) trailing pseudo-layers in each head's region whose first L * 2 * 4
bytes hold that head's fp32 scales [L, 2 (K, V)] (L = num_kv_layers). So a block's values
and scales are one contiguous byte range (copy-on-write kv_cache[dst].copy_(kv_cache[src]),
NIXL registration and coalesced transfers move them together), and so is one head of a block
with its scales (what a decode rank of another TP size pulls: kv_transfer/tp_pull.py). S is
1 for any real model (4 L <= block_size * head_dim): 1 / (L + 1) of the pool, 2.7% for
Qwen3-8B's 36 layers. Every view into the cache -- a layer's K/V [NB, BS, Hkv, D] and its
scales [NB, Hkv], strided (head stride = one head region) -- is computed here (layer_views);
the kernels take every stride they are given.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from pdserve.engine.core.config import (
    SCALE_BYTES,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    scale_layers,
)
from pdserve.kernels.kv_quant import FP8, KVScales

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float8_e4m3fn": FP8}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def kv_torch_dtype(cache: CacheConfig) -> torch.dtype:
    """The cache tensor's dtype for a CacheConfig: e4m3 with kv_cache_dtype "fp8"."""
    return FP8 if cache.kv_cache_dtype == "fp8" else _DTYPES[cache.kv_dtype]


def allocate_kv_cache(model: ModelConfig, num_blocks: int, block_size: int,
                      dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Zeros [num_blocks, Hkv, num_kv_layers (+ scale layers for fp8), 2, block_size, D]: one
    block = one region, one head of it = one sub-region (a zero scale marks a block no write
    has started yet). `model.num_kv_heads` is this cache's count (a TP rank's local one)."""
    layers = model.num_kv_layers
    if dtype == FP8:
        layers += scale_layers(layers, block_size, model.head_dim)
    shape = (num_blocks, model.num_kv_heads, layers, 2, block_size, model.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


def engine_kv_cache(config: EngineConfig, num_kv_heads: int | None = None) -> torch.Tensor:
    """The engine's cache on its device: config.model's layers (MTP ones included) with
    num_kv_heads heads per layer (a tensor-parallel rank's local count; None: the model's)."""
    model = config.model
    if num_kv_heads is not None:
        model = dataclasses.replace(model, num_kv_heads=num_kv_heads)
    cache = config.cache
    return allocate_kv_cache(model, cache.num_blocks, cache.block_size, kv_torch_dtype(cache),
                             torch.device(config.device))


def data_layers(kv_cache: torch.Tensor) -> int:
    """The number of KV layers L of a cache tensor (its layer dim minus the fp8 scale layers):
    L + scale_layers(L) is increasing in L, so the L that gives the tensor's layer count is
    unique."""
    total, bs, d = kv_cache.shape[2], kv_cache.shape[4], kv_cache.shape[5]
    if kv_cache.dtype != FP8:
        return total
    for layers in range(total - 1, 0, -1):
        if layers + scale_layers(layers, bs, d) == total:
            return layers
    raise ValueError(f"kv_cache: fp8 cache with {total} layers has no room for scales")


def block_scales(kv_cache: torch.Tensor) -> torch.Tensor:
    """[NB, L, 2, Hkv] float32 view of every block's scales (fp8 caches only), strided: the
    head stride is one head region, the scales of (block, head) are [L, 2] contiguous."""
    if kv_cache.dtype != FP8:
        raise ValueError(f"kv_cache: {kv_cache.dtype} cache has no scales")
    nb, hkv, layers = kv_cache.shape[0], kv_cache.shape[1], data_layers(kv_cache)
    tail = kv_cache[:, :, layers:].flatten(2)  # [NB, Hkv, S * 2 * BS * D] bytes per head
    n = layers * 2 * SCALE_BYTES
    return tail[:, :, :n].view(torch.float32).view(nb, hkv, layers, 2).permute(0, 2, 3, 1)


class LayerKV(NamedTuple):
    """One layer's views: k, v [NB, BS, Hkv, D]; scales (fp8 caches) or None."""

    k: torch.Tensor
    v: torch.Tensor
    scales: KVScales | None


def layer_views(kv_cache: torch.Tensor, layer: int,
                static: tuple[float, float] | None = None) -> LayerKV:
    """Layer `layer`'s K/V views [NB, BS, Hkv, D] (strided: the head stride is one head
    region) and, for an fp8 cache, its scales [NB, Hkv] (with the checkpoint's static
    per-tensor scales `static` = (k, v) when it ships them)."""
    if kv_cache.dim() != 6 or kv_cache.shape[3] != 2:  # e.g. a hand-built layout-1 cache
        raise ValueError(f"kv_cache: expected [num_blocks, Hkv, layers, 2, block_size, "
                         f"head_dim] (layout version 2), got shape {tuple(kv_cache.shape)}")
    k = kv_cache[:, :, layer, 0].transpose(1, 2)
    v = kv_cache[:, :, layer, 1].transpose(1, 2)
    if kv_cache.dtype != FP8:
        return LayerKV(k, v, None)
    s = block_scales(kv_cache)
    sk, sv = static if static is not None else (0.0, 0.0)
    return LayerKV(k, v, KVScales(s[:, layer, 0], s[:, layer, 1], float(sk), float(sv)))

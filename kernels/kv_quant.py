"""FP8 (e4m3) KV cache: the scale rule, and its torch reference (no triton here).

A cache block holds e4m3 K/V values plus one fp32 scale per (block, layer, K or V, KV head)
(engine/exec/kv_cache.py carves both out of the block's bytes). value = fp8 * scale.

When a block's scale is set (the rule every writer follows -- the prologue kernel, the
decode kernel's write, kernels/kv_write.py and write_kv_fp8_ref below):
- A "run" is the new tokens of one write launch that land in one block at consecutive
  offsets (one sequence's tokens of that step inside that block).
- A run that starts at offset 0 (a fresh block), or finds the stored scale <= 0, sets the
  scale from the run's own rows: amax over them * HEADROOM / 448 (or the checkpoint's static
  per-tensor scale, when given). Any other run keeps the stored scale and clamps to +-448.
- So a scale is written once per block fill, by the one run that starts the block, and never
  changes under rows already written: no requantization, no race between programs of a launch
  or readers in the same kernel, nothing to redo under CUDA graphs.
Why headroom instead of growing the scale: e4m3 is floating point, so every value between
scale * 2^-6 and scale * 448 keeps the same 3-bit relative precision; a headroom of 8 only moves
the values below amax / 3584 into subnormals (absolute error there <= amax / 57344), while a
later token up to 8x the run's amax is stored with full precision, not clamped. Prefill
writes whole blocks in one run, so only decode-appended blocks start from a single token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
HEADROOM = 8.0
MIN_AMAX = 1e-6  # an all-zero first run still gets a usable (tiny) scale


@dataclass(frozen=True)
class KVScales:
    """One layer's scales: k, v [num_blocks, Hkv] float32 views into the cache's blocks at
    any strides (the kernels take both; a heads-outer cache keeps each head's scales in that
    head's region); static_k / static_v > 0: the checkpoint's per-tensor scales, used as
    every new block's scale instead of the dynamic amax rule."""

    k: torch.Tensor
    v: torch.Tensor
    static_k: float = 0.0
    static_v: float = 0.0


def check_scales(scales: KVScales, k_cache: torch.Tensor) -> None:
    """The launchers' check of a layer's scales against its fp8 cache views [NB, BS, Hkv, D]."""
    if k_cache.dtype != FP8:
        raise TypeError(f"k_cache: dtype {k_cache.dtype} with kv_scales (needs {FP8})")
    nb, _, hkv, _ = k_cache.shape
    for name, t in (("kv_scales.k", scales.k), ("kv_scales.v", scales.v)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            raise TypeError(f"{name}: expected a float32 tensor")
        if tuple(t.shape) != (nb, hkv):
            raise ValueError(f"{name}: expected shape {(nb, hkv)}, got {tuple(t.shape)}")
        if t.device != k_cache.device:
            raise ValueError(f"{name}: must be on {k_cache.device}, got {t.device}")
    for name in ("static_k", "static_v"):
        value = getattr(scales, name)
        if not (value >= 0.0 and value < float("inf")):
            raise ValueError(f"kv_scales.{name}: must be a finite number >= 0, got {value}")


def cache_is_fp8(k_cache: torch.Tensor, scales: KVScales | None) -> bool:
    """Whether the layer views are an FP8 cache; refuses fp8 views without scales."""
    if k_cache.dtype == FP8:
        if scales is None:
            raise ValueError("kv_scales: an fp8 KV cache needs its scales")
        check_scales(scales, k_cache)
        return True
    if scales is not None:
        raise TypeError(f"kv_scales: given for a {k_cache.dtype} cache (only fp8 has scales)")
    return False


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale clamped to e4m3's range, as e4m3 (fp32 math, round to nearest even)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _runs(slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """Run id [T] of each token (slots all >= 0): a new run where the block changes or the
    slots stop being consecutive."""
    start = torch.ones_like(slots, dtype=torch.bool)
    start[1:] = (slots[1:] != slots[:-1] + 1) | (slots[1:] % block_size == 0)
    return torch.cumsum(start.long(), 0) - 1


def _write_one(x: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor, static: float,
               blocks: torch.Tensor, offsets: torch.Tensor, run: torch.Tensor) -> None:
    """x [T, Hkv, D] -> cache [NB, BS, Hkv, D] fp8 at (blocks, offsets), scale [NB, Hkv]."""
    nruns, hkv = int(run[-1]) + 1, x.shape[1]
    amax = torch.zeros(nruns, hkv, dtype=torch.float32, device=x.device)
    amax.scatter_reduce_(0, run[:, None].expand(-1, hkv), x.float().abs().amax(-1), "amax")
    first = torch.zeros(nruns, dtype=torch.long, device=x.device)
    first.scatter_reduce_(0, run, torch.arange(len(run), device=x.device), "amin",
                          include_self=False)
    run_blk = blocks[first]  # [nruns]
    stored = scale[run_blk]  # [nruns, Hkv]
    fresh = (offsets[first] == 0)[:, None] | (stored <= 0)
    new = (torch.full_like(amax, static) if static > 0
           else amax.clamp_min(MIN_AMAX) * (HEADROOM / FP8_MAX))
    run_scale = torch.where(fresh, new, stored)
    scale[run_blk] = run_scale
    cache[blocks, offsets] = quantize(x, run_scale[run][:, :, None])


def write_kv_fp8_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     scales: KVScales) -> None:
    """Quantize-on-write reference: k, v [T, Hkv, D] into the fp8 layer views [NB, BS, Hkv, D]
    at slot_mapping [T] (< 0: padding, skipped), setting scales by the rule above."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    if slots.numel() == 0:
        return
    bs = k_cache.shape[1]
    blocks, offsets, run = slots // bs, slots % bs, _runs(slots, bs)
    _write_one(k[keep], k_cache, scales.k, scales.static_k, blocks, offsets, run)
    _write_one(v[keep], v_cache, scales.v, scales.static_v, blocks, offsets, run)


def dequant_blocks(cache: torch.Tensor, scale: torch.Tensor, blocks: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """cache[blocks] [n, BS, Hkv, D] as `dtype` values: fp8 * its block's per-head scale."""
    return (cache[blocks].float() * scale[blocks][:, None, :, None]).to(dtype)

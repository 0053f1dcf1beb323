"""Scatter new k/v rows into one layer's paged cache views (reshape-and-cache).

Used when RoPE ran elsewhere (the fused prologue writes the cache itself). A layer's views
kv_cache[:, l, 0] and kv_cache[:, l, 1] are [num_blocks, block_size, Hkv, D] with a block stride
far larger than block_size * Hkv * D, so every cache address is computed from strides.
"""
from __future__ import annotations

import torch
import triton.language as tl

from pdserve.kernels._triton import (
    FLOAT_DTYPES,
    check_head_dim,
    check_launchable,
    check_tensor,
    is_pow2,
    jit,
    next_pow2,
)


@jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_kt, stride_kh, stride_vt,
                     stride_vh, stride_kc_b, stride_kc_o, stride_kc_h, stride_vc_b, stride_vc_o,
                     stride_vc_h, HKV, block_size, D: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # slot < 0: padding token
        blk = slot // block_size
        off = slot % block_size
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, D)[None, :]
        mask = h < HKV
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
        tl.store(kc_ptr + blk * stride_kc_b + off * stride_kc_o + h * stride_kc_h + d, k, mask=mask)
        tl.store(vc_ptr + blk * stride_vc_b + off * stride_vc_o + h * stride_vc_h + d, v, mask=mask)


def check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor, num_kv_heads: int | None,
                     head_dim: int | None, device: torch.device) -> tuple[int, int]:
    """Check a layer's K and V cache views [NB, BS, Hkv, D]; returns (block_size, Hkv)."""
    check_tensor("k_cache", k_cache, ndim=4, dtypes=FLOAT_DTYPES, device=device,
                 last_contiguous=True)
    check_tensor("v_cache", v_cache, shape=tuple(k_cache.shape), dtypes=(k_cache.dtype,),
                 device=device, last_contiguous=True)
    _, bs, hkv, d = k_cache.shape
    if num_kv_heads is not None and hkv != num_kv_heads:
        raise ValueError(f"k_cache: has {hkv} kv heads, the keys have {num_kv_heads}")
    if head_dim is not None and d != head_dim:
        raise ValueError(f"k_cache: head_dim {d} != {head_dim}")
    if not is_pow2(bs):
        raise ValueError(f"k_cache: block_size {bs} must be a power of 2")
    return bs, hkv


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k/v [T, Hkv, D] -> k_cache/v_cache [NB, BS, Hkv, D] at slot_mapping [T] (block * BS +
    offset; slots < 0 are skipped). k/v may be strided views with a contiguous head dim."""
    check_tensor("k", k, ndim=3, dtypes=FLOAT_DTYPES, last_contiguous=True)
    check_launchable("k", k)
    T, HKV, D = k.shape
    check_head_dim("k", D)
    check_tensor("v", v, shape=(T, HKV, D), dtypes=(k.dtype,), device=k.device,
                 last_contiguous=True)
    bs, _ = check_cache_pair(k_cache, v_cache, HKV, D, k.device)
    check_tensor("slot_mapping", slot_mapping, shape=(T,), dtypes=(torch.int32, torch.int64),
                 device=k.device)
    if T == 0:
        return
    _write_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HKV, bs, D=D, BLOCK_H=next_pow2(HKV), num_warps=4)


def check_q_and_cache(q: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor) -> tuple[int, int, int, int, int]:
    """Attention launchers' shared checks: q [rows, Hq, D] against the layer's cache views.
    Returns (rows, Hq, D, block_size, Hkv)."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES, last_contiguous=True)
    check_launchable("q", q)
    rows, HQ, D = q.shape
    check_head_dim("q", D)
    bs, HKV = check_cache_pair(k_cache, v_cache, None, D, q.device)
    if k_cache.dtype != q.dtype:
        raise TypeError(f"k_cache: dtype {k_cache.dtype} != q dtype {q.dtype}")
    if HQ % HKV:
        raise ValueError(f"q: {HQ} heads is not a multiple of the cache's {HKV} kv heads")
    return rows, HQ, D, bs, HKV

"""Scatter new k/v rows into one layer's paged cache views (reshape-and-cache).

Used when RoPE ran elsewhere (the fused prologue writes the cache itself). A layer's views
(engine/exec/kv_cache.py layer_views) are [num_blocks, block_size, Hkv, D] with block and head
strides far larger than block_size * Hkv * D (heads are outermost inside a block), so every
cache address is computed from strides.

An fp8 cache (kernels/kv_quant.py) is quantized on write: the program of a run's first token
writes the whole run (the new tokens of one block, <= block_size rows), so it sees the amax
its block's scale needs; quantize_run is the rule, shared with the prologue kernels.
"""
from __future__ import annotations

import torch
import triton.language as tl

from pdserve.kernels._triton import (
    FLOAT_DTYPES,
    INTERPRET,
    check_head_dim,
    check_launchable,
    check_tensor,
    is_pow2,
    jit,
    next_pow2,
)
from pdserve.kernels.kv_quant import FP8, FP8_MAX, HEADROOM, KVScales, cache_is_fp8

CACHE_DTYPES = (*FLOAT_DTYPES, FP8)
DYN_FACTOR = HEADROOM / FP8_MAX  # scale = amax * DYN_FACTOR (kv_quant.py)


# Triton 3.6's interpreter drops the carry when fp32 -> e4m3 rounding overflows the mantissa
# (127.8 -> 64, not 128); there, values are first rounded to 3 mantissa bits in fp32 (exact
# for the conversion after). Compiled kernels convert with cvt.rn directly.
ROUND_IN_FP32 = tl.constexpr(INTERPRET)


@jit
def to_e4m3_grid(x):
    """x (already within +-448) rounded to nearest-even at e4m3's 3 mantissa bits, in fp32."""
    if ROUND_IN_FP32:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576
        # subnormals (< 2^-6): multiples of 2^-9, rounded by an fp32 add at ulp 2^-9
        sub = (x + 24576.0) - 24576.0
        x = tl.where(tl.abs(x) < 0.015625, sub, bits.to(tl.float32, bitcast=True))
    return x


@jit
def quantize_run(x, ok, first_off, sc_ptr, static, dyn_factor):
    """One run's rows x [N, D] fp32 (ok: mask broadcastable to x) for one block and KV head,
    whose scale is at sc_ptr; first_off: the run's first offset in the block. A run that
    starts the block (or finds no scale) sets it: amax * dyn_factor, or `static` when > 0.
    Returns (x / scale clamped to e4m3's range, still fp32; the scale)."""
    amax = tl.max(tl.max(tl.where(ok, tl.abs(x), 0.0), axis=1), axis=0)
    stored = tl.load(sc_ptr)
    fresh = (first_off == 0) | (stored <= 0.0)
    new = tl.where(static > 0.0, static, tl.maximum(amax, 1e-6) * dyn_factor)
    scale = tl.where(fresh, new, stored)
    tl.store(sc_ptr, scale, mask=fresh)
    return to_e4m3_grid(tl.clamp(tl.math.div_rn(x, scale + tl.zeros_like(x)), -448.0, 448.0)), scale


@jit
def run_rows(slot_ptr, t, T, block_size, BS: tl.constexpr):
    """For token t: whether it leads a run (its block's first new token in this launch), its
    block and offset, the run's rows t + j [BS] and their mask (same block, consecutive)."""
    slot = tl.load(slot_ptr + t).to(tl.int64)
    prev = tl.load(slot_ptr + t - 1, mask=t > 0, other=-2).to(tl.int64)
    off = slot % block_size
    lead = (slot >= 0) & ((off == 0) | (prev != slot - 1))
    j = tl.arange(0, BS)
    rows = t + j
    nxt = tl.load(slot_ptr + rows, mask=rows < T, other=-1).to(tl.int64)
    ok = (rows < T) & (nxt == slot + j) & (off + j < block_size)
    return lead, slot // block_size, off, rows, ok


@jit
def _write_kv_fp8_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr, stride_kt,
                         stride_kh, stride_vt, stride_vh, stride_kc_b, stride_kc_o,
                         stride_kc_h, stride_vc_b, stride_vc_o, stride_vc_h, stride_ks_b,
                         stride_ks_h, stride_vs_b, stride_vs_h, T, block_size, static_k,
                         static_v, dyn_factor, D: tl.constexpr, BS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    lead, blk, off, rows, ok = run_rows(slot_ptr, t, T, block_size, BS)
    if lead:
        d = tl.arange(0, D)[None, :]
        m = ok[:, None]
        r = rows[:, None]
        k = tl.load(k_ptr + r * stride_kt + h * stride_kh + d, mask=m, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + r * stride_vt + h * stride_vh + d, mask=m, other=0.0).to(tl.float32)
        # scales [NB, Hkv] at any strides (heads-outer caches keep them in each head's region)
        ks = ks_ptr + blk * stride_ks_b + h * stride_ks_h
        vs = vs_ptr + blk * stride_vs_b + h * stride_vs_h
        kq, _ = quantize_run(k, m, off, ks, static_k, dyn_factor)
        vq, _ = quantize_run(v, m, off, vs, static_v, dyn_factor)
        o = off + (rows - t)[:, None]
        tl.store(kc_ptr + blk * stride_kc_b + o * stride_kc_o + h * stride_kc_h + d,
                 kq.to(kc_ptr.dtype.element_ty), mask=m)
        tl.store(vc_ptr + blk * stride_vc_b + o * stride_vc_o + h * stride_vc_h + d,
                 vq.to(vc_ptr.dtype.element_ty), mask=m)


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
    check_tensor("k_cache", k_cache, ndim=4, dtypes=CACHE_DTYPES, device=device,
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
             slot_mapping: torch.Tensor, kv_scales: KVScales | None = None) -> None:
    """k/v [T, Hkv, D] -> k_cache/v_cache [NB, BS, Hkv, D] at slot_mapping [T] (block * BS +
    offset; slots < 0 are skipped). k/v may be strided views with a contiguous head dim. An
    fp8 cache takes its kv_scales and is quantized on write (reference:
    kv_quant.write_kv_fp8_ref)."""
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
    if cache_is_fp8(k_cache, kv_scales):
        sc = kv_scales
        _write_kv_fp8_kernel[(T, HKV)](
            k, v, k_cache, v_cache, sc.k, sc.v, slot_mapping, k.stride(0), k.stride(1),
            v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), sc.k.stride(0),
            sc.k.stride(1), sc.v.stride(0), sc.v.stride(1), T, bs, float(sc.static_k),
            float(sc.static_v), DYN_FACTOR, D=D, BS=bs, num_warps=4)
        return
    _write_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HKV, bs, D=D, BLOCK_H=next_pow2(HKV), num_warps=4)


def check_q_and_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      dtype: torch.dtype | None = None) -> tuple[int, int, int, int, int]:
    """Attention launchers' shared checks: q [rows, Hq, D] against the layer's cache views
    (a cache of `dtype`, q's unless given: fp32 q may attend over a bf16 cache).
    Returns (rows, Hq, D, block_size, Hkv)."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES, last_contiguous=True)
    check_launchable("q", q)
    rows, HQ, D = q.shape
    check_head_dim("q", D)
    bs, HKV = check_cache_pair(k_cache, v_cache, None, D, q.device)
    want = dtype or q.dtype
    if k_cache.dtype not in (want, FP8):
        raise TypeError(f"k_cache: dtype {k_cache.dtype} != {want} (or fp8)")
    if HQ % HKV:
        raise ValueError(f"q: {HQ} heads is not a multiple of the cache's {HKV} kv heads")
    return rows, HQ, D, bs, HKV

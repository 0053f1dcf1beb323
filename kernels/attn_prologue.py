"""Fused attention prologue: (QK-norm) + RoPE on q and k + k/v write into the paged cache.

Between the QKV projection and attention an unfused layer runs two norms, two RoPEs (each a
handful of elementwise kernels) and a cache scatter. Here one program per (token, KV head) reads
its q heads (the GQA group), k and v rows once (strided views into the fused qkv output are
fine), normalises and rotates them in fp32, writes the rotated q to a new [T, Hq, D] tensor and
the rotated k and raw v straight into the cache slot. The rotated k is not returned: attention
reads it from the cache. (One program per token, all heads in it, left a batch-1 decode step
with one busy SM per layer on this latency-bound kernel.) Decode and uniform verify steps skip
this kernel: fused_decode_attention runs the same prologue inside the attention kernel, with
the Prologue, check_prologue and write_new_kv at the end of this file (and rope_rows, which
both kernels share).

RoPE is the rotate-half (GPT-NeoX) form used by HF Llama and Qwen3:
    out[:D/2] = x1 * cos - x2 * sin,   out[D/2:] = x2 * cos + x1 * sin,   x = [x1 | x2]
with cos/sin tables [max_pos, D/2] (fp32, see reference.rope_cos_sin).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl

from pdserve.kernels._triton import (
    FLOAT_DTYPES,
    check_head_dim,
    check_launchable,
    check_tensor,
    jit,
    next_pow2,
    pdl_enter,
    pdl_launch,
)
from pdserve.kernels.kv_quant import KVScales, cache_is_fp8
from pdserve.kernels.kv_write import (
    DYN_FACTOR,
    check_cache_pair,
    quantize_run,
    run_rows,
    to_e4m3_grid,
)

INDEX_DTYPES = (torch.int32, torch.int64)


@jit
def rope_rows(rows_ptr, d, mask, cos, sin, w_ptr, eps, HALF: tl.constexpr,
              NORM: tl.constexpr):
    """RoPE(RMSNorm(x)) in fp32 for rows x [G, D] at rows_ptr [G, 1] (+ d [1, D]); cos/sin
    [G, D] hold each row's cos/sin[d % HALF]. Rotate-half without splitting the row: out[d] =
    x[d] * cos - x[d + HALF] * sin for d < HALF, x[d] * cos + x[d - HALF] * sin after, with the
    partner read as a second (cached) load at the swapped offset."""
    swap = (d + HALF) % (2 * HALF)
    x = tl.load(rows_ptr + d, mask=mask, other=0.0).to(tl.float32)
    xs = tl.load(rows_ptr + swap, mask=mask, other=0.0).to(tl.float32)
    if NORM:  # Qwen3 QK-norm over the head dim, before RoPE
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / (2 * HALF) + eps)[:, None]
        x = x * rstd * tl.load(w_ptr + d).to(tl.float32)
        xs = xs * rstd * tl.load(w_ptr + swap).to(tl.float32)
    return x * cos + tl.where(d < HALF, -1.0, 1.0) * xs * sin


# T (the step's tokens) changes every step: not specialized, one compile (engine/exec/warmup.py)
@jit(do_not_specialize=["T"])
def _prologue_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, q_out_ptr,
                     kc_ptr, vc_ptr, slot_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                     stride_vt, stride_vh, stride_cos, stride_sin, stride_ot, stride_oh,
                     stride_kc_b, stride_kc_o, stride_kc_h, stride_vc_b, stride_vc_o, stride_vc_h,
                     ks_ptr, vs_ptr, stride_ks_b, stride_ks_h, stride_vs_b, stride_vs_h, T,
                     static_k, static_v, dyn_factor, GROUP, block_size, eps, HALF: tl.constexpr,
                     BLOCK_G: tl.constexpr, Q_NORM: tl.constexpr, K_NORM: tl.constexpr,
                     HAS_POS: tl.constexpr, FP8: tl.constexpr, BS: tl.constexpr,
                     USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)  # KV head g and its query heads g * GROUP .. (g + 1) * GROUP - 1
    if HAS_POS:  # cos/sin are tables indexed by position
        pos = tl.load(pos_ptr + t).to(tl.int64)
    else:  # cos/sin already hold one row per token
        pos = t
    d = tl.arange(0, 2 * HALF)[None, :]  # [1, D]
    cos = tl.load(cos_ptr + pos * stride_cos + d % HALF).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_sin + d % HALF).to(tl.float32)
    h = g * GROUP + tl.arange(0, BLOCK_G)[:, None]  # [BLOCK_G, 1] query heads of the group
    q_mask = (h < (g + 1) * GROUP) & (d < 2 * HALF)
    q = rope_rows(q_ptr + t * stride_qt + h * stride_qh, d, q_mask, cos, sin, qn_ptr, eps, HALF,
                  Q_NORM)
    tl.store(q_out_ptr + t * stride_ot + h * stride_oh + d, q, mask=q_mask)
    if FP8:  # the run's first token quantizes and writes the run (kv_write.py)
        _write_run_fp8(k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, kn_ptr, kc_ptr, vc_ptr, ks_ptr,
                       vs_ptr, slot_ptr, t, g, T, stride_kt, stride_kh, stride_vt, stride_vh,
                       stride_cos, stride_kc_b, stride_kc_o, stride_kc_h, stride_vc_b,
                       stride_vc_o, stride_vc_h, stride_ks_b, stride_ks_h, stride_vs_b,
                       stride_vs_h, static_k, static_v, dyn_factor, block_size, eps, HALF,
                       K_NORM, HAS_POS, BS)
        return
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # slot < 0: padding token, nothing to cache
        blk = slot // block_size
        off = slot % block_size
        k = rope_rows(k_ptr + t * stride_kt + g * stride_kh, d, d < 2 * HALF, cos, sin, kn_ptr,
                      eps, HALF, K_NORM)
        tl.store(kc_ptr + blk * stride_kc_b + off * stride_kc_o + g * stride_kc_h + d, k)
        v = tl.load(v_ptr + t * stride_vt + g * stride_vh + d)
        tl.store(vc_ptr + blk * stride_vc_b + off * stride_vc_o + g * stride_vc_h + d, v)


@jit
def _write_run_fp8(k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, kn_ptr, kc_ptr, vc_ptr, ks_ptr,
                   vs_ptr, slot_ptr, t, g, T, stride_kt, stride_kh, stride_vt, stride_vh,
                   stride_cos, stride_kc_b, stride_kc_o, stride_kc_h, stride_vc_b, stride_vc_o,
                   stride_vc_h, stride_ks_b, stride_ks_h, stride_vs_b, stride_vs_h, static_k,
                   static_v, dyn_factor, block_size, eps, HALF: tl.constexpr, K_NORM: tl.constexpr,
                   HAS_POS: tl.constexpr, BS: tl.constexpr):
    """KV head g of the run that token t leads (if it leads one): its rows' k normed and
    rotated, v, quantized to the block's scale (set here when the run starts the block)."""
    lead, blk, off, rows, ok = run_rows(slot_ptr, t, T, block_size, BS)
    if lead:
        d = tl.arange(0, 2 * HALF)[None, :]
        m = ok[:, None] & (d < 2 * HALF)  # [BS, D]
        if HAS_POS:
            pos = tl.load(pos_ptr + rows, mask=ok, other=0).to(tl.int64)
        else:
            pos = rows
        cs = pos[:, None] * stride_cos + d % HALF
        cos = tl.load(cos_ptr + cs, mask=m, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + cs, mask=m, other=0.0).to(tl.float32)
        k = rope_rows(k_ptr + rows[:, None] * stride_kt + g * stride_kh, d, m, cos, sin,
                      kn_ptr, eps, HALF, K_NORM)
        v = tl.load(v_ptr + rows[:, None] * stride_vt + g * stride_vh + d, mask=m,
                    other=0.0).to(tl.float32)
        ks = ks_ptr + blk * stride_ks_b + g * stride_ks_h  # scales [NB, Hkv], any strides
        vs = vs_ptr + blk * stride_vs_b + g * stride_vs_h
        kq, _ = quantize_run(k, m, off, ks, static_k, dyn_factor)
        vq, _ = quantize_run(v, m, off, vs, static_v, dyn_factor)
        o = off + (rows - t)[:, None]
        tl.store(kc_ptr + blk * stride_kc_b + o * stride_kc_o + g * stride_kc_h + d,
                 kq.to(kc_ptr.dtype.element_ty), mask=m)
        tl.store(vc_ptr + blk * stride_vc_b + o * stride_vc_o + g * stride_vc_h + d,
                 vq.to(vc_ptr.dtype.element_ty), mask=m)


def _check_rope_args(q: torch.Tensor, positions: torch.Tensor | None, cos: torch.Tensor,
                     sin: torch.Tensor, q_norm: torch.Tensor | None,
                     k_norm: torch.Tensor | None) -> None:
    T, _, D = q.shape
    if positions is not None:
        check_tensor("positions", positions, shape=(T,), dtypes=INDEX_DTYPES, device=q.device)
    rows = None if positions is not None else T
    for name, table in (("cos", cos), ("sin", sin)):
        check_tensor(name, table, shape=(rows, D // 2), dtypes=FLOAT_DTYPES, device=q.device,
                     last_contiguous=True)
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if w is not None:
            check_tensor(name, w, shape=(D,), dtypes=FLOAT_DTYPES, device=q.device,
                         last_contiguous=True)


def fused_qk_norm_rope_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          positions: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, q_norm: torch.Tensor | None = None,
                          k_norm: torch.Tensor | None = None, eps: float = 1e-6,
                          kv_scales: KVScales | None = None) -> torch.Tensor:
    """RoPE (after optional per-head RMSNorm) on q [T, Hq, D] and k [T, Hkv, D]; rotated k and
    v [T, Hkv, D] go into k_cache/v_cache [NB, BS, Hkv, D] at slot_mapping [T] (block * BS +
    offset; < 0 skips the token). positions [T] index cos/sin tables [max_pos, D/2] (positions
    must be < max_pos, not checked on device); with positions=None, cos/sin are per-token rows
    [T, D/2] (what pdserve.engine.model.layers.RotaryEmbedding.cos_sin returns). Returns the rotated q as a
    new contiguous tensor.
    q/k/v may be strided views (head dim contiguous), e.g. of one fused qkv projection.
    An fp8 cache takes its kv_scales: k/v are quantized in this kernel (the program of each
    run's first token writes the run: kernels/kv_quant.py has the rule and the reference).
    """
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES, last_contiguous=True)
    check_launchable("q", q)
    T, HQ, D = q.shape
    check_head_dim("q", D)
    check_tensor("k", k, shape=(T, None, D), dtypes=(q.dtype,), device=q.device,
                 last_contiguous=True)
    HKV = k.shape[1]
    check_tensor("v", v, shape=(T, HKV, D), dtypes=(q.dtype,), device=q.device,
                 last_contiguous=True)
    check_cache_pair(k_cache, v_cache, HKV, D, q.device)
    check_tensor("slot_mapping", slot_mapping, shape=(T,), dtypes=INDEX_DTYPES, device=q.device)
    _check_rope_args(q, positions, cos, sin, q_norm, k_norm)
    q_out = torch.empty((T, HQ, D), dtype=q.dtype, device=q.device)
    if T == 0:
        return q_out
    if HQ % HKV:
        raise ValueError(f"q: {HQ} heads are not a multiple of k's {HKV} (GQA groups)")
    fp8 = cache_is_fp8(k_cache, kv_scales)
    sc = kv_scales if fp8 else KVScales(q, q)  # placeholders: the kernel never reads them
    _prologue_kernel[(T, HKV)](
        q, k, v, q if positions is None else positions, cos, sin, q if q_norm is None else q_norm,
        q if k_norm is None else k_norm, q_out, k_cache, v_cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0), q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), sc.k, sc.v, sc.k.stride(0),
        sc.k.stride(1), sc.v.stride(0), sc.v.stride(1), T, float(sc.static_k), float(sc.static_v), DYN_FACTOR,
        HQ // HKV, k_cache.shape[1], float(eps), HALF=D // 2, BLOCK_G=next_pow2(HQ // HKV),
        Q_NORM=q_norm is not None, K_NORM=k_norm is not None,
        HAS_POS=positions is not None, FP8=fp8, BS=k_cache.shape[1], num_warps=4,
        **pdl_launch(q))
    return q_out


# -- the prologue inside decode attention (kernels/decode_attention.py; rope_rows above) ----

@dataclass(frozen=True)
class Prologue:
    """What fused_decode_attention does before attending (this module's job, done inside the
    attention kernel with the helpers below): the new tokens' k [T, Hkv, D] and v [T, Hkv, D]
    (strided views of the qkv projection are fine), their RoPE cos/sin (fp32): per-token rows
    [T, D/2] (engine.model.layers.RotaryEmbedding.cos_sin), or with positions [T] tables
    [max_pos, D/2] that the kernel indexes (RotaryEmbedding.tables: no gather kernel per
    forward); cache slots slot_mapping [T] (< 0: padding, not written), optional QK-norm
    weights [D] and eps."""

    k: torch.Tensor
    v: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slot_mapping: torch.Tensor
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    eps: float = 1e-6
    positions: torch.Tensor | None = None


def check_prologue(q: torch.Tensor, p: Prologue, num_kv_heads: int) -> None:
    T, _, D = q.shape
    for name in ("k", "v"):
        check_tensor(name, getattr(p, name), shape=(T, num_kv_heads, D), dtypes=(q.dtype,),
                     device=q.device, last_contiguous=True)
    rows = None if p.positions is not None else T  # tables: any number of positions
    for name in ("cos", "sin"):
        check_tensor(name, getattr(p, name), shape=(rows, D // 2), dtypes=FLOAT_DTYPES,
                     device=q.device, last_contiguous=True)
    if p.positions is not None:
        check_tensor("positions", p.positions, shape=(T,), dtypes=INDEX_DTYPES, device=q.device)
    if p.cos.stride(0) != p.sin.stride(0):
        raise ValueError(f"sin: row stride {p.sin.stride(0)} differs from cos's {p.cos.stride(0)}")
    check_tensor("slot_mapping", p.slot_mapping, shape=(T,), dtypes=(torch.int32, torch.int64),
                 device=q.device)
    for name in ("q_norm", "k_norm"):
        w = getattr(p, name)
        if w is not None:
            check_tensor(name, w, shape=(D,), dtypes=FLOAT_DTYPES, device=q.device,
                         last_contiguous=True)
    if not p.eps > 0:
        raise ValueError(f"eps: must be > 0, got {p.eps}")


@jit
def write_new_kv(k_ptr, v_ptr, cos_ptr, sin_ptr, kn_ptr, slots, rope_rows_r, kc_ptr, vc_ptr,
                  k_first,
                  v_first, n_first, b, kvh, seq_len, start, end, stride_kt, stride_kh,
                  stride_vt, stride_vh, stride_cs,
                  stride_kc_b, stride_kc_o, stride_kc_h, stride_vc_b, stride_vc_o, stride_vc_h,
                  block_size, eps, R: tl.constexpr, RP: tl.constexpr, HALF: tl.constexpr,
                  K_NORM: tl.constexpr, PATCH: tl.constexpr):
    """The prologue's cache write: this KV head's k (normed, rotated) and v of the sequence's
    R new tokens at positions seq_len - R + r, for those inside this split's keys [start,
    end). The splits partition the context, so each new token is written once, by the one
    program that reads it back. slots [RP]: the R tokens' cache slots (< 0: padding);
    rope_rows_r [RP]: their rows of cos/sin (positions into tables, or token indices). Loads
    are masked rather than branched on, so they issue together with the q loads. Returns the
    split's first tile of keys/values k_first/v_first [BLOCK_N, D] (loaded before the PDL wait,
    positions n_first) with the new tokens' rows put in (PATCH; else returned as given)."""
    d = tl.arange(0, 2 * HALF)[None, :]  # [1, D]
    r_idx = tl.arange(0, RP)
    for r in tl.static_range(R):
        t = b * R + r
        pos = seq_len - R + r
        slot = tl.sum(tl.where(r_idx == r, slots, 0))
        mask = (d < 2 * HALF) & (pos >= start) & (pos < end) & (slot >= 0)
        cs = tl.sum(tl.where(r_idx == r, rope_rows_r, 0)) * stride_cs + d % HALF
        c = tl.load(cos_ptr + cs, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + cs, mask=mask, other=0.0).to(tl.float32)
        k = rope_rows(k_ptr + t * stride_kt + kvh * stride_kh, d, mask, c, s, kn_ptr, eps,
                       HALF, K_NORM)
        k = k.to(kc_ptr.dtype.element_ty)
        # in the cache's type: v may come in fp32 (kernels/fp8_gemv_tc.py's output)
        v = tl.load(v_ptr + t * stride_vt + kvh * stride_vh + d, mask=mask
                    ).to(vc_ptr.dtype.element_ty)
        slot = tl.maximum(slot, 0)
        blk = slot // block_size
        off = slot % block_size
        tl.store(kc_ptr + blk * stride_kc_b + off * stride_kc_o + kvh * stride_kc_h + d, k,
                 mask=mask)
        tl.store(vc_ptr + blk * stride_vc_b + off * stride_vc_o + kvh * stride_vc_h + d, v,
                 mask=mask)
        if PATCH:
            hit = (n_first == pos)[:, None] & mask  # the token's row in the prefetched tile
            k_first = tl.where(hit, k, k_first)
            v_first = tl.where(hit, v, v_first)
    return k_first, v_first


@jit
def write_new_kv_fp8(k_ptr, v_ptr, cos_ptr, sin_ptr, kn_ptr, slots, rope_rows_r, kc_ptr,
                     vc_ptr, ks_ptr, vs_ptr, k_first, v_first, n_first, b, kvh, seq_len, start,
                     end, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_kc_b,
                     stride_kc_o, stride_kc_h, stride_vc_b, stride_vc_o, stride_vc_h,
                     stride_ks_b, stride_ks_h, stride_vs_b, stride_vs_h, static_k, static_v,
                     dyn_factor, block_size, eps, R: tl.constexpr, RP: tl.constexpr,
                     HALF: tl.constexpr, K_NORM: tl.constexpr, PATCH: tl.constexpr):
    """write_new_kv for an fp8 cache: the R new rows [RP, D] at once, quantized by the
    kv_quant rule. A row's run is the new rows in its block; every program computes the
    same run amax and freshness from all R rows (not only its split's), so when a fresh
    block's rows fall in two splits both store the same scale. Each program writes the rows
    inside its keys [start, end) and patches them into its prefetched tile."""
    d = tl.arange(0, 2 * HALF)[None, :]  # [1, D]
    r_idx = tl.arange(0, RP)
    pos = seq_len - R + r_idx
    valid = (r_idx < R) & (slots >= 0)
    mine = valid & (pos >= start) & (pos < end)
    m = valid[:, None] & (d < 2 * HALF)  # [RP, D]
    t = (b * R + r_idx)[:, None]
    cs = rope_rows_r[:, None] * stride_cs + d % HALF
    c = tl.load(cos_ptr + cs, mask=m, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + cs, mask=m, other=0.0).to(tl.float32)
    k = rope_rows(k_ptr + t * stride_kt + kvh * stride_kh, d, m, c, s, kn_ptr, eps, HALF,
                  K_NORM)
    v = tl.load(v_ptr + t * stride_vt + kvh * stride_vh + d, mask=m, other=0.0).to(tl.float32)
    slot = tl.maximum(slots, 0)
    blk = slot // block_size
    off = slot % block_size
    same = (blk[:, None] == blk[None, :]) & valid[None, :]  # [RP, RP]: row r' in r's run
    first = tl.min(tl.where(same, off[None, :], block_size), axis=1) == 0
    ks = ks_ptr + blk * stride_ks_b + kvh * stride_ks_h  # [RP] scale addresses, any strides
    vs = vs_ptr + blk * stride_vs_b + kvh * stride_vs_h
    kq = _quantize_rows(k, m, same, first, valid, mine, ks, static_k, dyn_factor)
    vq = _quantize_rows(v, m, same, first, valid, mine, vs, static_v, dyn_factor)
    kq = kq.to(kc_ptr.dtype.element_ty)
    vq = vq.to(vc_ptr.dtype.element_ty)
    wm = mine[:, None] & (d < 2 * HALF)
    o = off[:, None]
    tl.store(kc_ptr + blk[:, None] * stride_kc_b + o * stride_kc_o + kvh * stride_kc_h + d, kq,
             mask=wm)
    tl.store(vc_ptr + blk[:, None] * stride_vc_b + o * stride_vc_o + kvh * stride_vc_h + d, vq,
             mask=wm)
    if PATCH:  # the new rows into the prefetched tile [BLOCK_N, D]
        for r in tl.static_range(R):
            sel = (r_idx == r)[:, None]
            k_r = tl.sum(tl.where(sel, kq.to(tl.float32), 0.0), axis=0)[None, :]
            v_r = tl.sum(tl.where(sel, vq.to(tl.float32), 0.0), axis=0)[None, :]
            hit = ((n_first == seq_len - R + r) & (tl.sum(tl.where(r_idx == r, mine, 0)) > 0))
            k_first = tl.where(hit[:, None], k_r.to(k_first.dtype), k_first)
            v_first = tl.where(hit[:, None], v_r.to(v_first.dtype), v_first)
    return k_first, v_first


@jit
def _quantize_rows(x, m, same, first, valid, mine, sc_ptrs, static, dyn_factor):
    """Rows x [RP, D] fp32 with their runs (same [RP, RP]; first: the run starts its block)
    and scale addresses sc_ptrs [RP] -> x / scale clamped, on e4m3's grid (fp32)."""
    row_amax = tl.max(tl.where(m, tl.abs(x), 0.0), axis=1)  # [RP]
    run_amax = tl.max(tl.where(same, row_amax[None, :], 0.0), axis=1)
    stored = tl.load(sc_ptrs, mask=valid, other=1.0)
    fresh = first | (stored <= 0.0)
    new = tl.where(static > 0.0, static, tl.maximum(run_amax, 1e-6) * dyn_factor)
    scale = tl.where(fresh, new, stored)
    tl.store(sc_ptrs, scale, mask=mine & fresh)
    q = tl.math.div_rn(x, scale[:, None] + tl.zeros_like(x))
    return to_e4m3_grid(tl.clamp(q, -448.0, 448.0))

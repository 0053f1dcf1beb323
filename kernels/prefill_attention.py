"""Chunked-prefill attention over the paged KV cache: causal, varlen, GQA-grouped, flash-style.

Sequence b brings q_len new tokens (rows query_start_loc[b]:query_start_loc[b+1] of q) on top
of ctx = seq_len - q_len tokens already cached (prefix cache hits, earlier chunks); its new K/V
are in the cache too. New token i sits at position ctx + i and sees keys 0..ctx + i. A q_len of
1 is a decode, so one launch serves a mixed prefill + decode step.

Tiling (FlashAttention-2 style, online softmax, tl.dot on both matmuls): one program owns
BLOCK_Q consecutive query tokens x the G query heads of one KV head, flattened into BLOCK_M =
BLOCK_Q * G_PAD rows (row m = token m // G_PAD, head m % G_PAD). Each K/V tile is loaded once
per KV head and serves all G heads. Keys below the tile's first query position need no mask and
run in a mask-free loop; only the diagonal band pays for masking.

Programs map to (sequence, query tile) without a host sync: tile ids are laid out so sequence b
owns ids [qsl[b] // BLOCK_Q + b, qsl[b+1] // BLOCK_Q + b + 1) -- at least cdiv(q_len, BLOCK_Q)
of them -- and each program binary-searches query_start_loc for its sequence. The grid is
T // BLOCK_Q + B tiles; the few spare ids exit at once.
"""
from __future__ import annotations

import math

import torch
import triton.language as tl

from pdserve.kernels._triton import (
    check_tensor,
    dot_dtype,
    dot_precision,
    interpreting,
    jit,
    next_pow2,
)
from pdserve.kernels.kv_quant import KVScales, cache_is_fp8
from pdserve.kernels.kv_write import check_q_and_cache

LOG2E = 1.4426950408889634


@jit
def _attend_tile(q, m_i, l_i, acc, k_base, v_base, ks_base, vs_base, bt_row, n0, kv_end, pos,
                 block_size, stride_kc_b, stride_kc_o, stride_vc_b, stride_vc_o, stride_ks_b,
                 stride_vs_b, scale_log2, D: tl.constexpr, BLOCK_N: tl.constexpr,
                 MASKED: tl.constexpr, PREC: tl.constexpr, DOT_DTYPE: tl.constexpr,
                 FP8: tl.constexpr):
    """One K/V tile of the online softmax. q [BLOCK_M, D]; pos [BLOCK_M] query positions. An
    fp8 tile's per-key scales (its blocks') scale the score columns and the weights."""
    n = n0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    blk = tl.load(bt_row + n // block_size, mask=n < kv_end, other=0).to(tl.int64)
    off = n % block_size
    k_ptrs = k_base + blk[:, None] * stride_kc_b + off[:, None] * stride_kc_o + d[None, :]
    v_ptrs = v_base + blk[:, None] * stride_vc_b + off[:, None] * stride_vc_o + d[None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=(n < kv_end)[:, None], other=0.0).to(DOT_DTYPE)
    else:
        k = tl.load(k_ptrs).to(DOT_DTYPE)
    s = tl.dot(q, tl.trans(k), input_precision=PREC)  # [BLOCK_M, BLOCK_N], unscaled
    if FP8:
        ks = tl.load(ks_base + blk * stride_ks_b, mask=n < kv_end, other=0.0)
        vs = tl.load(vs_base + blk * stride_vs_b, mask=n < kv_end, other=0.0)
        s = s * ks[None, :]
    if MASKED:
        visible = (n[None, :] <= pos[:, None]) & (n[None, :] < kv_end)
        s = tl.where(visible, s, float("-inf"))
    # The scale rides in one FMA with the max subtraction (exp2 domain: scale_log2 has log2 e).
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale_log2)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * scale_log2 - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if FP8:
        p = p * vs[None, :]
    if MASKED:
        v = tl.load(v_ptrs, mask=(n < kv_end)[:, None], other=0.0).to(DOT_DTYPE)
    else:
        v = tl.load(v_ptrs).to(DOT_DTYPE)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PREC)
    return m_new, l_i, acc


@jit
def _find_sequence(qsl_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest b with qsl[b] // BLOCK_Q + b <= tile (that expression is increasing in b)."""
    lo = tile * 0  # tensors from the start: loop-carried values keep one type
    hi = lo + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        ok = tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= tile
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo


# num_seqs and the block table's width change from step to step: specialized (== 1, % 16)
# they made up to 9 compiles of each tile class in served steps (engine/exec/warmup.py)
@jit(do_not_specialize=["num_seqs", "stride_bt"])
def _prefill_kernel(q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_ptr, qsl_ptr, seq_lens_ptr,
                    out_ptr, stride_qt, stride_qh, stride_kc_b, stride_kc_o, stride_kc_h,
                    stride_vc_b, stride_vc_o, stride_vc_h, stride_ks_b, stride_ks_h,
                    stride_vs_b, stride_vs_h, stride_bt,
                    stride_ot, stride_oh, scale_log2, block_size, num_seqs,
                    GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                    BLOCK_M: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                    PREC: tl.constexpr, DOT_DTYPE: tl.constexpr, FP8: tl.constexpr):
    # Causal tiles late in a sequence do the most work: hand them out first, so the light
    # ones fill the tail of the launch.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kvh = tl.program_id(1)
    b = _find_sequence(qsl_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    q_tile = tile - (q_start // BLOCK_Q + b)
    if q_tile * BLOCK_Q < q_len:  # else a spare tile id: nothing to do
        m = tl.arange(0, BLOCK_M)
        d = tl.arange(0, D)
        q_idx = q_tile * BLOCK_Q + m // G_PAD  # token within the sequence's new tokens
        g = m % G_PAD
        row_ok = (q_idx < q_len) & (g < GROUP)
        heads = kvh * GROUP + g
        rows = (q_start + q_idx).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None], other=0.0).to(DOT_DTYPE)
        seq_len = tl.load(seq_lens_ptr + b)
        ctx = seq_len - q_len
        pos = ctx + q_idx
        kv_end = ctx + tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, q_len)  # last row's key + 1
        full_end = (ctx + q_tile * BLOCK_Q) // BLOCK_N * BLOCK_N  # keys every row sees
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        kvh_64 = kvh.to(tl.int64)  # heads-outer caches: a head stride of a whole head region
        k_base = kc_ptr + kvh_64 * stride_kc_h
        v_base = vc_ptr + kvh_64 * stride_vc_h
        bt_row = bt_ptr + b.to(tl.int64) * stride_bt
        ks_base = ks_ptr + kvh_64 * stride_ks_h  # scales [NB, Hkv] at any strides
        vs_base = vs_ptr + kvh_64 * stride_vs_h
        for n0 in range(0, full_end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_base, v_base, ks_base, vs_base,
                                         bt_row, n0, kv_end, pos, block_size, stride_kc_b,
                                         stride_kc_o, stride_vc_b, stride_vc_o, stride_ks_b,
                                         stride_vs_b, scale_log2, D, BLOCK_N, False, PREC,
                                         DOT_DTYPE, FP8)
        for n0 in range(full_end, kv_end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_base, v_base, ks_base, vs_base,
                                         bt_row, n0, kv_end, pos, block_size, stride_kc_b,
                                         stride_kc_o, stride_vc_b, stride_vc_o, stride_ks_b,
                                         stride_vs_b, scale_log2, D, BLOCK_N, True, PREC,
                                         DOT_DTYPE, FP8)
        # Every valid row saw key 0..pos (>= 1 key), so l_i > 0 there; padded rows are dropped.
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 o, mask=row_ok[:, None])


def _tile_config(dtype: torch.dtype, head_dim: int, group: int,
                 max_query_len: int) -> tuple[int, int, int, int]:
    """(BLOCK_Q, BLOCK_N, num_warps, num_stages). Swept on an H200 (bf16, D=128, GQA 4,
    1K-10K prompts): 256-row tiles x 64 keys with 16 warps and 3 stages won (410 TFLOP/s at
    10K vs 342 for 128 rows); 128-key tiles spilled. fp32 and D=256 need twice the registers
    and shared memory per row, so they get 64 x 32 tiles (fp32 is for tests, not speed).
    Short queries (decode rows, MTP verify) shrink BLOCK_Q so rows are not wasted, keeping
    BLOCK_M = BLOCK_Q * G_PAD >= 16 for tl.dot."""
    g_pad = next_pow2(group)
    big = dtype != torch.float32 and head_dim <= 128
    block_m = 256 if big else 64
    block_q = min(max(1, block_m // g_pad), next_pow2(max(1, max_query_len)))
    block_q = max(block_q, max(1, 16 // g_pad))
    num_warps = 16 if block_q * g_pad >= 256 else 4
    return block_q, 64 if big else 32, num_warps, 3 if big else 2


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            block_tables: torch.Tensor, max_query_len: int,
                            scale: float, kv_scales: KVScales | None = None) -> torch.Tensor:
    """Causal attention for varlen new tokens q [T, Hq, D] over their cached context.

    query_start_loc [B+1] int32 (cumulative new-token counts, starting at 0, ending at T);
    seq_lens [B] int32 (context after this step, >= each query length); block_tables
    [B, max_blocks] int32; k_cache/v_cache [NB, BS, Hkv, D] strided layer views of q.dtype
    that already hold this step's K/V (or fp8 views with their kv_scales, kernels/kv_quant.py).
    max_query_len (host int) only sizes the tiles.
    Returns a new [T, Hq, D] tensor.
    """
    T, HQ, D, bs, HKV = check_q_and_cache(q, k_cache, v_cache)
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=(torch.int32,),
                 device=q.device)
    B = query_start_loc.shape[0] - 1
    if B < 1:
        raise ValueError("query_start_loc: needs at least 2 entries ([0, T] for one sequence)")
    check_tensor("seq_lens", seq_lens, shape=(B,), dtypes=(torch.int32,), device=q.device)
    check_tensor("block_tables", block_tables, shape=(B, None), dtypes=(torch.int32,),
                 device=q.device)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale: must be a positive finite number, got {scale}")
    if max_query_len < 1 or max_query_len > max(T, 1):
        raise ValueError(f"max_query_len: {max_query_len} not in [1, T={T}]")
    fp8 = cache_is_fp8(k_cache, kv_scales)
    sc = kv_scales if fp8 else KVScales(q, q)  # placeholders: never read without FP8
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if T == 0:
        return out
    group = HQ // HKV
    block_q, block_n, num_warps, num_stages = _tile_config(q.dtype, D, group, max_query_len)
    grid = (T // block_q + B, HKV)
    _prefill_kernel[grid](
        q, k_cache, v_cache, sc.k, sc.v, block_tables, query_start_loc, seq_lens, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), sc.k.stride(0),
        sc.k.stride(1), sc.v.stride(0), sc.v.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1), float(scale) * LOG2E, bs, B,
        GROUP=group, G_PAD=next_pow2(group), BLOCK_Q=block_q,
        BLOCK_M=block_q * next_pow2(group), D=D, BLOCK_N=block_n,
        PREC=dot_precision(q.dtype), DOT_DTYPE=dot_dtype(q.dtype), FP8=fp8,
        num_warps=num_warps,
        num_stages=1 if interpreting() else num_stages)
    return out

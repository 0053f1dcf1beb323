"""Paged decode attention: one query token per sequence, GQA-aware, split-K (flash-decoding).

Decode is bound by reading the KV cache. Two choices keep it at bandwidth:
- GQA grouping: one program serves all G = Hq / Hkv query heads of a KV head, so each KV tile
  is read once, and the G query rows (padded to 16 for tl.dot) share it.
- Split-K: with batch 1 and 8 KV heads there are only 8 (sequence, KV head) pairs -- far fewer
  than the H100's 132 SMs. The context is cut into num_splits partitions, each program
  produces a partial output and its log-sum-exp, and a small reduce kernel merges them.
num_splits is fixed per launch from host shapes (never read from device data), and each program
derives its key range from seq_lens on the device, so the launch is CUDA-graph safe.

Several query rows per sequence (rows_per_seq = R, an MTP verify step: the last token + R - 1
drafts) ride in the same programs: row r of sequence b is the token at position
seq_len - R + r and sees keys < seq_len - R + 1 + r (causal). R * G query rows share each KV
tile in the padded tl.dot (G = 4, R <= 4 fits the 16 rows a GQA program already computes), so
a verify step reads the context once, split-K across the GPU, instead of taking the
chunked-prefill kernel's few programs per sequence.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels._triton import (check_tensor, dot_dtype, dot_precision, interpreting, jit, next_pow2,
                             num_sms, pdl_enter, pdl_launch)
from kernels.kv_write import check_q_and_cache

LOG2E = 1.4426950408889634
MAX_SPLITS = 64
MAX_GROUP_ROWS = 64  # rows_per_seq * (Hq / Hkv) query rows per program at most


@jit
def _decode_split_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, seq_lens_ptr, out_ptr, mid_o_ptr,
                         mid_lse_ptr, stride_qb, stride_qh, stride_kc_b, stride_kc_o, stride_kc_h,
                         stride_vc_b, stride_vc_o, stride_vc_h, stride_bt, stride_ob, stride_oh,
                         scale_log2, block_size, HQ, num_splits, GROUP: tl.constexpr,
                         R: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                         BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, PREC: tl.constexpr,
                         DOT_DTYPE: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    # This split's keys [start, end): whole BLOCK_N tiles, so no tile straddles two splits.
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), num_splits)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)

    g = tl.arange(0, BLOCK_G)  # program row g: query row g // GROUP, head g % GROUP of the group
    d = tl.arange(0, D)
    row_ok = g < R * GROUP
    qrow = b * R + g // GROUP  # [BLOCK_G] row of q / out
    heads = kvh * GROUP + g % GROUP  # the query heads that share this KV head
    visible = seq_len - (R - 1) + g // GROUP  # causal: keys < visible for each program row
    q = tl.load(q_ptr + qrow[:, None] * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0).to(DOT_DTYPE)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, D], dtype=tl.float32)
    k_base = kc_ptr + kvh * stride_kc_h
    v_base = vc_ptr + kvh * stride_vc_h
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        valid = n < end
        # Block ids are int32 in the table; widen before the (huge) block stride.
        blk = tl.load(bt_ptr + b * stride_bt + n // block_size, mask=valid, other=0).to(tl.int64)
        off = n % block_size
        k = tl.load(k_base + blk[:, None] * stride_kc_b + off[:, None] * stride_kc_o + d[None, :],
                    mask=valid[:, None], other=0.0).to(DOT_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2  # [BLOCK_G, BLOCK_N]
        if R == 1:
            s = tl.where(valid[None, :], s, float("-inf"))
        else:
            s = tl.where(n[None, :] < visible[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        if R > 1:  # a row may have seen no key yet (this split's keys are its future)
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_ref = m_new
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + blk[:, None] * stride_vc_b + off[:, None] * stride_vc_o + d[None, :],
                    mask=valid[:, None], other=0.0).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PREC)
        m_i = m_new

    has_keys = l_i > 0.0  # false only for an empty split (or a padded seq_len-0 entry)
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if DIRECT:  # one split: its result is final
        tl.store(out_ptr + qrow[:, None] * stride_ob + heads[:, None] * stride_oh + d[None, :], o,
                 mask=row_ok[:, None])
    elif start < end:  # an empty split stores nothing: the reduce reads the active ones
        row = (qrow * HQ + heads) * num_splits + split  # mid_* are [B * R, Hq, num_splits(, D)]
        tl.store(mid_o_ptr + row[:, None] * D + d[None, :], o, mask=row_ok[:, None])
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(mid_lse_ptr + row, lse, mask=row_ok)


@jit
def _decode_reduce_kernel(mid_o_ptr, mid_lse_ptr, seq_lens_ptr, out_ptr, stride_ob, stride_oh,
                          HQ, num_splits, R: tl.constexpr, BLOCK_S: tl.constexpr,
                          D: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    r = tl.program_id(0).to(tl.int64)  # query row; its sequence is r // R
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, D)
    # the splits that had keys, as the split kernel cut them: at a short context most of
    # num_splits (fixed for the CUDA graph by max_model_len) are empty and wrote nothing
    tiles = tl.cdiv(tl.load(seq_lens_ptr + r // R), BLOCK_N)
    per_split = tl.maximum(tl.cdiv(tiles, num_splits), 1)
    active = s < tl.cdiv(tiles, per_split)
    row = (r * HQ + h) * num_splits + s
    lse = tl.load(mid_lse_ptr + row, mask=active, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty: weights 0, output 0
    w = tl.exp2(lse - m)
    o = tl.load(mid_o_ptr + row[:, None] * D + d[None, :], mask=active[:, None], other=0.0)
    total = tl.sum(w, axis=0)
    res = tl.sum(o * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + r * stride_ob + h * stride_oh + d, res)


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, block_n: int,
                      device: torch.device) -> int:
    """Enough (sequence, KV head, split) programs for ~4 waves on the GPU (measured best on
    an H200 for batch 1 and 8), never more splits than key tiles. A power of 2 computed from
    host shapes only: a CUDA graph replays the same choice, and few distinct values reach
    the reduce kernel's BLOCK_S specialisation."""
    if device.type == "cuda":
        sms = num_sms(torch.cuda.current_device() if device.index is None else device.index)
    else:
        sms = 8  # interpreter: the choice only has to be valid
    want = triton.cdiv(4 * sms, max(1, batch * num_kv_heads))
    tiles = triton.cdiv(max(1, max_context), block_n)
    n = max(1, min(want, tiles, MAX_SPLITS))
    return 1 << (n.bit_length() - 1)


def _tile_config(dtype: torch.dtype, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages). 64-key tiles at bf16/D=128 (32 KB of K+V per
    step); fp32 and D=256 halve the tile. Swept on an H200 (batch 1-8, 2K-10K contexts):
    2 stages beat 3-4 by up to 20% -- the many split programs already keep loads in flight."""
    block_n = 64 if dtype != torch.float32 and head_dim <= 128 else 32
    return block_n, 4, 2


def _check_decode_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_tables: torch.Tensor, seq_lens: torch.Tensor,
                       scale: float, rows_per_seq: int = 1) -> tuple[int, int]:
    """Returns (block_size, Hkv)."""
    T, HQ, D, bs, HKV = check_q_and_cache(q, k_cache, v_cache)
    if not isinstance(rows_per_seq, int) or rows_per_seq < 1 or T % rows_per_seq:
        raise ValueError(f"rows_per_seq: {rows_per_seq!r} must be an int >= 1 dividing q's "
                         f"{T} rows")
    if rows_per_seq * (HQ // HKV) > MAX_GROUP_ROWS:
        raise ValueError(f"rows_per_seq: {rows_per_seq} rows x {HQ // HKV} query heads per KV "
                         f"head exceeds {MAX_GROUP_ROWS} rows per program")
    B = T // rows_per_seq
    check_tensor("block_tables", block_tables, shape=(B, None), dtypes=(torch.int32,),
                 device=q.device)
    check_tensor("seq_lens", seq_lens, shape=(B,), dtypes=(torch.int32,), device=q.device)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale: must be a positive finite number, got {scale}")
    return bs, HKV


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           num_splits: int | None = None,
                           max_seq_len: int | None = None, rows_per_seq: int = 1) -> torch.Tensor:
    """out [B, Hq, D] = softmax(q k^T * scale) v over each sequence's seq_lens[b] cached keys.

    q [B * R, Hq, D] (R = rows_per_seq tokens per sequence, the last R of its seq_lens[b],
    each attending causally; R = 1 for decode; any strides, head dim contiguous); k_cache/v_cache
    [NB, BS, Hkv, D] strided layer views of q.dtype; block_tables [B, max_blocks] int32;
    seq_lens [B] int32 (0 gives a zero row, for padded CUDA-graph batches). num_splits
    defaults to choose_num_splits(B, Hkv, max_seq_len or the block table's capacity); pass
    it (or keep the table width fixed) to keep one choice across CUDA-graph replays.
    """
    bs, HKV = _check_decode_args(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                 rows_per_seq)
    T, HQ, D = q.shape
    R, B = rows_per_seq, T // rows_per_seq
    out = torch.empty((T, HQ, D), dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    block_n, num_warps, num_stages = _tile_config(q.dtype, D)
    if num_splits is None:
        context = max_seq_len or block_tables.shape[1] * bs
        num_splits = choose_num_splits(B, HKV, context, block_n, q.device)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits: {num_splits} not in [1, {MAX_SPLITS}]")
    group = HQ // HKV
    mid_o = mid_lse = out  # unused when one split writes `out` directly
    if num_splits > 1:
        mid_o = torch.empty((T, HQ, num_splits, D), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((T, HQ, num_splits), dtype=torch.float32, device=q.device)
    _decode_split_kernel[(B, HKV, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, mid_o, mid_lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), float(scale) * LOG2E, bs, HQ, num_splits,
        GROUP=group, R=R, BLOCK_G=max(16, next_pow2(R * group)), D=D, BLOCK_N=block_n,
        DIRECT=num_splits == 1, PREC=dot_precision(q.dtype), DOT_DTYPE=dot_dtype(q.dtype),
        num_warps=num_warps, num_stages=1 if interpreting() else num_stages, **pdl_launch(q))
    if num_splits > 1:
        _decode_reduce_kernel[(T, HQ)](
            mid_o, mid_lse, seq_lens, out, out.stride(0), out.stride(1), HQ, num_splits,
            R=R, BLOCK_S=next_pow2(num_splits), D=D, BLOCK_N=block_n, num_warps=4, **pdl_launch(q))
    return out

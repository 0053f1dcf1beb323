"""Paged decode attention: one query token per sequence, GQA-aware, split-K (flash-decoding).

Decode is bound by reading the KV cache. Two choices keep it at bandwidth:
- GQA grouping: one program serves all G = Hq / Hkv query heads of a KV head, so each KV tile
  is read once, and the G query rows (padded to 16 for tl.dot) share it.
- Split-K: with batch 1 and 8 KV heads there are only 8 (sequence, KV head) pairs -- far fewer
  than the H100's 132 SMs. The context is cut into num_splits partitions; each program
  stores a partial output and its log-sum-exp, then bumps an arrival counter, and the last
  program of a (sequence, KV head) to arrive merges the partials (no reduce kernel: at batch
  1 its launch cost ~4 us per layer). A context that fits one split is stored directly.
num_splits is fixed per launch from host shapes (never read from device data), and each program
derives its key range from seq_lens on the device, so the launch is CUDA-graph safe.

fused_decode_attention also takes over the attention prologue (QK-norm + RoPE + k/v cache
write, kernels/attn_prologue.py): each program normalises and rotates its q rows itself, and
the program whose keys include a new token writes that token's k/v before reading it. A
batch-1 decode layer's attention is then one kernel, where it was three. Its RoPE rows are
per-token cos/sin [T, D/2], or (Prologue.positions) the whole tables [max_pos, D/2], which it
indexes by each token's position, loaded before the PDL wait: the forward then needs no
gather kernel for them (engine Model.rope).

Several query rows per sequence (rows_per_seq = R, an MTP verify step: the last token + R - 1
drafts) ride in the same programs: row r of sequence b is the token at position
seq_len - R + r and sees keys < seq_len - R + 1 + r (causal). R * G query rows share each KV
tile in the padded tl.dot (G = 4, R <= 4 fits the 16 rows a GQA program already computes), so
a verify step reads the context once, split-K across the GPU, instead of taking the
chunked-prefill kernel's few programs per sequence.

The per-tile device code (tile loads, the online-softmax step, the split merge) and how an
FP8 cache's tiles become fp16 tl.dot operands are in kernels/decode_attention_tiles.py; the
launch shape (DecodeTiles) is chosen here by the cache's dtype.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton.language as tl

from pdserve.kernels._triton import (
    arrival_counters,
    check_tensor,
    dot_dtype,
    dot_precision,
    interpreting,
    jit,
    next_pow2,
    num_sms,
    pdl_enter,
    pdl_launch,
)
from pdserve.kernels.attn_prologue import (
    Prologue,
    check_prologue,
    rope_rows,
    write_new_kv,
    write_new_kv_fp8,
)
from pdserve.kernels.decode_attention_config import (
    MAX_SPLITS,
    DecodeTiles,
    choose_num_splits,
    decode_tiles,
)
from pdserve.kernels.decode_attention_tiles import (
    FP16_MAX,
    attend_keys,
    attend_keys_quarters,
    load_tile,
    merge_splits,
)
from pdserve.kernels.kv_quant import KVScales, cache_is_fp8
from pdserve.kernels.kv_write import DYN_FACTOR, check_q_and_cache

LOG2E = 1.4426950408889634
MAX_GROUP_ROWS = 64  # rows_per_seq * (Hq / Hkv) query rows per program at most
MERGE_TILE = 16384  # fp32 elements of one [rows, splits, D] tile when merging partials


@dataclass(frozen=True)
class SplitPartials:
    """A decode attention's split results left unmerged (fused_decode_attention with
    partials=True) for a reader that merges them as it loads them (kernels/fp8_gemv_tc.py's
    "merge" prologue): o [T, Hq, S, D] fp32, each split's output over its own keys; lse
    [T, Hq, S] fp32, the base-2 log of its softmax sum (-inf: no keys). Only the first
    active_splits(seq_lens[b], block_n, S) splits of a sequence hold anything."""
    o: torch.Tensor
    lse: torch.Tensor
    seq_lens: torch.Tensor
    block_n: int

    @property
    def num_splits(self) -> int:
        return self.o.shape[2]


def active_splits(seq_len: int, block_n: int, num_splits: int) -> int:
    """The splits of a sequence of seq_len keys that hold keys: whole block_n tiles spread
    over num_splits programs (the kernel's own arithmetic; 0 for seq_len 0)."""
    tiles = -(-seq_len // block_n)
    per_split = max(-(-tiles // num_splits), 1)
    return -(-tiles // per_split)


# eager steps' block tables are as wide as their longest sequence: the width is not
# specialized, or each (== 1, % 16) compiled in a served step (engine/exec/warmup.py)
@jit(do_not_specialize=["stride_bt"])
def _decode_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, slot_ptr,
                   kc_ptr,
                   vc_ptr, bt_ptr, seq_lens_ptr, out_ptr, mid_o_ptr, mid_lse_ptr, count_ptr,
                   stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
                   stride_kc_b, stride_kc_o, stride_kc_h, stride_vc_b, stride_vc_o, stride_vc_h,
                   ks_ptr, vs_ptr, stride_ks_b, stride_ks_h, stride_vs_b, stride_vs_h, static_k,
                   static_v, dyn_factor, stride_bt, stride_ob, stride_oh, scale_log2, eps,
                   block_size: tl.constexpr, HQ, HKV, num_splits, GROUP: tl.constexpr,
                   R: tl.constexpr,
                   BLOCK_G: tl.constexpr, RP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, SC: tl.constexpr,
                   PROLOGUE: tl.constexpr,
                   PREFETCH: tl.constexpr, Q_NORM: tl.constexpr,
                   K_NORM: tl.constexpr, HAS_POS: tl.constexpr, PREC: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, FP8: tl.constexpr, USE_PDL: tl.constexpr,
                   V_WORDS: tl.constexpr = 0, PTX: tl.constexpr = True,
                   PARTIALS: tl.constexpr = False):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    # Before the PDL wait, only what no kernel of the last two writes (lengths, block table,
    # RoPE rows: host copies or the forward's first ops; with the prologue, the split's first
    # tile of cached keys, whose new rows this kernel puts in itself): the wait is for the
    # q/k/v projection, and their round trips leave the critical path.
    seq_len = tl.load(seq_lens_ptr + b)
    # This split's keys [start, end): whole BLOCK_N tiles, so no tile straddles two splits.
    # Splits past the context (most of num_splits, fixed by max_model_len for the CUDA graph,
    # at a short context) return at once; split 0 always runs (seq_len 0 -> a zero row).
    tiles = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.maximum(tl.cdiv(tiles, num_splits), 1)
    n_active = tl.cdiv(tiles, per_split)
    start = split * per_split * BLOCK_N
    end = tl.minimum(start + per_split * BLOCK_N, seq_len)
    bt_row = bt_ptr + b * stride_bt
    kvh_64 = kvh.to(tl.int64)  # heads-outer caches: a head stride of a whole head region
    k_base = kc_ptr + kvh_64 * stride_kc_h
    v_base = vc_ptr + kvh_64 * stride_vc_h
    ks_base = ks_ptr + kvh_64 * stride_ks_h  # fp8: the blocks' scales of this KV head
    vs_base = vs_ptr + kvh_64 * stride_vs_h
    n_first = start + tl.arange(0, BLOCK_N)
    g = tl.arange(0, BLOCK_G)  # row g: query row g // GROUP, head g % GROUP of the group
    d = tl.arange(0, D)
    row_ok = g < R * GROUP
    qrow = b * R + g // GROUP  # [BLOCK_G] row of q / out
    if PROLOGUE:
        r_idx = tl.arange(0, RP)
        slots = tl.load(slot_ptr + b * R + r_idx, mask=r_idx < R, other=-1).to(tl.int64)
        if HAS_POS:  # cos/sin are tables: each token's row is its position
            rope_r = tl.load(pos_ptr + b * R + r_idx, mask=r_idx < R, other=0).to(tl.int64)
            crow = tl.load(pos_ptr + qrow, mask=row_ok, other=0).to(tl.int64)
        else:  # one cos/sin row per token
            rope_r = b * R + r_idx
            crow = qrow
        cs = crow[:, None] * stride_cs + (d % (D // 2))[None, :]
        c = tl.load(cos_ptr + cs, mask=row_ok[:, None], other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + cs, mask=row_ok[:, None], other=0.0).to(tl.float32)
    if PREFETCH:  # small grids (split-K): their programs wait on few SMs, registers spare
        k_first, v_first = load_tile(k_base, v_base, bt_row, n_first, end, stride_kc_b,
                                      stride_kc_o, stride_vc_b, stride_vc_o, block_size, D)
    else:  # placeholders; the loop loads every tile
        k_first = tl.zeros([BLOCK_N, D], dtype=kc_ptr.dtype.element_ty)
        v_first = tl.zeros([BLOCK_N, D], dtype=vc_ptr.dtype.element_ty)
    pdl_enter(USE_PDL)
    if split < tl.maximum(n_active, 1):
        heads = kvh * GROUP + g % GROUP  # the query heads that share this KV head
        q_rows = q_ptr + qrow[:, None] * stride_qb + heads[:, None] * stride_qh
        if PROLOGUE:  # q/k/v straight from the qkv projection: norm + RoPE + cache write here
            q = rope_rows(q_rows, d[None, :], row_ok[:, None], c, s, qn_ptr, eps, D // 2,
                          Q_NORM)
            if FP8:
                k_first, v_first = write_new_kv_fp8(
                    k_ptr, v_ptr, cos_ptr, sin_ptr, kn_ptr, slots, rope_r, kc_ptr, vc_ptr,
                    ks_ptr, vs_ptr, k_first, v_first, n_first, b, kvh, seq_len, start, end,
                    stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_kc_b,
                    stride_kc_o, stride_kc_h, stride_vc_b, stride_vc_o, stride_vc_h,
                    stride_ks_b, stride_ks_h, stride_vs_b, stride_vs_h, static_k, static_v,
                    dyn_factor, block_size, eps, R, RP, D // 2, K_NORM, PREFETCH)
            else:
                k_first, v_first = write_new_kv(
                    k_ptr, v_ptr, cos_ptr, sin_ptr, kn_ptr, slots, rope_r, kc_ptr, vc_ptr,
                    k_first, v_first, n_first, b, kvh, seq_len, start, end, stride_kt,
                    stride_kh, stride_vt, stride_vh, stride_cs, stride_kc_b, stride_kc_o,
                    stride_kc_h, stride_vc_b, stride_vc_o, stride_vc_h, block_size, eps, R, RP,
                    D // 2, K_NORM, PREFETCH)
            tl.debug_barrier()  # the cache writes before this CTA reads them back
        else:  # the cache may come from the kernel just before: read only after the wait
            q = tl.load(q_rows + d[None, :], mask=row_ok[:, None], other=0.0)
        visible = seq_len - (R - 1) + g // GROUP  # causal: keys < visible for each row
        if FP8:  # fp16 operands (decode_attention_tiles.py): keep |q| in fp16's range
            q = tl.clamp(q.to(tl.float32), -FP16_MAX, FP16_MAX)
        clear_end = tl.minimum(end, seq_len - (R - 1))  # keys every row of the split sees
        if V_WORDS == 3:  # fp8 words, per-quarter dots (never with PREFETCH)
            acc, m_i, l_i = attend_keys_quarters(
                q.to(DOT_DTYPE), k_base, v_base, ks_base, vs_base, bt_row, start, end,
                clear_end, visible, stride_kc_b, stride_kc_o, stride_vc_b, stride_vc_o,
                stride_ks_b, stride_vs_b, scale_log2, block_size, R, BLOCK_G, D, BLOCK_N, PREC,
                DOT_DTYPE, PTX)
        else:
            acc, m_i, l_i = attend_keys(
                q.to(DOT_DTYPE), k_first, v_first, k_base, v_base, ks_base, vs_base, bt_row,
                start, end, clear_end, visible, stride_kc_b, stride_kc_o, stride_vc_b,
                stride_vc_o, stride_ks_b, stride_vs_b, scale_log2, block_size, R, BLOCK_G, D,
                BLOCK_N, PREFETCH, PREC, DOT_DTYPE, FP8, V_WORDS)
        has_keys = l_i > 0.0  # false only for a padded seq_len-0 entry (or a row's future)
        o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
        row = (qrow * HQ + heads) * num_splits + split  # mid_*: [B * R, Hq, splits(, D)]
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        if PARTIALS:  # every split's partial is left for the reader (SplitPartials)
            tl.store(mid_o_ptr + row[:, None] * D + d[None, :], o, mask=row_ok[:, None])
            tl.store(mid_lse_ptr + row, lse, mask=row_ok)
        elif n_active <= 1:  # one split: its result is final
            tl.store(out_ptr + qrow[:, None] * stride_ob + heads[:, None] * stride_oh
                     + d[None, :], o, mask=row_ok[:, None])
        else:  # partial result; the last of the n_active programs to finish merges them
            tl.store(mid_o_ptr + row[:, None] * D + d[None, :], o, mask=row_ok[:, None])
            tl.store(mid_lse_ptr + row, lse, mask=row_ok)
            tl.debug_barrier()  # every thread's partial stored before the release below
            counter = count_ptr + b * HKV + kvh
            if tl.atomic_add(counter, 1, sem="acq_rel") == n_active - 1:
                tl.store(counter, 0)  # all have arrived: reset for the next launch
                merge_splits(mid_o_ptr, mid_lse_ptr, out_ptr, b, kvh, n_active, stride_ob,
                              stride_oh, HQ, num_splits, GROUP, R, D, BLOCK_R, BLOCK_S, SC)


def _default_tiles(dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int, batch: int,
                   num_kv_heads: int, device: torch.device, fused: bool) -> DecodeTiles:
    """decode_tiles for a launch: the fused prologue prefetches a split's first tile in the
    split-K regime (fewer (sequence, KV head) pairs than SMs)."""
    small = batch * num_kv_heads < (num_sms(device.index or 0) if device.type == "cuda" else 32)
    return decode_tiles(dtype, cache_dtype, head_dim, prefetch=fused and small)


def decode_num_splits(dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int, batch: int,
                      num_kv_heads: int, context: int, device: torch.device,
                      fused: bool = True) -> int:
    """The split count a decode launch of `batch` sequences over a block table of `context`
    tokens takes when none is given (what a CUDA graph captures): dtype is the dot products'
    type, cache_dtype the cache's, fused the prologue's kernel (fused_decode_attention)."""
    tiles = _default_tiles(dtype, cache_dtype, head_dim, batch, num_kv_heads, device, fused)
    return choose_num_splits(batch, num_kv_heads, context, tiles.block_n, device, tiles.waves)


def _operand_dtype(q_dtype: torch.dtype, fp8: bool) -> tuple[tl.dtype, str]:
    """tl.dot operand type and precision: an fp8 cache's tiles go to fp16 (one conversion
    instruction per pair on Hopper; decode_attention_tiles.py) unless q is fp32."""
    if fp8 and q_dtype != torch.float32 and not interpreting():
        return tl.float16, dot_precision(torch.float16)
    return dot_dtype(q_dtype), dot_precision(q_dtype)


def _word_loads(tiles: DecodeTiles, fp8: bool, op_dtype: tl.dtype, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> int:
    """The kernel's V_WORDS: 0 (cast), 1 (V as words), 2 (K and V), 3 (kv_quarters). Words
    need fp16 operands (compiled) and rows, strides and bases in whole 4-byte words (any
    engine layout). The interpreter has no PTX: only kv_quarters runs there (tl converts the
    bytes). Quarters need D >= 64: a quarter is a tl.dot reduction dim (>= 16)."""
    if tiles.fp8_loads == "kv_quarters" and k_cache.shape[-1] < 64:
        tiles = replace(tiles, fp8_loads="kv_words")
    if not fp8 or tiles.fp8_loads == "cast" or (not interpreting() and op_dtype != tl.float16):
        return 0
    if interpreting() and tiles.fp8_loads != "kv_quarters":
        return 0
    for t in (k_cache, v_cache):
        if t.data_ptr() % 4 or any(st % 4 for st in t.stride()[:3]):
            return 0
    return {"v_words": 1, "kv_words": 2, "kv_quarters": 3}[tiles.fp8_loads]


def _check_decode_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_tables: torch.Tensor, seq_lens: torch.Tensor,
                       scale: float, rows_per_seq: int = 1,
                       dtype: torch.dtype | None = None) -> None:
    T, HQ, _, _, HKV = check_q_and_cache(q, k_cache, v_cache, dtype)
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


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           num_splits: int | None = None,
                           max_seq_len: int | None = None, rows_per_seq: int = 1,
                           kv_scales: KVScales | None = None,
                           tiles: DecodeTiles | None = None) -> torch.Tensor:
    """out [B, Hq, D] = softmax(q k^T * scale) v over each sequence's seq_lens[b] cached keys.

    q [B * R, Hq, D] (R = rows_per_seq tokens per sequence, the last R of its seq_lens[b],
    each attending causally; R = 1 for decode; any strides, head dim contiguous); k_cache/v_cache
    [NB, BS, Hkv, D] strided layer views of q.dtype; block_tables [B, max_blocks] int32;
    seq_lens [B] int32 (0 gives a zero row, for padded CUDA-graph batches). num_splits
    defaults to choose_num_splits(B, Hkv, max_seq_len or the block table's capacity); pass
    it (or keep the table width fixed) to keep one choice across CUDA-graph replays. An fp8
    cache comes with its kv_scales [NB, Hkv] (kernels/kv_quant.py). tiles overrides
    decode_tiles' launch shape (benchmark sweeps).
    """
    _check_decode_args(q, k_cache, v_cache, block_tables, seq_lens, scale, rows_per_seq)
    return _launch(q, None, k_cache, v_cache, block_tables, seq_lens, scale, num_splits,
                   max_seq_len, rows_per_seq, kv_scales, tiles)


def fused_decode_attention(q: torch.Tensor, prologue: Prologue, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, num_splits: int | None = None,
                           rows_per_seq: int = 1, kv_scales: KVScales | None = None,
                           tiles: DecodeTiles | None = None,
                           compute_dtype: torch.dtype | None = None,
                           partials: bool = False) -> torch.Tensor | SplitPartials:
    """paged_decode_attention with the attention prologue folded in: q [B * R, Hq, D] is the
    raw projection (before QK-norm and RoPE), and the same kernel normalises and rotates q
    and the new k and writes k/v into the cache (as fused_qk_norm_rope_kv would) before
    reading it. One kernel per layer where there were three (prologue, split, reduce). An fp8
    cache's new rows are quantized here too (attn_prologue.write_new_kv_fp8).
    compute_dtype: the dot products' and the output's type where it is not q's (fp32 q/k/v
    from kernels/fp8_gemv_tc.py attend as the bf16 model would). partials: return the
    splits' results unmerged (SplitPartials), for a reader that merges them: no arrival
    atomic and no merge in the kernel."""
    if compute_dtype not in (None, q.dtype) and q.dtype != torch.float32:
        raise TypeError(f"compute_dtype: {compute_dtype} needs fp32 q, got {q.dtype}")
    _check_decode_args(q, k_cache, v_cache, block_tables, seq_lens, scale, rows_per_seq,
                       compute_dtype)
    check_prologue(q, prologue, k_cache.shape[2])
    return _launch(q, prologue, k_cache, v_cache, block_tables, seq_lens, scale, num_splits,
                   None, rows_per_seq, kv_scales, tiles, compute_dtype or q.dtype, partials)


def _launch(q: torch.Tensor, p: Prologue | None, k_cache: torch.Tensor, v_cache: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
            num_splits: int | None, max_seq_len: int | None, R: int,
            kv_scales: KVScales | None, tiles: DecodeTiles | None,
            dtype: torch.dtype | None = None, partials: bool = False
            ) -> torch.Tensor | SplitPartials:
    """dtype: the dot products' and output's type (q's unless given); partials: see
    fused_decode_attention."""
    dtype = dtype or q.dtype
    fp8 = cache_is_fp8(k_cache, kv_scales)
    sc = kv_scales if fp8 else KVScales(q, q)  # placeholders: never read without FP8
    T, HQ, D = q.shape
    B, HKV, bs = T // R, k_cache.shape[2], k_cache.shape[1]
    out = torch.empty((T, HQ, D), dtype=dtype, device=q.device)
    if B == 0:
        return out
    tiles = tiles or _default_tiles(dtype, k_cache.dtype, D, B, HKV, q.device, p is not None)
    block_n = tiles.block_n
    op_dtype, prec = _operand_dtype(dtype, fp8)
    words = _word_loads(tiles, fp8, op_dtype, k_cache, v_cache)
    if num_splits is None:
        context = max_seq_len or block_tables.shape[1] * bs
        num_splits = choose_num_splits(B, HKV, context, block_n, q.device, tiles.waves)
    prefetch = p is not None and num_splits > 1
    if prefetch and words == 3:  # the prefetched first tile is a whole [BLOCK_N, D] tile
        words = _word_loads(replace(tiles, fp8_loads="kv_words"), fp8, op_dtype, k_cache,
                            v_cache)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits: {num_splits} not in [1, {MAX_SPLITS}]")
    mid_o = mid_lse = counters = out  # unused when one split writes `out` directly
    if partials or num_splits > 1:  # partials: every split's, left for the reader
        mid_o = torch.empty((T, HQ, num_splits, D), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((T, HQ, num_splits), dtype=torch.float32, device=q.device)
    if num_splits > 1 and not partials:
        counters = arrival_counters(q.device, B * HKV)
    group, block_s = HQ // HKV, next_pow2(num_splits)
    k, v, cos, sin, slots = (q,) * 5 if p is None else (p.k, p.v, p.cos, p.sin, p.slot_mapping)
    pos = p.positions if p is not None and p.positions is not None else slots
    qn = q if p is None or p.q_norm is None else p.q_norm
    kn = q if p is None or p.k_norm is None else p.k_norm
    _decode_kernel[(B, HKV, num_splits)](
        q, k, v, pos, cos, sin, qn, kn, slots, k_cache, v_cache, block_tables, seq_lens, out, mid_o,
        mid_lse, counters, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), cos.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), sc.k, sc.v, sc.k.stride(0),
        sc.k.stride(1), sc.v.stride(0), sc.v.stride(1), float(sc.static_k), float(sc.static_v), DYN_FACTOR,
        block_tables.stride(0),
        out.stride(0), out.stride(1), float(scale) * LOG2E, 1e-6 if p is None else float(p.eps),
        bs, HQ, HKV, num_splits, GROUP=group, R=R, BLOCK_G=max(16, next_pow2(R * group)),
        RP=next_pow2(R), D=D,
        BLOCK_N=block_n, BLOCK_R=next_pow2(R * group), BLOCK_S=block_s,
        SC=max(1, min(block_s, MERGE_TILE // (next_pow2(R * group) * D))),
        PROLOGUE=p is not None, PREFETCH=prefetch,
        Q_NORM=p is not None and p.q_norm is not None,
        K_NORM=p is not None and p.k_norm is not None,
        HAS_POS=p is not None and p.positions is not None, PREC=prec, DOT_DTYPE=op_dtype,
        FP8=fp8, V_WORDS=words, PTX=not interpreting(), PARTIALS=partials,
        num_warps=tiles.num_warps, maxnreg=tiles.max_regs,
        num_stages=1 if interpreting() else tiles.num_stages, **pdl_launch(q))
    return SplitPartials(mid_o, mid_lse, seq_lens, block_n) if partials else out

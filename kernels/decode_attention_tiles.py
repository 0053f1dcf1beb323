"""The per-tile device code of the split-K decode attention kernel (kernels/decode_attention.py
holds the kernel, its launchers and the split/tile choice): loading a tile of paged keys and
values, one online-softmax step over it, the loop over a split's keys, and the merge of the
splits' partial results.

FP8 caches (e4m3 values, one fp32 scale per (block, KV head)) and why their tiles are read the
way they are (Triton 3.6, sm_90 SASS read off local builds; timings in
bench/results/attention_h200_2026-11-25.json):
- tl.dot operands are fp16, never bf16: e4m3 -> fp16 is one F2FP per pair and exact, bf16
  added two F2F.BF16.F16 per pair (a quarter-rate unit).
- A value tile is the B operand of p @ v with the keys as reduction dim, i.e. transposed: an
  fp8 tile cannot be ldmatrix-transposed (16-bit only), so Triton read it out of shared memory
  byte by byte (64 LDS.U8 + packing per thread per 64 keys), 212-218 registers (2 programs
  per SM) and ~77 warp instructions per key against bf16's ~39: fp8 KV ran at ~1.25 TB/s.
  load_values_f16 instead reads int32 words of four e4m3 and converts them by PTX in the
  loaded layout, so the operand is an fp16 tile (ldmatrix-transposable): 156 registers and ~42
  warp instructions per key with 128-key tiles.
- The scales never touch the [BLOCK_N, D] tiles: the key scales multiply the [rows, BLOCK_N]
  scores, and the value scales the softmax weights, normalised by the tile's largest value
  scale (that factor moves onto the [rows, D] product) so the fp16 weights stay in [0, 1].

Per-tile overhead (issue 23, session 13; SASS of local sm_90 builds, H200 timings in
bench/results/attention_fp8_sweep_h200_2026-11-25.json). An fp8 program at batch 256 issued
~1.3 of 4 instructions per cycle per SM: bound by latency and per-tile overhead, not by the
conversions. So the loop does less per tile: whole tiles below the keys every row sees run
without masks (the masked loop takes the last one or two), the block size is a constexpr
(shifts, not integer division per key) and word addresses use word strides (no int64 division
per row): 1234 -> 1022 instructions per warp per 128-key tile (bf16: 594 -> 408 per 64 keys).
Joining the four converted bytes of a word back into [BLOCK_N, D] (tl.join) made Triton pick
kWidth-4 dot operands (AccelerateMatmul halves the original bit width at a join): q's operand
was re-read from shared memory every tile (~230 register moves). kv_quarters (issue 23,
session 14) never joins: byte j of every word is its own [BLOCK_N, D / 4] operand, the
scores are the sum of four dots with q split the same way once (the dot over d does not
care how d is ordered), and the output is four [rows, D / 4] accumulators joined once after
the loop. 31 moves per tile instead of 237, 910 instructions instead of 981 and half the
shared memory (20 KB at one stage); with 2 stages and 168 registers (3 programs per SM) the
batch-256 x 4K layer went from 0.890 to 0.754 ms fused (H200,
bench/results/attention_fp8_quarters_h200_2026-11-25.json). Tried and dropped: an identity
asm after the join (kWidth 2, but K then staged through shared memory as fp16: 105 KB, 2
programs per SM, slower); e4m3 -> fp16 by integer ops instead of cvt; bytes converted four
per asm (Triton transposes the fp8 tile byte by byte again); V loaded after the score dots
in kv_quarters (more spills at 128 registers).
"""
from __future__ import annotations

import triton.language as tl

from pdserve.kernels._triton import jit

FP16_MAX = tl.constexpr(65504.0)


@jit
def _e4m3x4_to_f16(w):
    """Four e4m3 bytes per int32 word w -> their fp16 values (exact), one tensor per byte
    (byte j of the word is element j), two PTX cvt.rn.f16x2.e4m3x2 per word."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi;\n\t.reg .b32 a, b;\n\tmov.b32 {lo, hi}, $4;\n\t"
        "cvt.rn.f16x2.e4m3x2 a, lo;\n\tcvt.rn.f16x2.e4m3x2 b, hi;\n\t"
        "mov.b32 {$0, $1}, a;\n\tmov.b32 {$2, $3}, b; }",
        "=h,=h,=h,=h,r", [w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
        is_pure=True, pack=1)


@jit
def _load(ptr, mask, other, MASK: tl.constexpr):
    """tl.load under `mask` (`other` where false), or unmasked when MASK is off (whole
    tiles)."""
    if MASK:
        return tl.load(ptr, mask=mask, other=other)
    return tl.load(ptr)


@jit
def _load_quarters(base, blk, off, valid, stride_b, stride_o, D: tl.constexpr,
                   MASK: tl.constexpr, PTX: tl.constexpr = True):
    """An fp8 cache's rows (block ids blk / offsets off [BLOCK_N, 1]) read as int32 words of
    four e4m3 (strides in bytes, multiples of 4) -> four fp16 [BLOCK_N, D / 4] tensors, the
    j-th holding the values at d = 4 c + j. Without PTX (the interpreter) the bytes are
    shifted out and converted by tl."""
    c = tl.arange(0, D // 4)[None, :]
    words = base.to(tl.pointer_type(tl.int32), bitcast=True)
    # strides in words (multiples of 4 bytes, checked by the launcher): no int64 division
    w = _load(words + blk * (stride_b // 4) + off * (stride_o // 4) + c, valid, 0, MASK)
    if PTX:
        return _e4m3x4_to_f16(w)
    return _byte_f16(w, 0), _byte_f16(w, 8), _byte_f16(w, 16), _byte_f16(w, 24)


@jit
def _byte_f16(w, shift: tl.constexpr):
    """The e4m3 byte of the int32 words w at bit `shift`, as fp16 (tl's conversion)."""
    byte = ((w >> shift) & 0xFF).to(tl.uint8)
    return byte.to(tl.float8e4nv, bitcast=True).to(tl.float16)


@jit
def load_values_f16(v_base, bt_row, n, end, stride_vc_b, stride_vc_o, block_size,
                    D: tl.constexpr, MASK: tl.constexpr = True):
    """An fp8 cache's values [BLOCK_N, D] at positions n as fp16, read as int32 words of four
    e4m3 each (strides in bytes, multiples of 4) and converted in the loaded layout: the
    tl.dot operand is then an fp16 tile (ldmatrix-transposable), where fp8 tiles were
    transposed byte by byte out of shared memory (LDS.U8: ~200 instructions per tile)."""
    valid = (n < end)[:, None]
    blk = _load(bt_row + n // block_size, n < end, 0, MASK).to(tl.int64)[:, None]
    off = (n % block_size)[:, None]
    b0, b1, b2, b3 = _load_quarters(v_base, blk, off, valid, stride_vc_b, stride_vc_o, D, MASK)
    # join's new dim is the minor one: [BLOCK_N, D / 4, k, i] holds byte 2 k + i of word c,
    # the value at d = 4 c + 2 k + i
    v = tl.join(tl.join(b0, b2), tl.join(b1, b3))
    return tl.reshape(v, (n.shape[0], D))


@jit
def load_tile(k_base, v_base, bt_row, n, end, stride_kc_b, stride_kc_o, stride_vc_b,
              stride_vc_o, block_size, D: tl.constexpr, V_WORDS: tl.constexpr = 0,
              MASK: tl.constexpr = True):
    """Keys and values [BLOCK_N, D] at positions n (< end) of one KV head's cache. An fp8
    cache with V_WORDS 1 (V) or 2 (K and V): those come as fp16 (load_values_f16)."""
    d = tl.arange(0, D)[None, :]
    valid = (n < end)[:, None]
    # Block ids are int32 in the table; widen before the (huge) block stride.
    blk = _load(bt_row + n // block_size, n < end, 0, MASK).to(tl.int64)[:, None]
    off = (n % block_size)[:, None]
    if V_WORDS == 2:
        k = load_values_f16(k_base, bt_row, n, end, stride_kc_b, stride_kc_o, block_size, D,
                            MASK)
        v = load_values_f16(v_base, bt_row, n, end, stride_vc_b, stride_vc_o, block_size, D,
                            MASK)
    else:
        k = _load(k_base + blk * stride_kc_b + off * stride_kc_o + d, valid, 0.0, MASK)
        if V_WORDS == 1:
            v = load_values_f16(v_base, bt_row, n, end, stride_vc_b, stride_vc_o, block_size,
                                D, MASK)
        else:
            v = _load(v_base + blk * stride_vc_b + off * stride_vc_o + d, valid, 0.0, MASK)
    return k, v


@jit
def load_scales(ks_base, vs_base, bt_row, n, end, stride_ks_b, stride_vs_b, block_size,
                MASK: tl.constexpr = True):
    """An fp8 cache's per-key scales [BLOCK_N] (their blocks' scales for this KV head)."""
    blk = _load(bt_row + n // block_size, n < end, 0, MASK).to(tl.int64)
    ks = _load(ks_base + blk * stride_ks_b, n < end, 0.0, MASK)
    vs = _load(vs_base + blk * stride_vs_b, n < end, 0.0, MASK)
    return ks, vs


@jit
def _softmax_step(s, m_i, l_i, n, end, visible, R: tl.constexpr, MASK: tl.constexpr):
    """The online-softmax update for the scores s [BLOCK_G, BLOCK_N] (log2 units) of the keys
    at n: returns (weights p, the old sums' factor alpha, new max, new sum)."""
    if MASK and R == 1:
        s = tl.where((n < end)[None, :], s, float("-inf"))
    elif MASK:
        s = tl.where(n[None, :] < visible[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if R > 1 and MASK:  # a row may have seen no key yet (this split's keys are its future)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@jit
def attend_tile(q, acc, m_i, l_i, k, v, n, end, visible, scale_log2, ks, vs, R: tl.constexpr,
                PREC: tl.constexpr, DOT_DTYPE: tl.constexpr, FP8: tl.constexpr,
                MASK: tl.constexpr = True):
    """One online-softmax step over the keys k / values v [BLOCK_N, D] at positions n. An fp8
    tile is converted as is (exact in fp16) and its scales ks/vs [BLOCK_N] ride on the
    [BLOCK_G, BLOCK_N] scores and weights, never on the [BLOCK_N, D] tiles. Without MASK
    every key of the tile is below `end` and visible to every row."""
    s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=PREC)  # [BLOCK_G, BLOCK_N]
    if FP8:
        s = s * (ks * scale_log2)[None, :]
    else:
        s = s * scale_log2
    p, alpha, m_new, l_i = _softmax_step(s, m_i, l_i, n, end, visible, R, MASK)
    if FP8:  # weights x value scale / the tile's largest: in [0, 1] for the fp16 operand
        v_ref = tl.maximum(tl.max(vs, axis=0), 1e-30)
        p = p * (vs / v_ref)[None, :]
        pv = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PREC) * v_ref
    else:
        pv = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PREC)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@jit
def attend_keys(q, k_first, v_first, k_base, v_base, ks_base, vs_base, bt_row, start, end,
                clear_end, visible, stride_kc_b, stride_kc_o, stride_vc_b, stride_vc_o,
                stride_ks_b, stride_vs_b, scale_log2, block_size, R: tl.constexpr, BLOCK_G: tl.constexpr,
                D: tl.constexpr, BLOCK_N: tl.constexpr, FIRST_LOADED: tl.constexpr,
                PREC: tl.constexpr, DOT_DTYPE: tl.constexpr, FP8: tl.constexpr,
                V_WORDS: tl.constexpr = 0):
    """Online softmax of the rows q [BLOCK_G, D] over keys [start, end) of one KV head:
    returns (acc [BLOCK_G, D] unnormalised, m [BLOCK_G] running max in log2 units, l [BLOCK_G]
    sum of weights). Row g sees keys < visible[g] (causal rows of a verify step); every row
    sees the keys < clear_end (<= end). With FIRST_LOADED the first tile's keys/values
    k_first/v_first [BLOCK_N, D] come in loaded; otherwise the (software-pipelined) loops
    load every tile: whole tiles below clear_end unmasked, then the rest (one or two tiles)
    masked."""
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, D], dtype=tl.float32)
    loop_start = start
    if FIRST_LOADED:
        if start < end:
            n = start + tl.arange(0, BLOCK_N)
            ks, vs = scale_log2, scale_log2  # unused unless FP8
            if FP8:  # after the prologue's write: a fresh block's scale is set there
                ks, vs = load_scales(ks_base, vs_base, bt_row, n, end, stride_ks_b,
                                     stride_vs_b, block_size)
            acc, m_i, l_i = attend_tile(q, acc, m_i, l_i, k_first, v_first, n, end, visible,
                                        scale_log2, ks, vs, R, PREC, DOT_DTYPE, FP8)
        loop_start = start + BLOCK_N
    # A split of only its prefetched tile (batch 1, short context) skips the loops and the
    # software pipeliner's prologue around them (~1 us of a batch-1 layer on an H200)
    if loop_start < end:
        full_end = loop_start + tl.maximum(clear_end - loop_start, 0) // BLOCK_N * BLOCK_N
        for n0 in range(loop_start, full_end, BLOCK_N):
            acc, m_i, l_i = _loop_tile(q, acc, m_i, l_i, n0, k_base, v_base, ks_base, vs_base,
                                       bt_row, end, visible, stride_kc_b, stride_kc_o,
                                       stride_vc_b, stride_vc_o, stride_ks_b, stride_vs_b,
                                       scale_log2, block_size, R, D, BLOCK_N, PREC, DOT_DTYPE,
                                       FP8, V_WORDS, False)
        for n0 in range(tl.maximum(full_end, loop_start), end, BLOCK_N):
            acc, m_i, l_i = _loop_tile(q, acc, m_i, l_i, n0, k_base, v_base, ks_base, vs_base,
                                       bt_row, end, visible, stride_kc_b, stride_kc_o,
                                       stride_vc_b, stride_vc_o, stride_ks_b, stride_vs_b,
                                       scale_log2, block_size, R, D, BLOCK_N, PREC, DOT_DTYPE,
                                       FP8, V_WORDS, True)
    return acc, m_i, l_i


@jit
def _loop_tile(q, acc, m_i, l_i, n0, k_base, v_base, ks_base, vs_base, bt_row, end, visible,
               stride_kc_b, stride_kc_o, stride_vc_b, stride_vc_o, stride_ks_b, stride_vs_b,
               scale_log2, block_size, R: tl.constexpr, D: tl.constexpr,
               BLOCK_N: tl.constexpr, PREC: tl.constexpr, DOT_DTYPE: tl.constexpr,
               FP8: tl.constexpr, V_WORDS: tl.constexpr, MASK: tl.constexpr):
    """attend_keys' loop body: load the tile at n0 (and its scales) and attend to it."""
    n = n0 + tl.arange(0, BLOCK_N)
    k, v = load_tile(k_base, v_base, bt_row, n, end, stride_kc_b, stride_kc_o, stride_vc_b,
                     stride_vc_o, block_size, D, V_WORDS, MASK)
    ks, vs = scale_log2, scale_log2
    if FP8:
        ks, vs = load_scales(ks_base, vs_base, bt_row, n, end, stride_ks_b, stride_vs_b,
                             block_size, MASK)
    return attend_tile(q, acc, m_i, l_i, k, v, n, end, visible, scale_log2, ks, vs, R, PREC,
                       DOT_DTYPE, FP8, MASK)


@jit
def attend_keys_quarters(q, k_base, v_base, ks_base, vs_base, bt_row, start, end, clear_end,
                         visible, stride_kc_b, stride_kc_o, stride_vc_b, stride_vc_o,
                         stride_ks_b, stride_vs_b, scale_log2, block_size, R: tl.constexpr,
                         BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                         PREC: tl.constexpr, DOT_DTYPE: tl.constexpr, PTX: tl.constexpr):
    """attend_keys for an fp8 cache with fp16 operands, K and V never joined (fp8_loads
    "kv_quarters"): a word of four e4m3 converts to four fp16 tensors [BLOCK_N, D / 4] (value
    d = 4 c + j in the j-th), and the dots run per quarter -- scores = sum_j q_j k_j^T with q
    split the same way once, out[:, 4 c + j] = p v_j. No tl.join feeds a dot, so its operands
    keep kWidth 2 and q stays in registers (with the join, q's operand was re-read from shared
    memory every tile, ~230 register moves). Same returns as attend_keys."""
    q_e, q_o = tl.split(tl.reshape(q, (BLOCK_G, D // 4, 2, 2)))  # [g, c, k, i]: d = 4c+2k+i
    q0, q2 = tl.split(q_e)
    q1, q3 = tl.split(q_o)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    a0 = tl.zeros([BLOCK_G, D // 4], dtype=tl.float32)
    a1, a2, a3 = a0, a0, a0
    full_end = start + tl.maximum(clear_end - start, 0) // BLOCK_N * BLOCK_N
    for n0 in range(start, full_end, BLOCK_N):
        a0, a1, a2, a3, m_i, l_i = _quarter_tile(
            q0, q1, q2, q3, a0, a1, a2, a3, m_i, l_i, n0, k_base, v_base, ks_base, vs_base,
            bt_row, end, visible, stride_kc_b, stride_kc_o, stride_vc_b, stride_vc_o,
            stride_ks_b, stride_vs_b, scale_log2, block_size, R, D, BLOCK_N, PREC, DOT_DTYPE,
            PTX, False)
    for n0 in range(tl.maximum(full_end, start), end, BLOCK_N):
        a0, a1, a2, a3, m_i, l_i = _quarter_tile(
            q0, q1, q2, q3, a0, a1, a2, a3, m_i, l_i, n0, k_base, v_base, ks_base, vs_base,
            bt_row, end, visible, stride_kc_b, stride_kc_o, stride_vc_b, stride_vc_o,
            stride_ks_b, stride_vs_b, scale_log2, block_size, R, D, BLOCK_N, PREC, DOT_DTYPE,
            PTX, True)
    acc = tl.reshape(tl.join(tl.join(a0, a2), tl.join(a1, a3)), (BLOCK_G, D))
    return acc, m_i, l_i


@jit
def _quarter_tile(q0, q1, q2, q3, a0, a1, a2, a3, m_i, l_i, n0, k_base, v_base, ks_base,
                  vs_base, bt_row, end, visible, stride_kc_b, stride_kc_o, stride_vc_b,
                  stride_vc_o, stride_ks_b, stride_vs_b, scale_log2, block_size,
                  R: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
                  DOT_DTYPE: tl.constexpr, PTX: tl.constexpr, MASK: tl.constexpr):
    """attend_keys_quarters' loop body: the tile of keys at n0 (one block-table read for K,
    V and the scales) and one online-softmax step over it."""
    n = n0 + tl.arange(0, BLOCK_N)
    valid = n < end
    blk = _load(bt_row + n // block_size, valid, 0, MASK).to(tl.int64)  # [BLOCK_N]
    off = (n % block_size)[:, None]
    k0, k1, k2, k3 = _load_quarters(k_base, blk[:, None], off, valid[:, None], stride_kc_b,
                                    stride_kc_o, D, MASK, PTX)
    v0, v1, v2, v3 = _load_quarters(v_base, blk[:, None], off, valid[:, None], stride_vc_b,
                                    stride_vc_o, D, MASK, PTX)
    ks = _load(ks_base + blk * stride_ks_b, valid, 0.0, MASK)
    vs = _load(vs_base + blk * stride_vs_b, valid, 0.0, MASK)
    s = tl.dot(q0, tl.trans(k0.to(DOT_DTYPE)), input_precision=PREC)  # [BLOCK_G, BLOCK_N]
    s = tl.dot(q1, tl.trans(k1.to(DOT_DTYPE)), s, input_precision=PREC)
    s = tl.dot(q2, tl.trans(k2.to(DOT_DTYPE)), s, input_precision=PREC)
    s = tl.dot(q3, tl.trans(k3.to(DOT_DTYPE)), s, input_precision=PREC)
    p, alpha, m_new, l_i = _softmax_step(s * (ks * scale_log2)[None, :], m_i, l_i, n, end,
                                         visible, R, MASK)
    # weights x value scale / the tile's largest: in [0, 1] for the fp16 operand
    v_ref = tl.maximum(tl.max(vs, axis=0), 1e-30)
    pd = (p * (vs / v_ref)[None, :]).to(DOT_DTYPE)
    a0 = a0 * alpha[:, None] + tl.dot(pd, v0.to(DOT_DTYPE), input_precision=PREC) * v_ref
    a1 = a1 * alpha[:, None] + tl.dot(pd, v1.to(DOT_DTYPE), input_precision=PREC) * v_ref
    a2 = a2 * alpha[:, None] + tl.dot(pd, v2.to(DOT_DTYPE), input_precision=PREC) * v_ref
    a3 = a3 * alpha[:, None] + tl.dot(pd, v3.to(DOT_DTYPE), input_precision=PREC) * v_ref
    return a0, a1, a2, a3, m_new, l_i


@jit
def merge_splits(mid_o_ptr, mid_lse_ptr, out_ptr, b, kvh, n_active, stride_ob, stride_oh, HQ,
                 num_splits, GROUP: tl.constexpr, R: tl.constexpr, D: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, SC: tl.constexpr):
    """The last split program of (sequence b, KV head kvh) merges the n_active partial results
    of its R * GROUP rows, all rows at once: in one [BLOCK_R, BLOCK_S, D] tile when every
    split fits (SC == BLOCK_S), else SC splits per step with an online rescale, stopping at
    n_active. A short context then costs one round trip of loads where it cost one per group
    of rows (the Qwen3-30B-A3B shape at batch 1: 8 rows x 32 splits took 4; issue 21). Loads
    skip L1 (.cg): other SMs wrote the partials."""
    i = tl.arange(0, BLOCK_R)
    d = tl.arange(0, D)
    i_ok = i < R * GROUP
    qrow = b * R + i // GROUP
    head = kvh * GROUP + i % GROUP
    row = (qrow * HQ + head) * num_splits  # [BLOCK_R] first split's row of mid_*
    if SC == BLOCK_S:  # one step, no loop (a loop of one trip still paid the pipeliner)
        m, total, acc = _merge_step(mid_o_ptr, mid_lse_ptr, row, i_ok, 0, n_active, d,
                                    tl.full([BLOCK_R], float("-inf"), dtype=tl.float32),
                                    tl.zeros([BLOCK_R], dtype=tl.float32),
                                    tl.zeros([BLOCK_R, D], dtype=tl.float32), D, BLOCK_S)
    else:
        m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        total = tl.zeros([BLOCK_R], dtype=tl.float32)
        acc = tl.zeros([BLOCK_R, D], dtype=tl.float32)
        for s0 in range(0, n_active, SC):
            m, total, acc = _merge_step(mid_o_ptr, mid_lse_ptr, row, i_ok, s0, n_active, d, m,
                                        total, acc, D, SC)
    res = acc / tl.where(total > 0.0, total, 1.0)[:, None]
    tl.store(out_ptr + qrow[:, None] * stride_ob + head[:, None] * stride_oh + d[None, :], res,
             mask=i_ok[:, None])


@jit
def _merge_step(mid_o_ptr, mid_lse_ptr, row, i_ok, s0, n_active, d, m, total, acc,
                D: tl.constexpr, SC: tl.constexpr):
    """Splits s0 .. s0 + SC - 1 (< n_active) into the running (max m, weight sum total,
    weighted sum acc [BLOCK_R, D]) of the rows at row [BLOCK_R] of mid_*."""
    s = s0 + tl.arange(0, SC)
    m2 = i_ok[:, None] & (s < n_active)[None, :]
    lse = tl.load(mid_lse_ptr + row[:, None] + s[None, :], mask=m2, other=float("-inf"),
                  cache_modifier=".cg")
    o = tl.load(mid_o_ptr + (row[:, None, None] + s[None, :, None]) * D + d[None, None, :],
                mask=m2[:, :, None], other=0.0, cache_modifier=".cg")
    m_new = tl.maximum(m, tl.max(lse, axis=1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no keys yet: weights 0
    alpha = tl.exp2(m - m_ref)
    w = tl.exp2(lse - m_ref[:, None])  # [BLOCK_R, SC]
    total = total * alpha + tl.sum(w, axis=1)
    acc = acc * alpha[:, None] + tl.sum(o * w[:, :, None], axis=1)
    return m_new, total, acc

"""paged_decode_attention against the torch reference: GQA ratios, block boundaries, splits."""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels.decode_attention_config import choose_num_splits
from pdserve.kernels.ops import paged_decode_attention
from pdserve.kernels.reference import paged_attention_ref


def _run(cache, hq, d, dtype, device, num_splits, seed=0, q=None):
    B = cache.seq_lens.shape[0]
    if q is None:
        q = torch.randn(B, hq, d, generator=torch.Generator().manual_seed(seed)).to(device, dtype)
    scale = d ** -0.5
    out = paged_decode_attention(q, cache.k, cache.v, cache.block_tables, cache.seq_lens, scale,
                                 num_splits=num_splits)
    qsl = torch.arange(B + 1, dtype=torch.int32, device=device)
    ref = paged_attention_ref(q, cache.k, cache.v, qsl, cache.seq_lens, cache.block_tables,
                              scale)
    return out, ref


@pytest.mark.parametrize("group,bs,seq_lens,splits", [
    (1, 16, [1, 16, 17, 47], 1),       # MHA; k*bs, k*bs+1, k*bs-1 ends
    (3, 8, [24, 25, 23], 3),           # odd GQA ratio, splits that do not divide the tiles
    (4, 4, [64, 65, 1], 2),            # tiny blocks: every tile spans many blocks
    (8, 32, [96, 97, 95], 4),          # splits past the end of short sequences stay empty
    (2, 16, [5, 130, 64], 16),         # most splits empty (as at batch 1 under a graph):
                                       # they write nothing and the reduce must skip them
])
def test_fp32_matches_reference(group, bs, seq_lens, splits, device, paged_cache, close):
    hkv, d = 2, 64
    cache = paged_cache(seq_lens, bs, hkv, d, torch.float32)
    out, ref = _run(cache, group * hkv, d, torch.float32, device, splits)
    close(out, ref, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_head_dim_128(dtype, device, paged_cache, close):
    cache = paged_cache([33, 128, 5], 16, 2, 128, dtype)
    out, ref = _run(cache, 8, 128, dtype, device, num_splits=2)
    assert out.dtype == dtype
    close(out, ref, dtype)


def test_split_count_does_not_change_the_result(device, paged_cache, close):
    cache = paged_cache([200, 37], 8, 1, 64, torch.float32)
    q = torch.randn(2, 4, 64, device=device)
    outs = [_run(cache, 4, 64, torch.float32, device, s, q=q)[0] for s in (1, 5, 16)]
    close(outs[1], outs[0], torch.float32)
    close(outs[2], outs[0], torch.float32)


def test_strided_q_and_zero_length_padding_rows(device, paged_cache, close):
    """q as a slice of a fused qkv buffer; seq_len 0 (CUDA-graph padding) yields zeros."""
    hq, hkv, d = 6, 2, 64
    cache = paged_cache([20, 0, 9], 8, hkv, d, torch.float32)
    qkv = torch.randn(3, (hq + 2 * hkv) * d, device=device)
    q = qkv[:, : hq * d].view(3, hq, d)
    assert not q.is_contiguous()
    for splits in (1, 3):
        out, ref = _run(cache, hq, d, torch.float32, device, splits, q=q)
        close(out, ref, torch.float32)
        assert torch.count_nonzero(out[1]) == 0


def test_default_split_choice(device, paged_cache, close):
    cache = paged_cache([70, 3], 16, 2, 64, torch.float32)
    out, ref = _run(cache, 4, 64, torch.float32, device, num_splits=None)
    close(out, ref, torch.float32)
    cpu = torch.device("cpu")
    assert choose_num_splits(1, 8, 10_000, 64, cpu) > 1  # batch 1: split the context
    assert choose_num_splits(64, 8, 10_000, 64, cpu) == 1  # enough programs already
    assert choose_num_splits(1, 8, 40, 64, cpu) == 1  # never more splits than tiles
    for b in (1, 2, 3, 5, 7):
        n = choose_num_splits(b, 2, 4096, 64, cpu)
        assert n & (n - 1) == 0


def test_bad_arguments_name_the_field(device, paged_cache):
    cache = paged_cache([16, 16], 16, 2, 64, torch.float32)
    q = torch.randn(2, 4, 64, device=device)
    args = (cache.k, cache.v, cache.block_tables, cache.seq_lens, 0.125)
    with pytest.raises(TypeError, match="k_cache: dtype"):
        paged_decode_attention(q.half(), *args)
    with pytest.raises(ValueError, match="q: 5 heads is not a multiple"):
        paged_decode_attention(torch.randn(2, 5, 64, device=device), *args)
    with pytest.raises(TypeError, match="block_tables"):
        paged_decode_attention(q, cache.k, cache.v, cache.block_tables.long(), cache.seq_lens,
                               0.125)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_decode_attention(q, cache.k, cache.v, cache.block_tables, cache.seq_lens[:1],
                               0.125)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(q, *args, num_splits=0)
    with pytest.raises(ValueError, match="scale"):
        paged_decode_attention(q, cache.k, cache.v, cache.block_tables, cache.seq_lens, -1.0)
    with pytest.raises(ValueError, match="block_size 12 must be a power of 2"):
        kv = torch.zeros(4, 12, 2, 64, device=device)
        paged_decode_attention(q, kv, kv, cache.block_tables, cache.seq_lens, 0.125)


def _verify_rows(cache, R: int, hq: int, d: int, dtype, device, num_splits, seed=0):
    """R query rows per sequence (an MTP verify step), each the last R tokens of its context."""
    B = cache.seq_lens.shape[0]
    q = torch.randn(B * R, hq, d, generator=torch.Generator().manual_seed(seed)).to(device, dtype)
    scale = d ** -0.5
    out = paged_decode_attention(q, cache.k, cache.v, cache.block_tables, cache.seq_lens, scale,
                                 num_splits=num_splits, rows_per_seq=R)
    qsl = torch.arange(B + 1, dtype=torch.int32, device=device) * R
    ref = paged_attention_ref(q, cache.k, cache.v, qsl, cache.seq_lens, cache.block_tables,
                              scale)
    return out, ref


@pytest.mark.parametrize("R,group,bs,seq_lens,splits", [
    (2, 4, 16, [17, 33, 2], 4),        # the new row's keys cross a block boundary
    (3, 3, 8, [24, 25, 23, 3], 3),     # odd GQA ratio; a context of exactly R tokens
    (4, 4, 4, [65, 64, 130], 16),      # most splits empty; the last split holds only keys
                                       # that the first rows must not see
    (2, 8, 32, [97, 96], 1),           # one split: rows stored directly
    (5, 2, 16, [40, 81], 8),           # R * G = 10 rows padded to 16
])
def test_several_rows_per_sequence_are_causal(R, group, bs, seq_lens, splits, device,
                                              paged_cache, close):
    hkv, d = 2, 64
    cache = paged_cache(seq_lens, bs, hkv, d, torch.float32)
    out, ref = _verify_rows(cache, R, group * hkv, d, torch.float32, device, splits)
    close(out, ref, torch.float32)


def test_several_rows_bf16_with_default_splits(device, paged_cache, close):
    cache = paged_cache([300, 47], 16, 2, 128, torch.bfloat16)
    out, ref = _verify_rows(cache, 4, 8, 128, torch.bfloat16, device, None, seed=3)
    close(out, ref, torch.bfloat16)


def test_rows_per_seq_is_checked(device, paged_cache):
    cache = paged_cache([20, 9], 8, 2, 64, torch.float32)
    q = torch.randn(5, 4, 64, device=device)
    with pytest.raises(ValueError, match="rows_per_seq: 2 must be an int >= 1 dividing"):
        paged_decode_attention(q, cache.k, cache.v, cache.block_tables, cache.seq_lens, 0.125,
                               rows_per_seq=2)
    with pytest.raises(ValueError, match="rows_per_seq: 40 rows x 2 query heads"):
        paged_decode_attention(torch.randn(80, 4, 64, device=device), cache.k, cache.v,
                               cache.block_tables, cache.seq_lens, 0.125, rows_per_seq=40)


@pytest.mark.parametrize("query_lens", [[3, 3], [2, 3]])
def test_attention_entry_point_for_verify_steps(query_lens, device, paged_cache, close):
    """triton_attention.attention: uniform query lengths (a verify step) take the decode kernel with
    rows_per_seq, mixed ones the chunked-prefill kernel; both match the reference."""
    from pdserve.engine.model.attention import AttentionMetadata
    from pdserve.engine.model.triton_attention import attention

    cache = paged_cache([41, 18], 8, 2, 64, torch.float32)
    T = sum(query_lens)
    q = torch.randn(T, 8, 64, generator=torch.Generator().manual_seed(5)).to(device)
    qsl = torch.tensor([0, query_lens[0], T], dtype=torch.int32, device=device)
    meta = AttentionMetadata(slot_mapping=torch.zeros(T, dtype=torch.int64, device=device),
                             query_start_loc=qsl, seq_lens=cache.seq_lens,
                             block_tables=cache.block_tables, max_query_len=max(query_lens),
                             max_seq_len=41, query_lens_cpu=query_lens, seq_lens_cpu=[41, 18],
                             block_size=8)
    ref = paged_attention_ref(q, cache.k, cache.v, qsl, cache.seq_lens, cache.block_tables,
                              64 ** -0.5)
    close(attention(q, cache.k, cache.v, meta, 64 ** -0.5), ref, torch.float32)


def test_merge_of_many_rows_in_split_chunks(device, paged_cache, close):
    """R * GROUP = 64 rows at D = 128: the merge takes 2 splits per step ([64, 2, 128] tiles,
    an online rescale across steps), 7 active splits of 8 (one past the context)."""
    hkv, group, R, d = 2, 16, 4, 128
    cache = paged_cache([400, 437], 16, hkv, d, torch.float32)
    q = torch.randn(2 * R, hkv * group, d, generator=torch.Generator().manual_seed(9)).to(device)
    out = paged_decode_attention(q, cache.k, cache.v, cache.block_tables, cache.seq_lens,
                                 d ** -0.5, num_splits=8, rows_per_seq=R)
    qsl = torch.arange(3, dtype=torch.int32, device=device) * R
    ref = paged_attention_ref(q, cache.k, cache.v, qsl, cache.seq_lens, cache.block_tables,
                              d ** -0.5)
    close(out, ref, torch.float32)


def _heads_outer(cache, layer: int = 1):
    """A heads-outer copy [NB, Hkv, L, 2, BS, D] of cache.kv (docs/tensor_parallel.md) and its
    layer views [NB, BS, Hkv, D]: the head stride is a whole head region."""
    ho = cache.kv.permute(0, 4, 1, 2, 3, 5).contiguous()
    return ho, ho[:, :, layer, 0].transpose(1, 2), ho[:, :, layer, 1].transpose(1, 2)


@pytest.mark.parametrize("R,splits", [(1, 3), (2, 1)])
def test_heads_outer_views_give_the_same_result(R, splits, device, paged_cache):
    """The same values behind heads-outer views: bitwise the same output."""
    hkv, group, d = 3, 2, 64
    cache = paged_cache([37, 5, 64], 8, hkv, d, torch.bfloat16)
    _, k, v = _heads_outer(cache)
    q = torch.randn(3 * R, group * hkv, d,
                    generator=torch.Generator().manual_seed(9)).to(device, torch.bfloat16)
    args = (cache.block_tables, cache.seq_lens, d ** -0.5)
    want = paged_decode_attention(q, cache.k, cache.v, *args, num_splits=splits, rows_per_seq=R)
    out = paged_decode_attention(q, k, v, *args, num_splits=splits, rows_per_seq=R)
    assert torch.equal(out, want)

"""paged_prefill_attention against the torch reference: varlen, prefix-cached context, mixed
prefill + decode batches, GQA ratios, block boundaries."""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels.ops import paged_prefill_attention
from pdserve.kernels.reference import paged_attention_ref


def _run(cache, query_lens, hq, d, dtype, device, seed=0, q=None):
    qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32,
                       device=device)
    T = sum(query_lens)
    if q is None:
        q = torch.randn(T, hq, d, generator=torch.Generator().manual_seed(seed)).to(device, dtype)
    scale = d ** -0.5
    out = paged_prefill_attention(q, cache.k, cache.v, qsl, cache.seq_lens, cache.block_tables,
                                  max(query_lens), scale)
    ref = paged_attention_ref(q, cache.k, cache.v, qsl, cache.seq_lens, cache.block_tables,
                              scale)
    return out, ref


@pytest.mark.parametrize("group,bs,query_lens,seq_lens", [
    (1, 16, [1], [1]),                     # T = 1
    (4, 16, [37], [37]),                   # one fresh prompt, no cache
    (3, 8, [3, 1, 33], [19, 40, 33]),      # prefix-cached chunk, a decode, a fresh prompt
    (8, 4, [17, 1, 1], [32, 33, 31]),      # ends at k*bs, k*bs+1, k*bs-1
    (1, 32, [5, 30], [69, 64]),            # MHA, big blocks, chunk ending on a block edge
])
def test_fp32_matches_reference(group, bs, query_lens, seq_lens, device, paged_cache, close):
    hkv, d = 2, 64
    cache = paged_cache(seq_lens, bs, hkv, d, torch.float32)
    out, ref = _run(cache, query_lens, group * hkv, d, torch.float32, device, seed=sum(seq_lens))
    close(out, ref, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_head_dim_128(dtype, device, paged_cache, close):
    cache = paged_cache([40, 7], 16, 2, 128, dtype)
    out, ref = _run(cache, [24, 1], 8, 128, dtype, device)
    assert out.dtype == dtype
    close(out, ref, dtype)


def test_long_query_spans_several_tiles(device, paged_cache, close):
    """70 new tokens after 30 cached ones: several query tiles, both key loops, GQA 4."""
    cache = paged_cache([100], 16, 1, 64, torch.float32)
    out, ref = _run(cache, [70], 4, 64, torch.float32, device)
    close(out, ref, torch.float32)


def test_strided_q_from_fused_projection(device, paged_cache, close):
    hq, hkv, d = 4, 2, 64
    cache = paged_cache([12, 9], 8, hkv, d, torch.float32)
    qkv = torch.randn(10, (hq + 2 * hkv) * d, device=device)
    q = qkv[:, : hq * d].view(10, hq, d)
    out, ref = _run(cache, [7, 3], hq, d, torch.float32, device, q=q)
    close(out, ref, torch.float32)


def test_decode_rows_match_decode_kernel(device, paged_cache, close):
    """An all-decode batch through the prefill kernel equals the decode kernel."""
    from pdserve.kernels.ops import paged_decode_attention

    cache = paged_cache([9, 40, 16], 8, 2, 64, torch.float32)
    q = torch.randn(3, 6, 64, device=device)
    out, _ = _run(cache, [1, 1, 1], 6, 64, torch.float32, device, q=q)
    dec = paged_decode_attention(q, cache.k, cache.v, cache.block_tables, cache.seq_lens,
                                 64 ** -0.5, num_splits=2)
    close(out, dec, torch.float32)


def test_bad_arguments_name_the_field(device, paged_cache):
    cache = paged_cache([8, 8], 8, 2, 64, torch.float32)
    q = torch.randn(10, 4, 64, device=device)
    qsl = torch.tensor([0, 5, 10], dtype=torch.int32, device=device)
    args = (cache.k, cache.v, qsl, cache.seq_lens, cache.block_tables)
    with pytest.raises(ValueError, match="max_query_len"):
        paged_prefill_attention(q, *args, 0, 0.125)
    with pytest.raises(TypeError, match="query_start_loc"):
        paged_prefill_attention(q, cache.k, cache.v, qsl.long(), cache.seq_lens,
                                cache.block_tables, 5, 0.125)
    with pytest.raises(ValueError, match="query_start_loc: needs at least 2"):
        paged_prefill_attention(q, cache.k, cache.v, qsl[:1], cache.seq_lens[:0],
                                cache.block_tables[:0], 5, 0.125)
    with pytest.raises(ValueError, match="block_tables"):
        paged_prefill_attention(q, cache.k, cache.v, qsl, cache.seq_lens,
                                cache.block_tables[:1], 5, 0.125)
    with pytest.raises(TypeError, match="k_cache: dtype"):
        paged_prefill_attention(q.bfloat16(), *args, 5, 0.125)


def test_heads_outer_views_give_the_same_result(device, paged_cache):
    """A heads-outer copy [NB, Hkv, L, 2, BS, D] of the cache (docs/tensor_parallel.md): its
    views [NB, BS, Hkv, D] have a head stride of a whole head region; bitwise the same."""
    hkv, group, d = 3, 2, 64
    cache = paged_cache([19, 40, 33], 8, hkv, d, torch.bfloat16)
    ho = cache.kv.permute(0, 4, 1, 2, 3, 5).contiguous()
    want, _ = _run(cache, [3, 1, 33], group * hkv, d, torch.bfloat16, device, seed=4)
    cache.k, cache.v = ho[:, :, 1, 0].transpose(1, 2), ho[:, :, 1, 1].transpose(1, 2)
    out, _ = _run(cache, [3, 1, 33], group * hkv, d, torch.bfloat16, device, seed=4)
    assert torch.equal(out, want)

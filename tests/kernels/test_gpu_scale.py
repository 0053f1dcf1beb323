"""Compiled kernels at 8B-model shapes and long contexts (CUDA only; the interpreter would take
minutes). Correctness against the references; speed lives in `python -m kernels.bench`."""
from __future__ import annotations

import pytest
import torch

from kernels import paged_decode_attention, paged_prefill_attention
from kernels.reference import paged_attention_ref

pytestmark = pytest.mark.gpu
HQ, HKV, D = 32, 8, 128


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_long_context(dtype, paged_cache, close):
    cache = paged_cache([10_000, 4097, 1], 16, HKV, D, dtype)
    q = torch.randn(3, HQ, D, device="cuda", dtype=dtype)
    qsl = torch.arange(4, dtype=torch.int32, device="cuda")
    want = paged_attention_ref(q, cache.k, cache.v, qsl, cache.seq_lens, cache.block_tables,
                               D ** -0.5)
    for splits in (None, 1, 64):
        out = paged_decode_attention(q, cache.k, cache.v, cache.block_tables, cache.seq_lens,
                                     D ** -0.5, num_splits=splits)
        close(out, want, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_chunk_over_prefix_mixed_with_decodes(dtype, paged_cache, close):
    """A 2000-token chunk after 3000 cached tokens, a fresh 777-token prompt, two decodes."""
    query_lens, seq_lens = [2000, 777, 1, 1], [5000, 777, 9000, 16]
    cache = paged_cache(seq_lens, 16, HKV, D, dtype)
    T = sum(query_lens)
    q = torch.randn(T, HQ, D, device="cuda", dtype=dtype)
    qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32,
                       device="cuda")
    out = paged_prefill_attention(q, cache.k, cache.v, qsl, cache.seq_lens, cache.block_tables,
                                  max(query_lens), D ** -0.5)
    want = paged_attention_ref(q, cache.k, cache.v, qsl, cache.seq_lens, cache.block_tables,
                               D ** -0.5)
    close(out, want, dtype)


def test_decode_under_cuda_graph_replay(paged_cache, close):
    """Captured once, replayed after seq_lens grow: split ranges come from device data."""
    cache = paged_cache([3000, 50], 16, HKV, D, torch.bfloat16)
    q = torch.randn(2, HQ, D, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor([100, 10], dtype=torch.int32, device="cuda")
    paged_decode_attention(q, cache.k, cache.v, cache.block_tables, lens, D ** -0.5)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention(q, cache.k, cache.v, cache.block_tables, lens, D ** -0.5)
    qsl = torch.arange(3, dtype=torch.int32, device="cuda")
    for new_lens in ([100, 10], [2999, 50], [1, 33]):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        graph.replay()
        want = paged_attention_ref(q, cache.k, cache.v, qsl, lens, cache.block_tables,
                                   D ** -0.5)
        close(out, want, torch.bfloat16)

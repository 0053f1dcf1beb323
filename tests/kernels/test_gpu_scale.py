"""Compiled kernels at 8B-model shapes and long contexts (CUDA only; the interpreter would take
minutes). Correctness against the references; speed lives in `python -m bench.lab.kernel_bench`."""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels.ops import paged_decode_attention, paged_prefill_attention
from pdserve.kernels.reference import paged_attention_ref

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


def test_fresh_prefill_sdpa_matches_the_paged_kernel(paged_cache, close):
    """The SDPA path the backend takes for one fresh 3001-token prompt (blocks scattered in the
    cache, last block partial) computes what the paged Triton kernel does."""
    from pdserve.engine.model import sdpa_prefill
    from pdserve.engine.model.attention import AttentionMetadata
    from pdserve.engine.model.triton_attention import TritonAttentionBackend

    S, dtype = 3001, torch.bfloat16
    cache = paged_cache([S], 16, HKV, D, dtype)
    q = torch.randn(S, HQ, D, device="cuda", dtype=dtype)
    qsl = torch.tensor([0, S], dtype=torch.int32, device="cuda")
    meta = AttentionMetadata(slot_mapping=torch.zeros(S, dtype=torch.int64, device="cuda"),
                             query_start_loc=qsl, seq_lens=cache.seq_lens,
                             block_tables=cache.block_tables, max_query_len=S, max_seq_len=S,
                             query_lens_cpu=[S], seq_lens_cpu=[S], block_size=16)
    assert sdpa_prefill.applies(q, meta)
    backend = TritonAttentionBackend()
    got = backend.attend(q, cache.k, cache.v, meta, D ** -0.5)
    assert backend.fresh_prefill_sdpa  # the SDPA path ran (it switches itself off on failure)
    want = paged_prefill_attention(q, cache.k, cache.v, qsl, cache.seq_lens, cache.block_tables,
                                   S, D ** -0.5)
    close(got, want, dtype)


@pytest.mark.parametrize("T", [1, 2, 4])
def test_gemv_at_8b_shapes(T, close):
    """The decode GEMVs at Qwen3-8B's widest shapes (tiles from pick_config, not the
    interpreter's), against the fp32 reference."""
    from pdserve.kernels.ops import gemv
    from pdserve.kernels.reference import gemv_ref

    for N, K, prologue in ((6144, 4096, "norm"), (4096, 12288, "silu"), (151936, 4096, "none")):
        k_in = 2 * K if prologue == "silu" else K
        x = torch.randn(T, k_in, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        kw = ({"residual": torch.randn_like(x), "norm_weight": torch.rand(K, device="cuda",
               dtype=torch.bfloat16)} if prologue == "norm" else {})
        got, want = gemv(x, w, prologue, **kw), gemv_ref(x, w, prologue, **kw)
        if prologue == "norm":
            close(got[1], want[1], torch.bfloat16)
            got, want = got[0], want[0]
        close(got, want, torch.bfloat16)

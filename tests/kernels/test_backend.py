"""TritonAttentionBackend is a drop-in for the engine's TorchAttentionBackend."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine.model.attention import AttentionBackend, TorchAttentionBackend, make_metadata
from pdserve.engine.model.triton_attention import TritonAttentionBackend

HQ, HKV, D, BS = 6, 2, 64, 8


def test_both_backends_implement_the_attention_backend_protocol() -> None:
    assert isinstance(TorchAttentionBackend(), AttentionBackend)
    assert isinstance(TritonAttentionBackend(), AttentionBackend)
    assert not isinstance(object(), AttentionBackend)


def _step(query_lens, seq_lens, device, seed):
    """Metadata over scattered blocks, plus new q/k/v for the step's tokens."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // BS) for s in seq_lens) + 4
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for s in seq_lens:
        n = -(-s // BS)
        tables.append(order[used:used + n])
        used += n
    meta = make_metadata(query_lens, seq_lens, tables, BS, device=device)
    T = sum(query_lens)
    q, k, v = (torch.randn(T, h, D, generator=gen).to(device) for h in (HQ, HKV, HKV))
    kv = torch.randn(num_blocks, 2, 2, BS, HKV, D, generator=gen).to(device)
    return meta, q, k, v, kv


@pytest.mark.parametrize("query_lens,seq_lens", [
    ([1, 1, 1], [1, 17, 40]),       # decode-only: the split-K decode kernel
    ([5, 1, 3], [5, 20, 11]),       # mixed: prompt, decode, prefix-cached chunk
])
def test_matches_torch_backend(query_lens, seq_lens, device, close):
    meta, q, k, v, kv = _step(query_lens, seq_lens, device, seed=len(seq_lens) + seq_lens[0])
    kv_ref = kv.clone()
    torch_be, triton_be = TorchAttentionBackend(), TritonAttentionBackend()
    triton_be.write_kv(k, v, kv[:, 1, 0], kv[:, 1, 1], meta)
    torch_be.write_kv(k, v, kv_ref[:, 1, 0], kv_ref[:, 1, 1], meta)
    assert torch.equal(kv, kv_ref)
    out = triton_be.attend(q, kv[:, 1, 0], kv[:, 1, 1], meta, D ** -0.5)
    want = torch_be.attend(q, kv_ref[:, 1, 0], kv_ref[:, 1, 1], meta, D ** -0.5)
    close(out, want, torch.float32)


def test_model_forward_prefill_then_decode(device, close):
    from pdserve.engine.core.config import ModelConfig
    from pdserve.engine.exec.kv_cache import allocate_kv_cache
    from pdserve.engine.model.decoder import Model

    cfg = ModelConfig(arch="qwen3", vocab_size=50, hidden_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=32, intermediate_size=96, qk_norm=True)
    torch.manual_seed(0)
    ref_model = Model(cfg).to(device)
    tri_model = Model(cfg, backend=TritonAttentionBackend()).to(device)
    tri_model.load_state_dict(ref_model.state_dict())
    kv_ref = allocate_kv_cache(cfg, 8, BS, torch.float32, device)  # the engine's layout
    kv_tri = allocate_kv_cache(cfg, 8, BS, torch.float32, device)
    tables = [[3, 0], [5, 1, 6]]
    steps = [([7, 11], [7, 11]), ([1, 1], [8, 12])]  # prefill both, then one decode step
    for query_lens, seq_lens in steps:
        meta = make_metadata(query_lens, seq_lens, tables, BS, device=device)
        ids = torch.randint(0, cfg.vocab_size, (sum(query_lens),), device=device)
        positions = torch.cat([torch.arange(s - n, s) for n, s in zip(query_lens, seq_lens)])
        positions = positions.to(device)
        with torch.no_grad():
            want = ref_model(ids, positions, meta, kv_ref)
            got = tri_model(ids, positions, meta, kv_tri)
        close(got, want, torch.float32)
    close(kv_tri, kv_ref, torch.float32)


def test_uniform_steps_take_the_decode_kernel_only_up_to_verify_rows(device) -> None:
    """Each rows-per-sequence R is a decode-kernel compile of its own (engine/exec/warmup.py):
    equally long prompts of a plain engine take the prefill kernel, MTP's k + 1 the decode
    kernel; the engine sizes verify_rows from the speculative config."""
    from pdserve.engine.llm import LLM
    from pdserve.engine.model.triton_attention import _uniform_rows

    meta, q, _, _, kv = _step([3, 3], [9, 14], device, seed=4)
    k_cache = kv[:, 0, 0]
    assert _uniform_rows(q, k_cache, meta, TritonAttentionBackend().verify_rows) == 0
    assert _uniform_rows(q, k_cache, meta, TritonAttentionBackend(verify_rows=3).verify_rows) == 3
    decode = make_metadata([1, 1], [9, 14], [[0, 1], [2, 3]], BS, device=device)
    assert _uniform_rows(q[:2], k_cache, decode, 1) == 1
    llm = LLM("tiny-qwen3", device="cpu", use_triton=True, speculative="mtp",
              num_speculative_tokens=2, num_blocks=64)
    assert llm.engine.runner.model.layers[0].self_attn.backend.verify_rows == 3

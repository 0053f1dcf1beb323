"""Our Model over the paged KV cache vs transformers' own Llama / Qwen3 (fp32, CPU).

Each tiny HF model is saved with save_pretrained and loaded back through our HF-folder loader,
then driven the way the engine drives it: varlen batches, chunked prefill, prefix-cache hits,
decode steps, with shuffled (non-contiguous) block tables and block_size 4 so every sequence
crosses block boundaries. Logits must match HF's full-sequence logits within 1e-4.
"""
from __future__ import annotations

import pytest
import torch

from pdserve.engine.model.weights import load_hf

from tests.engine import hf_families

transformers = pytest.importorskip("transformers")

BLOCK = 4
NUM_BLOCKS = 32
TOL = 1e-4
VOCAB = 96


def _llama(tie: bool, scaled: bool, **shape: int) -> transformers.PretrainedConfig:
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if scaled:  # original context 64 puts head dims in all three Llama-3 bands (kept/blended/divided)
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}
    return transformers.LlamaConfig(
        vocab_size=VOCAB, num_hidden_layers=2, rms_norm_eps=1e-5, tie_word_embeddings=tie,
        rope_parameters=rope, max_position_embeddings=512, **shape)


CONFIGS = {
    "llama-gqa-llama3-untied": lambda: _llama(
        tie=False, scaled=True, hidden_size=64, intermediate_size=160, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16),
    "llama-mqa-tied": lambda: _llama(
        tie=True, scaled=False, hidden_size=48, intermediate_size=96, num_attention_heads=6,
        num_key_value_heads=1, head_dim=8),
    "qwen3-qknorm": lambda: transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
        tie_word_embeddings=False, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(hf_model, our_model): the same random weights, ours loaded from HF's saved folder."""
    torch.manual_seed(0)
    hf_cfg = CONFIGS[request.param]()
    hf_cfg._attn_implementation = "eager"
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval()
    with torch.no_grad():  # O(1) weights and non-trivial norms, so a wrong op shows in the logits
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    ours, cfg = load_hf(folder)
    assert cfg.tie_word_embeddings == hf_cfg.tie_word_embeddings
    return hf, ours


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]  # [len, vocab]


class Paged(hf_families.Paged):
    """hf_families.Paged, also checking that the final norm of the pre-norm hidden state is
    the hidden state, and that logits are float32."""

    def __init__(self, model) -> None:
        super().__init__(model, NUM_BLOCKS)

    def logits(self, ids: torch.Tensor, pos: torch.Tensor, meta) -> torch.Tensor:
        hidden, prenorm = self.model(ids, pos, meta, self.kv, return_prenorm=True)
        torch.testing.assert_close(self.model.norm(prenorm), hidden)
        logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32
        return logits


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def assert_match(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ref.abs().max() > 1.0  # the comparison means something
    diff = (ours - ref).abs().max().item()
    assert diff <= TOL, f"max abs diff {diff:.2e}"


def test_batched_prefill(pair) -> None:
    hf, ours = pair
    prompts = [prompt(5, 1), prompt(11, 2), prompt(8, 3)]
    tables = [[7, 2], [12, 0, 9], [3, 15]]  # shuffled, not contiguous
    out = Paged(ours).step([(p, 0, t) for p, t in zip(prompts, tables)])
    for p, logits in zip(prompts, out):
        assert_match(logits, hf_logits(hf, p))


def test_chunked_prefill_mixed_with_decode(pair) -> None:
    """A 13-token prompt in chunks of 5, 4, 4 while another sequence decodes beside it."""
    hf, ours = pair
    run = Paged(ours)
    a, b = prompt(13, 4), prompt(6, 5)
    table_a, table_b = [9, 3, 14, 6], [11, 1, 20]
    ref_a = hf_logits(hf, a)
    got_a = run.step([(a[:5], 0, table_a), (b, 0, table_b)])
    assert_match(got_a[1], hf_logits(hf, b))
    got_a = [got_a[0]]
    for start, end in ((5, 9), (9, 13)):
        b.append(prompt(1, 100 + start)[0])
        out = run.step([(a[start:end], start, table_a), (b[-1:], len(b) - 1, table_b)])
        got_a.append(out[0])
        assert_match(out[1], hf_logits(hf, b)[-1:])
    assert_match(torch.cat(got_a), ref_a)


def test_prefix_cache_hit(pair) -> None:
    """B shares A's first two blocks: only B's suffix is computed, over A's cached KV."""
    hf, ours = pair
    run = Paged(ours)
    a = prompt(12, 6)
    run.step([(a, 0, [5, 2, 8])])
    b = a[:8] + prompt(5, 7)
    out = run.step([(b[8:], 8, [5, 2, 10, 7])])[0]
    assert_match(out, hf_logits(hf, b)[8:])
    # a cached context that ends mid-block: C reuses A's first 6 tokens (block 8 copied aside)
    run.kv[17].copy_(run.kv[2])
    c = a[:6] + prompt(3, 8)
    out = run.step([(c[6:], 6, [5, 17, 4])])[0]
    assert_match(out, hf_logits(hf, c)[6:])


def test_decode_steps(pair) -> None:
    hf, ours = pair
    run = Paged(ours)
    seqs = [prompt(3, 9), prompt(7, 10), prompt(5, 11)]
    tables = [[4, 13], [8, 1, 22, 6], [19, 2, 30]]
    run.step([(s, 0, t) for s, t in zip(seqs, tables)])
    g = torch.Generator().manual_seed(12)
    for _ in range(5):
        for s in seqs:
            s.append(int(torch.randint(0, VOCAB, (), generator=g)))
        out = run.step([(s[-1:], len(s) - 1, t) for s, t in zip(seqs, tables)])
        for s, logits in zip(seqs, out):
            assert logits.shape == (1, VOCAB)
            assert_match(logits, hf_logits(hf, s)[-1:])


def test_tied_head_shares_embedding(pair) -> None:
    hf, ours = pair
    tied = ours.config.tie_word_embeddings
    assert (ours.lm_head.weight is ours.embed_tokens.weight) == tied
    torch.testing.assert_close(ours.lm_head.weight, hf.lm_head.weight, rtol=0, atol=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_reserved_rope_table_gives_the_computed_rows(device) -> None:
    """RotaryEmbedding.reserve: cos_sin becomes a gather from a table; the rows equal the
    direct computation (bit for bit on CUDA, where the engine uses the table) and are
    [T, D/2] views with contiguous last dims, as the kernels require."""
    from pdserve.engine.core.config import RopeScaling
    from pdserve.engine.model.layers import RotaryEmbedding

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    rope = RotaryEmbedding(64, 10000.0, RopeScaling(factor=8.0,
                                                   original_max_position_embeddings=64))
    positions = torch.tensor([0, 5, 63, 64, 700, 1023], device=device)
    want_cos, want_sin = rope.cos_sin(positions)
    rope.reserve(1024, torch.device(device))
    cos, sin = rope.cos_sin(positions)
    assert cos.shape == sin.shape == (6, 32) and cos.stride(-1) == sin.stride(-1) == 1
    if device == "cuda":
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    else:
        torch.testing.assert_close(cos, want_cos, rtol=0, atol=1e-6)
        torch.testing.assert_close(sin, want_sin, rtol=0, atol=1e-6)

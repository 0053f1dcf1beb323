"""MTP drafting over a reduced vocabulary (SpecConfig.draft_vocab, MTPHead.use_draft_vocab) on
the tiny random Qwen3 (CPU): drafts stay inside the draft ids, verification is unchanged (greedy
output equals non-speculative decoding, with partial acceptance and in both drafting paths),
and the draft head's logits are the target head's at those ids."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.engine.core.config import ConfigError, SpecConfig
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.llm import LLM

TINY = dict(device="cpu", block_size=4, num_blocks=256)
PROMPTS = [[5 + i, 17, 99, 3 * i + 1, 42] * (i + 1) for i in range(4)]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
DRAFT_VOCAB = 100  # of the tiny model's 512 ids (its EOS, 2, is among them)


def tokens(results) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in results]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return tokens(LLM("tiny-qwen3", **TINY).generate(PROMPTS, GREEDY))


def use_oracle(llm: LLM, outputs: list[list[int]]) -> None:
    """Replace the drafts (after the reduced head made them) with the reference continuation,
    right for the first draft and wrong after it: partial acceptance, rollback exercised."""
    runner, real = llm.engine.runner, llm.engine.runner.run
    full = {tuple(p): p + o for p, o in zip(PROMPTS, outputs)}

    def run(out, *args, **kw):
        result = real(out, *args, **kw)
        for s in out.scheduled:
            d = result.drafts.get(s.request.request_id)
            if d:
                seq = full[tuple(s.request.prompt_token_ids)]
                base = s.request.num_tokens + len(result.sampled[s.request.request_id])
                result.drafts[s.request.request_id] = [
                    seq[base] if i == 0 else (seq[base + i] + 1) % 512 for i in range(len(d))]
        return result

    runner.run = run


def dv_llm(k: int, draft_graphs: str, draft_vocab: int = DRAFT_VOCAB) -> LLM:
    spec = SpecConfig(num_speculative_tokens=k, batch_k_caps=(), draft_graphs=draft_graphs,
                      draft_vocab=draft_vocab)
    return LLM("tiny-qwen3", speculative=spec, **TINY)


def _log_drafts(llm: LLM) -> list[int]:
    """Every draft token the head proposes, recorded before use_oracle may replace them."""
    runner, seen = llm.engine.runner, []
    real = runner.run

    def run(out, *args, **kw):
        result = real(out, *args, **kw)
        for d in result.drafts.values():
            seen.extend(d)
        return result

    runner.run = run
    return seen


@pytest.mark.parametrize("k,draft_graphs", [(1, "off"), (3, "off"), (1, "on"), (3, "on")])
def test_greedy_output_unchanged_and_drafts_in_the_set(k: int, draft_graphs: str,
                                                       reference: list[list[int]]) -> None:
    llm = dv_llm(k, draft_graphs)
    drafts = _log_drafts(llm)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == reference
    assert len(drafts) > 20 and max(drafts) < DRAFT_VOCAB
    # partial acceptance (oracle drafts, the reduced head still runs first): still exact
    llm = dv_llm(k, draft_graphs)
    use_oracle(llm, reference)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == reference
    assert llm.engine.spec_stats.num_accepted_tokens > 0


def test_draft_vocab_keeps_eos_and_maps_ids() -> None:
    """Ids past the lowest N are kept for EOS; draft_greedy returns target ids and equals the
    argmax of the full logits restricted to the set; draft_logits is -inf elsewhere."""
    llm = LLM("tiny-qwen3", speculative=SpecConfig(draft_vocab=0), **TINY)
    head, model = llm.engine.runner.spec.head, llm.engine.runner.model
    assert head.draft_ids is None
    head.use_draft_vocab(model, 50, keep=(2, 400, 511))
    ids = head.draft_ids.tolist()
    assert ids == list(range(48)) + [400, 511] and len(ids) == 50
    hidden = torch.randn(7, model.config.hidden_size)
    hidden[0] = 10 * model.lm_head.weight[400].detach()  # its logit at id 400 stands out
    with torch.inference_mode():
        full = model.compute_logits(hidden)
        sub = head.draft_logits(model, hidden)
        greedy = head.draft_greedy(model, hidden)
    # the same dot products (a narrower matmul may round differently in the last ulp)
    torch.testing.assert_close(sub[:, ids], full[:, ids], rtol=1e-5, atol=1e-6)
    outside = torch.ones(512, dtype=torch.bool)
    outside[ids] = False
    assert torch.isinf(sub[:, outside]).all() and (sub[:, outside] < 0).all()
    assert greedy.tolist() == sub.argmax(dim=-1).tolist()
    assert set(greedy.tolist()) <= set(ids) and greedy[0] == 400  # target ids, not indices
    head.use_draft_vocab(model, 0)  # back to the full head
    assert head.draft_ids is None


def test_random_sampling_drafts_from_the_set() -> None:
    """Sampled drafts come from the reduced distribution (never outside the set), and the
    emitted tokens still reach ids outside it (the target samples those)."""
    params = dataclasses.replace(GREEDY, temperature=1.0, seed=5, max_tokens=40)
    llm = dv_llm(2, "auto")
    drafts = _log_drafts(llm)
    out = [t for r in llm.generate(PROMPTS, params) for t in r.outputs[0].token_ids]
    assert drafts and max(drafts) < DRAFT_VOCAB
    assert max(out) >= DRAFT_VOCAB


def test_draft_vocab_validation_names_the_field() -> None:
    with pytest.raises(ConfigError, match="draft_vocab"):
        SpecConfig(draft_vocab=-1)
    with pytest.raises(ConfigError, match="draft_vocab"):
        dv_llm(1, "auto", draft_vocab=513)  # the tiny model has 512 ids
    with pytest.raises(ConfigError, match="draft_vocab"):
        LLM("tiny-qwen3", draft_vocab=64, **TINY)  # without speculation


def test_fused_path_drafts_in_the_set(reference: list[list[int]]) -> None:
    """The Triton path (interpreter here; GEMV LM head over the draft rows, argmax kernel, the
    device-side acceptance) gives the same greedy output with drafts inside the set."""
    spec = SpecConfig(num_speculative_tokens=2, batch_k_caps=(), draft_graphs="on",
                      draft_vocab=DRAFT_VOCAB)
    llm = LLM("tiny-qwen3", speculative=spec, use_triton=True, **TINY)
    drafts = _log_drafts(llm)
    # one prompt, 12 tokens: the interpreter runs every kernel of the model (~6 s a step)
    short = dataclasses.replace(GREEDY, max_tokens=12)
    assert tokens(llm.generate(PROMPTS[1:2], short)) == [reference[1][:12]]
    assert drafts and max(drafts) < DRAFT_VOCAB


@pytest.mark.gpu
def test_draft_vocab_under_cuda_graphs() -> None:
    """Triton kernels + CUDA graphs (drafting and verify replayed): same greedy output as plain
    decoding, drafts inside the set, and the drafting graphs replayed."""
    kw = dict(device="cuda", dtype="float32", block_size=16, num_blocks=256, max_num_seqs=8,
              use_triton=True, use_cuda_graphs=True)
    ref = tokens(LLM("tiny-qwen3", **kw).generate(PROMPTS, GREEDY))
    spec = SpecConfig(num_speculative_tokens=2, batch_k_caps=(), draft_vocab=DRAFT_VOCAB)
    llm = LLM("tiny-qwen3", speculative=spec, **kw)
    drafts = _log_drafts(llm)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == ref
    assert drafts and max(drafts) < DRAFT_VOCAB
    assert llm.engine.runner.spec.draft_graphs.replays > 0

"""MTP with the trained head of the default model, SmolLM2-135M-Instruct (CPU, float32).

The head (engine/mtp_heads/smollm2-135m-instruct.safetensors) comes from `pdserve train-mtp`;
the acceptance test uses prompts from templates and topics its training never saw.
"""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from pdserve.engine.core.config import SpecConfig
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.llm import LLM, build_engine
from pdserve.engine.spec.mtp_head import HEADS_DIR
from pdserve.engine.train_mtp import chat, heldout_prompts, training_prompts
from pdserve.worker.metrics import WorkerMetrics

CPU = dict(device="cpu", dtype="float32", num_blocks=512, max_num_batched_tokens=1024)
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
RAW = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]


def spec_llm(k: int) -> LLM:
    return LLM(speculative=SpecConfig(num_speculative_tokens=k, batch_k_caps=()), **CPU)


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(**CPU)


@pytest.fixture(scope="module")
def prompts(plain: LLM) -> list[list[int]]:
    msgs = training_prompts(2, seed=5) + heldout_prompts(2)
    return [chat(plain.tokenizer, m) for m in msgs] + [plain.tokenizer.encode(p) for p in RAW]


@pytest.fixture(scope="module")
def expected(plain: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in plain.generate(prompts, GREEDY)]


def test_trained_head_is_shipped() -> None:
    path = HEADS_DIR / "smollm2-135m-instruct.safetensors"
    assert path.is_file() and path.stat().st_size < 16 << 20


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_equals_plain_decoding(k: int, prompts, expected) -> None:
    llm = spec_llm(k)
    got = [r.outputs[0].token_ids for r in llm.generate(prompts, GREEDY)]
    assert got == expected
    assert llm.engine.spec_stats.num_accepted_tokens > 0


def _stop_past_the_middle(text: str) -> str | None:
    """A 5-character stop string starting at a space past the middle of `text` that does not
    occur earlier in it (repetitive answers may have none)."""
    for i in range(len(text) // 2, len(text) - 5):
        if text[i] == " " and text.find(text[i:i + 5]) == i:
            return text[i:i + 5]
    return None


def test_stop_string_inside_a_multi_token_step(plain: LLM, prompts) -> None:
    """Several tokens accepted in one step: the tokens after the stop string are dropped, as
    one-token steps would have stopped there."""
    for prompt in prompts:  # the first whose greedy answer has a stop string past its middle
        [ref] = plain.generate(prompt, GREEDY)
        stop = _stop_past_the_middle(ref.outputs[0].text)
        if stop is not None:
            break
    assert stop is not None
    params = SamplingParams(max_tokens=40, temperature=0.0, stop=[stop])
    [want] = plain.generate(prompt, params)
    llm = spec_llm(3)
    [got] = llm.generate(prompt, params)
    assert want.outputs[0].finish_reason == "stop"
    assert (got.outputs[0].text, got.outputs[0].token_ids, got.outputs[0].finish_reason) == (
        want.outputs[0].text, want.outputs[0].token_ids, want.outputs[0].finish_reason)
    assert llm.engine.spec_stats.num_accepted_tokens > 0


def _heldout_acceptance(k: int) -> tuple[float, float, float]:
    """Greedy decoding of held-out chat prompts; read back through the Prometheus counters.
    Returns (first-draft acceptance, overall acceptance, mean accepted length)."""
    llm = spec_llm(k)
    msgs = heldout_prompts(16)
    llm.generate([chat(llm.tokenizer, m) for m in msgs],
                 SamplingParams(max_tokens=64, temperature=0.0))
    reg = CollectorRegistry()
    WorkerMetrics(reg, "decode", "d0").refresh(llm.engine)
    lb = {"role": "decode", "worker": "d0"}

    def value(name: str, **extra: str) -> float:
        return reg.get_sample_value(f"pdserve:spec_decode_{name}_total", {**lb, **extra})

    drafts, tokens, accepted = value("num_drafts"), value("num_draft_tokens"), \
        value("num_accepted_tokens")
    first = value("num_accepted_tokens_per_pos", position="0")
    return first / drafts, accepted / tokens, 1 + accepted / drafts


def test_heldout_first_draft_acceptance_at_k1() -> None:
    first, overall, mean_len = _heldout_acceptance(1)
    print(f"\nk=1 held-out: first-draft acceptance {first:.3f}, mean accepted length "
          f"{mean_len:.3f}")
    # issue 6's line: >= 60% of first drafts accepted on prompts train-mtp never saw (the
    # committed head, trained on an H100, measured 61.4% there; engine/mtp_heads/*.json)
    assert first >= 0.60


def test_heldout_mean_accepted_length_at_k3() -> None:
    first, overall, mean_len = _heldout_acceptance(3)
    print(f"\nk=3 held-out: first-draft acceptance {first:.3f}, acceptance {overall:.3f}, "
          f"mean accepted length {mean_len:.3f} tokens per step")
    assert mean_len > 1.0 + first  # later drafts add to the first


def test_disaggregated_greedy_equals_plain(prompts, expected) -> None:
    from test_spec_decode_disagg import disagg_greedy, workers

    spec = SpecConfig(num_speculative_tokens=2, batch_k_caps=())
    kw = {k: v for k, v in CPU.items() if k != "max_num_batched_tokens"}
    p_engine = build_engine(None, speculative=spec, **kw)
    d_engine = build_engine(None, speculative=spec, **kw)
    with workers(p_engine, d_engine) as (P, D, ps, ds, reply):
        assert reply.accepted, reply.reason
        for i in (0, 3):
            assert disagg_greedy(ps, ds, f"s{i}", prompts[i], GREEDY.max_tokens) == expected[i]
        assert D.engine.spec_stats.num_accepted_tokens > 0

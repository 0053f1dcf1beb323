"""Overlapped decode (engine/exec/overlap.py): launching the next forward before the host reads the
sampled tokens must never change an output, and must actually serve steps."""
from __future__ import annotations

import pytest

from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.llm import LLM

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at",
           "Once upon a time, in a land far away,"]


def _params() -> list[SamplingParams]:
    """Requests that end at different steps and for different reasons (length, EOS, a stop
    string), greedy and seeded random: each end changes the batch and discards a launch."""
    return [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=40, temperature=0.0),
            SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=7, stop=[" the"]),
            SamplingParams(max_tokens=17, temperature=1.0, seed=3, ignore_eos=True,
                           presence_penalty=0.5)]


@pytest.fixture(scope="module")
def runs() -> tuple[list, list, LLM]:
    kw = dict(device="cpu", dtype="float32", max_num_batched_tokens=256)
    off = LLM(overlap_decode="off", **kw)
    on = LLM(overlap_decode="on", **kw)
    return off.generate(PROMPTS, _params()), on.generate(PROMPTS, _params()), on


def test_overlap_outputs_equal(runs) -> None:
    base, overlapped, _ = runs
    for a, b in zip(base, overlapped):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason


def test_overlap_serves_steps_and_discards_on_batch_change(runs) -> None:
    _, _, on = runs
    ahead = on.engine.runner.ahead
    assert ahead is not None
    assert ahead.hits > 20  # most decode steps came from a forward launched ahead
    # requests ending on a stop string / EOS (unseen until the tokens are read) discard one
    assert ahead.discards >= 1


def test_overlap_auto_is_off_without_graphs_and_bad_value_named() -> None:
    from pdserve.engine.core.config import ConfigError, EngineConfig
    from pdserve.engine.model.presets import get_preset

    llm = LLM(device="cpu", dtype="float32")
    assert llm.engine.runner.ahead is None  # "auto" on CPU: no graphs, no overlap
    with pytest.raises(ConfigError, match="overlap_decode"):
        EngineConfig(model=get_preset("qwen3-0.6b"), overlap_decode="sometimes")


def test_overlap_holds_with_requests_at_every_block_offset() -> None:
    """16 requests whose positions cover every offset in a 16-token block: every step one of
    them crosses into a new block. The launch needs the next position's block already, so
    the scheduler reserves it (one lookahead slot); without it no step was launched ahead."""
    llm = LLM(device="cpu", dtype="float32", overlap_decode="on", block_size=16,
              max_num_batched_tokens=512)
    engine = llm.engine
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for n in range(16):
        engine.add_request([7 + i % 50 for i in range(20 + n)], params)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    ahead = engine.runner.ahead
    # one prefill step, 23 decode steps; the last one has nothing to launch after it
    assert ahead.hits >= steps - 3, (ahead.hits, ahead.discards, steps)


def _arrivals(overlap: str) -> tuple[dict[str, list[int]], dict[str, int], object]:
    """Two requests decode; two more arrive while they do (as in serving). Returns each
    request's tokens, the step each newcomer got its first token, and the engine."""
    llm = LLM(device="cpu", dtype="float32", overlap_decode=overlap,
              max_num_batched_tokens=256)
    engine = llm.engine
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    first: dict[str, int] = {}
    added: dict[str, int] = {}
    for i in range(2):
        engine.add_request([11 + i] * (9 + 5 * i), params, request_id=f"a{i}")
    step = 0
    while engine.has_unfinished():
        if step in (4, 7):
            rid = f"late{step}"
            engine.add_request([23] * (6 + step), params, request_id=rid)
            added[rid] = step
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.new_token_ids and out.request_id in added:
                first.setdefault(out.request_id, step - added[out.request_id])
        step += 1
    return tokens, first, engine


def test_arrivals_during_overlapped_decode_join_a_step_later_with_equal_outputs() -> None:
    base, _, _ = _arrivals("off")
    got, waited, engine = _arrivals("on")
    assert got == base
    # a newcomer waits out the forward launched for the batch before it: at most one step
    # (its prefill runs the step after), and that launch is used, not thrown away
    assert all(w <= 1 for w in waited.values()), waited
    assert engine.runner.ahead.discards == 0
    assert engine.runner.ahead.hits > 10

"""Overlapped decode (engine/overlap.py): launching the next forward before the host reads the
sampled tokens must never change an output, and must actually serve steps."""
from __future__ import annotations

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams

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
    from engine.config import ConfigError, EngineConfig
    from engine.presets import get_preset

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

"""The start-up warm-up (engine/exec/warmup.py) on a tiny random Qwen3 (CPU, torch path: the
workload is the same on every path; only CUDA with Triton runs it by default). It must reach
every decode batch size and a prefill over two chunks, then leave nothing behind: no
request, no cached block, no counted token, so served requests come out exactly as from an
engine that never warmed up. The GPU test (test_warmup_gpu.py) checks what it is for: no
Triton compile in a served step."""
from __future__ import annotations

import pytest

from pdserve.engine.core.config import SpecConfig
from pdserve.engine.core.engine_args import EngineArgs
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.exec import warmup
from pdserve.engine.llm import LLM

TINY = dict(device="cpu", block_size=4, num_blocks=256, max_num_seqs=6,
            max_num_batched_tokens=64, max_model_len=160)
PROMPTS = [[7, 19, 3, 88, 5] * (i + 1) for i in range(3)] + [list(range(1, 90))]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def served(llm: LLM) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    return served(LLM("tiny-qwen3", **TINY))


def test_reaches_every_batch_size_and_two_chunks_then_forgets_it(plain) -> None:
    llm = LLM("tiny-qwen3", **TINY)
    engine = llm.engine
    lengths = [len(p) for _, batch in warmup.plan(engine) for p, _ in batch]
    assert max(lengths) == 64 + 33  # one full chunk, then 33 tokens over cached context
    report = warmup.run(engine)
    assert report.complete and report.requests == len(lengths)
    assert set(range(1, 7)) <= report.batch_sizes  # max_num_seqs down to 1
    bm = engine.scheduler.block_manager
    assert not engine.has_unfinished() and bm.num_free_blocks == bm.num_blocks
    assert bm.hash_to_block == {} and bm.prefix_cache_queries == 0
    assert engine.stats.steps == 0 and engine.stats.prompt_tokens == 0
    assert served(llm) == plain
    assert bm.prefix_cache_hits == 0  # nothing of the warm-up's prompts was found


def test_forgets_its_drafts_under_mtp() -> None:
    spec = SpecConfig(num_speculative_tokens=2, batch_k_caps=((3, 2), (6, 1)))
    llm = LLM("tiny-qwen3", speculative=spec, **TINY)
    warmup.run(llm.engine)
    assert llm.engine.spec_stats.num_draft_tokens == 0
    assert served(llm) == served(LLM("tiny-qwen3", speculative=spec, **TINY))
    assert llm.engine.spec_stats.num_draft_tokens > 0


def test_refuses_a_busy_engine_and_a_spent_budget_runs_nothing() -> None:
    engine = LLM("tiny-qwen3", **TINY).engine
    report = warmup.run(engine, budget_s=0.0)
    assert (report.requests, report.steps, report.complete) == (0, 0, True)
    engine.add_request([1, 2, 3], GREEDY)
    with pytest.raises(RuntimeError, match="already has requests"):
        warmup.run(engine)


def test_only_compiled_kernels_warm_up_by_default() -> None:
    assert EngineArgs().warmup is True
    engine = LLM("tiny-qwen3", use_triton=True, **TINY).engine  # the interpreter: no compiles
    assert warmup.warm_up(engine) is None and engine.stats.steps == 0


@pytest.mark.parametrize("kw", [
    dict(max_model_len=3, max_num_batched_tokens=4, max_num_seqs=2),  # no room for a prefill
    dict(max_model_len=64, max_num_batched_tokens=16, max_num_seqs=8, num_blocks=8),  # pool < context
])
def test_fits_any_engine_it_is_given(kw) -> None:
    """Sized to the engine's limits: a context of 3 tokens, a KV pool smaller than the
    context (requests preempt each other). It completes and leaves the pool empty."""
    engine = LLM("tiny-qwen3", device="cpu", block_size=4, **{"num_blocks": 64, **kw}).engine
    report = warmup.run(engine, budget_s=120)
    bm = engine.scheduler.block_manager
    assert report.complete and not engine.has_unfinished()
    assert bm.num_free_blocks == bm.num_blocks and bm.hash_to_block == {}

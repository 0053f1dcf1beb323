"""vLLM's cache_salt through a real engine (tiny random Qwen3, CPU): a prompt served under one
salt is a prefix-cache hit only for the same salt; another salt, or none, computes it again,
and the tokens never depend on the salt."""
from __future__ import annotations

from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.llm import LLM

PROMPT = [11, 42, 7, 300, 5, 19, 77, 2] * 5  # 40 tokens: 10 full blocks of 4


def test_only_the_same_salt_hits_the_cached_prompt() -> None:
    llm = LLM("tiny-qwen3", device="cpu", block_size=4, num_blocks=128)
    bm = llm.engine.scheduler.block_manager
    outs, hits = [], []
    for salt in ("tenant-a", "tenant-b", None, "tenant-a"):
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, cache_salt=salt)
        before = bm.prefix_cache_hits
        outs.append(llm.generate([PROMPT], params)[0].outputs[0].token_ids)
        hits.append(bm.prefix_cache_hits - before)
    assert hits[:3] == [0, 0, 0] and hits[3] >= 36  # all but the last, partial-or-not block
    assert outs.count(outs[0]) == 4

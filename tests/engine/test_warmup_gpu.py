"""What the start-up warm-up is for (engine/exec/warmup.py): after an engine is built, no
served step makes Triton compile (or load) a kernel. A serving-like stream on a tiny random
Qwen3 (CUDA, Triton kernels, CUDA graphs): prompts of 1 to 700 tokens over 256-token chunks,
requests joining every few steps, so prefills of every length class, chunks over cached
context, mixed steps and decode batches of every size. Every Triton in-memory cache miss is
counted through Triton's own hook. Needs a CUDA device."""
from __future__ import annotations

import random
import traceback

import pytest

from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.llm import LLM

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


def _stream(engine, rng: random.Random, requests: int) -> int:
    steps = added = 0
    while added < requests or engine.has_unfinished():
        if added < requests and steps % 3 == 0:
            prompt = [rng.randrange(1, 500) for _ in range(rng.randint(1, 700))]
            engine.add_request(prompt, SamplingParams(max_tokens=rng.randint(1, 40),
                                                      temperature=0.0, ignore_eos=True))
            added += 1
        engine.step()
        steps += 1
    return steps


@pytest.mark.parametrize("speculative", [None, "mtp"])
def test_no_triton_compile_in_a_served_step(speculative: str | None) -> None:
    from triton import knobs

    llm = LLM("tiny-qwen3", device="cuda", use_triton=True, use_cuda_graphs=True,
              speculative=speculative, max_num_seqs=16, max_num_batched_tokens=256,
              max_model_len=1024, num_blocks=2048)
    misses: list[str] = []

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled) -> bool:
        # the kernel, its constants, and where the engine launched it from
        where = [f"{f.name}:{f.lineno}" for f in traceback.extract_stack()
                 if "/pdserve/" in f.filename or "/engine/" in f.filename][-4:]
        misses.append(f"{fn.name} {compile['constants']} from {' < '.join(reversed(where))}")
        return False

    knobs.runtime.jit_cache_hook = hook
    try:
        steps = _stream(llm.engine, random.Random(5), requests=60)
    finally:
        knobs.runtime.jit_cache_hook = None
    assert steps > 100
    assert misses == [], "\n".join(misses)

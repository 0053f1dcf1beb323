"""Start-up warm-up: run the step shapes serving will run before the engine takes a request.

Why: Triton compiles a kernel for each specialization on its first launch, and some of
ours pick constexpr tiles per step: the prefill attention's query tile follows the longest
new-token run (kernels/prefill_attention.py _tile_config), the argmax's chunks per row follow
the batch's rows, the eager LM head's GEMV its row count. CUDA graph capture compiles only the
decode forwards. On an H200 with an empty Triton cache a Qwen3-8B engine compiled 13 more
kernels in its first 180 served steps, 0.1-2.2 s each (11 s in all), each one stalling every
request in its step (`python -m bench.lab.diag_jit`, bench/results/jit_h200_2026-11-29.json);
in a disaggregated benchmark on fresh machines TTFT reached 6.6 s
(bench/results/payoff_h200x2_2026-11-29_seed1.json). A warm disk cache turns each compile
into a ~5 ms load, but every new machine, image or Triton version starts cold.

What runs, through the engine's own add_request/step (so on every TP rank, with MTP when it
is on, exactly the serving path), then is forgotten:
  1. prompts of 2, 3, 5, 9, ... 257 tokens, one at a time: each prefill tile class;
  2. fresh prompts of 1024 tokens and up, one per length class that PyTorch's SDPA runs
     (engine/model/sdpa_prefill.py padded_len: cuDNN builds a plan, ~40 ms, per length);
     then a prompt one chunk + 33 tokens long: a full chunk, then a chunk over its context;
  3. max_num_seqs short requests that end SPACING steps apart: every decode batch size from
     max_num_seqs down to 1 (the eager LM head and argmax pick tiles by rows; with MTP, every
     draft count of SpecConfig's caps).
Afterwards the prefix cache and the engine's counters are reset, so the first request
finds the engine as it would have without the warm-up. Only CUDA with Triton kernels warms
up (the CPU interpreter compiles nothing). Cost, Qwen3-8B on a fresh H200 (64 sequences,
2048-token chunks): start-up 25.6 -> 41.8 s, 26.5 s of it compiling 31 kernels.
"""
from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.engine.core.outputs import EngineStats
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.model.sdpa_prefill import plan_lengths

if TYPE_CHECKING:
    from pdserve.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)

WARMUP_BUDGET_S = 600.0  # cold, ~30 kernels compile (~30 s); a stuck step must not hang start-up
# next_pow2 2 .. 512: every prefill attention tile class; 16: the rows % 16 class of the
# small-row GEMVs (kernels/gemv.py, steps of <= 16 tokens)
PREFILL_LENGTHS = (2, 3, 5, 9, 16, 17, 33, 65, 129, 257)
REQUEST_PREFIX = "pdserve-warmup-"
SPACING = 3  # decode steps between two batch sizes


@dataclass(frozen=True)
class WarmupReport:
    requests: int
    steps: int
    seconds: float
    complete: bool  # False: the budget ran out and the rest was aborted
    batch_sizes: frozenset[int]  # requests with an output in a step, over the steps


def applies(engine: LLMEngine) -> bool:
    """Only compiled kernels have anything to warm: CUDA with use_triton."""
    cfg = engine.config
    return cfg.use_triton and str(cfg.device).startswith("cuda")


def warm_up(engine: LLMEngine, budget_s: float = WARMUP_BUDGET_S) -> WarmupReport | None:
    """Warm up an idle engine where it applies (see the module doc), else None."""
    return run(engine, budget_s) if applies(engine) else None


def run(engine: LLMEngine, budget_s: float = WARMUP_BUDGET_S) -> WarmupReport:
    """Run the warm-up workload on any idle engine, then forget it. Raises RuntimeError if
    the engine already has requests."""
    if engine.has_unfinished():
        raise RuntimeError("warm_up: the engine already has requests; warm up before serving")
    t0 = time.perf_counter()
    deadline = t0 + budget_s
    steps, requests, sizes = 0, 0, set()
    for name, batch in plan(engine):
        if time.perf_counter() >= deadline:
            break
        log.info("warm-up: %s (%d requests)", name, len(batch))
        for prompt, max_tokens in batch:
            engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                      ignore_eos=True),
                               request_id=f"{REQUEST_PREFIX}{requests}")
            requests += 1
        while engine.has_unfinished() and time.perf_counter() < deadline:
            sizes.add(len(engine.step()))
            steps += 1
    complete = not engine.has_unfinished()
    if not complete:
        for rid in list(engine.scheduler.requests):
            engine.abort_request(rid)  # frees its blocks now
        log.warning("warm-up: stopped at its %.0f s budget; some kernels will compile in "
                    "served steps", budget_s)
    _forget(engine)
    report = WarmupReport(requests, steps, time.perf_counter() - t0, complete,
                          frozenset(sizes - {0}))
    log.info("warm-up: %d requests, %d steps in %.1f s", report.requests, report.steps,
             report.seconds)
    return report


def plan(engine: LLMEngine) -> list[tuple[str, list[tuple[list[int], int]]]]:
    """[(phase name, [(prompt token ids, max_tokens)])], sized to the engine's limits."""
    sched, cache, vocab = engine.config.scheduler, engine.config.cache, engine.config.model.vocab_size
    rng = random.Random(0)  # distinct prompts: no prefix hit may shorten a planned chunk

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    # what one request may hold (the context, or a pool smaller than it), less the two
    # tokens every planned request decodes after its prompt
    limit = min(sched.max_model_len, cache.num_blocks * cache.block_size)
    room = limit - 2
    chunk = min(room, sched.max_num_batched_tokens)  # the longest prompt prefilled in one step
    phases = [(f"a prefill of {n} tokens", [(prompt(n), 2)]) for n in PREFILL_LENGTHS
              if n <= chunk]
    # fresh prompts of every SDPA length class (engine/model/sdpa_prefill.py): their plans
    phases += [(f"a fresh prefill of {n} tokens", [(prompt(n), 1)]) for n in plan_lengths(chunk)]
    long = min(sched.max_num_batched_tokens + 33, room)
    if long > sched.max_num_batched_tokens:
        phases.append(("a prefill over two chunks", [(prompt(long), 2)]))
    # request i decodes 1 + SPACING * i tokens after a shared prefill step, so one finishes
    # every SPACING steps and the batch steps down from n to 1; between finishes the batch
    # decodes steadily, which overlapped decode and MTP's verify-ahead need (a request on its
    # last token keeps the whole batch off them). Prompts of 2-5 tokens keep all n
    # prefills in that one step.
    n = sched.max_num_seqs
    lens = [min(2 + i % 4, room) for i in range(n)]
    phases.append((f"decode batches of {n} down to 1",
                   [(prompt(p), max(1, min(2 + SPACING * i, limit - p)))
                    for i, p in enumerate(lens)]))
    return phases


def _forget(engine: LLMEngine) -> None:
    """Served requests must not hit the warm-up's prompts, nor count its tokens."""
    engine.scheduler.block_manager.reset_prefix_cache()
    engine.stats = EngineStats()
    if engine.runner.spec is not None:
        engine.runner.spec.stats = type(engine.runner.spec.stats)()

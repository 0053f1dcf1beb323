"""MTP speculation with overlapped decode (CPU, tiny random Qwen3 + random MTP head).

A plain decode step whose batch drafts nothing (k = 0 from batch_k_caps) launches its MTP
catch-up from the sampler's device ids (engine/spec/draft_graphs.py catch_up_from_device), then the
next decode forward ahead of the host sync (engine/exec/overlap.py). Caps ((2, 1),): the batch of 5
drafts nothing; once requests finish and <= 2 remain, drafting (and verifying) resumes.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.engine.core.config import SpecConfig
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.llm import LLM

TINY = dict(device="cpu", block_size=4, num_blocks=256)
PROMPTS = [[5 + i, 17, 99, 3 * i + 1, 42] * (i + 1) for i in range(5)]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
# requests end at different steps: the batch shrinks from 5 (k = 0) to <= 2 (k = 1)
PARAMS = [dataclasses.replace(GREEDY, max_tokens=20 + 3 * i) for i in range(len(PROMPTS))]


def overlap_spec_llm(draft_graphs: str = "on", maintain_mtp_kv: bool = True) -> LLM:
    spec = SpecConfig(num_speculative_tokens=2, batch_k_caps=((2, 1),),
                      draft_graphs=draft_graphs, maintain_mtp_kv=maintain_mtp_kv)
    return LLM("tiny-qwen3", speculative=spec, overlap_decode="on", **TINY)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """Plain greedy decoding (no speculation, no overlap), cut to each request's max_tokens."""
    res = LLM("tiny-qwen3", **TINY).generate(PROMPTS, GREEDY)
    return [r.outputs[0].token_ids[:p.max_tokens] for r, p in zip(res, PARAMS)]


def run(llm: LLM, hold_first: bool = False) -> tuple[list[list[int]], list[str], int]:
    """All PROMPTS with PARAMS through the engine step by step, the first request's blocks
    held after it finishes (hold_first). Returns the outputs in order, the request ids and
    how many steps called SpecDecoder.propose (the catch-up after the host sync)."""
    engine, spec = llm.engine, llm.engine.runner.spec
    calls, real = [0], spec.propose

    def propose(jobs, hidden, states, **kw):
        calls[0] += 1
        return real(jobs, hidden, states, **kw)

    spec.propose = propose
    rids = [engine.add_request(p, params, hold_blocks=hold_first and i == 0)[0]
            for i, (p, params) in enumerate(zip(PROMPTS, PARAMS))]
    out: dict[str, list[int]] = {rid: [] for rid in rids}
    for o in engine.generate_until_done():
        out[o.request_id] += o.new_token_ids
    return [out[rid] for rid in rids], rids, calls[0]


def kv_of(llm: LLM, rid: str) -> torch.Tensor:
    """Per-position KV [N, num_kv_layers, 2, Hkv, D] of a request whose blocks are held."""
    engine = llm.engine
    req = engine.scheduler.get_request(rid)
    kv, bs = engine.runner.kv_cache, engine.config.cache.block_size
    # a block is [Hkv, L, 2, BS, D] (heads outermost): position p's [L, 2, Hkv, D]
    return torch.stack([kv[req.block_table[p // bs], :, :, :, p % bs].permute(1, 2, 0, 3)
                        for p in range(req.num_computed_tokens)])


def test_k0_catch_up_runs_from_device_ids_before_the_overlapped_launch(
        reference: list[list[int]]) -> None:
    llm = overlap_spec_llm()
    got, rids, propose_calls = run(llm, hold_first=True)
    assert got == reference  # (a) greedy output equals plain decoding
    runner, engine = llm.engine.runner, llm.engine
    assert runner.ahead.hits > 0  # (b) the overlapped launch served k = 0 steps
    static = runner.spec.draft_graphs
    assert static.device_catch_ups > 0  # (d) the catch-up from device ids ran
    assert engine.spec_stats.num_drafts > 0  # drafting resumed once the batch shrank
    # exactly one catch-up per step: the early one (k = 0 steps) or the device-side verify +
    # draft (uniform verify steps, engine/spec/verify_ahead.py) replaced propose(), never ran
    # besides it
    assert runner.verify_ahead.launched > 0
    assert (static.device_catch_ups + runner.verify_ahead.launched + propose_calls
            == engine.stats.steps)
    # (c) the MTP layer's KV of the held request (decoded at batch 5, k = 0 throughout)
    # equals a fresh prefill's over its final sequence: the early catch-up used the sampled
    # tokens, this step's hidden rows and the right positions
    seq = PROMPTS[0] + got[0]
    kv = kv_of(llm, rids[0])
    fresh = LLM("tiny-qwen3", speculative=SpecConfig(num_speculative_tokens=2, batch_k_caps=()),
                **TINY)
    [ref_rid] = fresh.engine.add_request(seq[:-1], SamplingParams(max_tokens=1, temperature=0.0),
                                         hold_blocks=True)
    fresh.engine.generate_until_done()
    kv_ref = kv_of(fresh, ref_rid)
    n = len(seq) - 2  # positions whose next token both runs knew
    assert kv.shape[1] == 3  # 2 target layers + 1 MTP layer
    torch.testing.assert_close(kv[:n], kv_ref[:n], atol=1e-4, rtol=1e-4)


def test_overlap_needs_the_early_catch_up_when_mtp_kv_is_kept(
        reference: list[list[int]]) -> None:
    """Without static drafting the catch-up runs after the host sync and reads this step's
    hidden rows, so nothing may be launched ahead; without maintain_mtp_kv there is no
    catch-up at k = 0, and k = 0 steps overlap."""
    off = overlap_spec_llm(draft_graphs="off")
    got, _, _ = run(off)
    assert got == reference
    assert off.engine.runner.ahead.hits == 0
    unkept = overlap_spec_llm(maintain_mtp_kv=False)
    got, _, _ = run(unkept)
    assert got == reference
    assert unkept.engine.runner.ahead.hits > 0
    assert unkept.engine.runner.spec.draft_graphs.device_catch_ups == 0
    assert unkept.engine.spec_stats.num_drafts > 0


@pytest.mark.parametrize("forced", [False, True])
def test_next_verify_launched_from_device_drafts(forced: bool) -> None:
    """A uniform greedy verify step launches the next verify forward from the drafts still on
    the device (engine/exec/runner.py _launch_verify): outputs stay exact and the launches serve
    steps (a request about to end or to get fewer drafts is not launched for: cap_k)."""
    kw = dict(speculative=SpecConfig(num_speculative_tokens=2, batch_k_caps=(),
                                     draft_graphs="on", forced_acceptance=forced),
              overlap_decode="on", **TINY)
    llm = LLM("tiny-qwen3", **kw)
    got = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, PARAMS)]
    ahead = llm.engine.runner.ahead
    assert ahead.hits >= 3  # forced acceptance: ~12 steps in all
    if not forced:
        base = LLM("tiny-qwen3", **TINY).generate(PROMPTS, PARAMS)
        assert got == [r.outputs[0].token_ids for r in base]
    else:  # forced acceptance emits the drafts: compare with the same run, overlap off
        off = LLM("tiny-qwen3", **{**kw, "overlap_decode": "off"})
        assert got == [r.outputs[0].token_ids for r in off.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("forced", [False, True])
def test_device_acceptance_kernel_equals_its_torch_reference(forced: bool) -> None:
    """The fused path (use_triton; the Triton interpreter on CPU) runs a uniform verify
    step's acceptance as pdserve.kernels.ops.spec_accept: k = 3 (a two-step chain moved back on the
    device), real acceptance of random drafts (mostly rejected) and forced acceptance.
    Outputs equal the torch path's (engine.spec.draft_graphs.accept_ref), step for step."""
    spec = SpecConfig(num_speculative_tokens=3, batch_k_caps=(), draft_graphs="on",
                      forced_acceptance=forced)
    kw = dict(speculative=spec, overlap_decode="on", **TINY)
    # random drafts are mostly rejected (a token per step): fewer tokens keep the
    # interpreted run short, forced acceptance moves 4 tokens a step
    prompts = PROMPTS[:2]
    params = [dataclasses.replace(p, max_tokens=(12 + i) if forced else 6)
              for i, p in enumerate(PARAMS[:2])]
    ops = pytest.importorskip("pdserve.kernels.ops")
    fast = LLM("tiny-qwen3", use_triton=True, **kw)
    torch_path = LLM("tiny-qwen3", **kw)
    got = [r.outputs[0].token_ids for r in fast.generate(prompts, params)]
    want = [r.outputs[0].token_ids for r in torch_path.generate(prompts, params)]
    assert fast.engine.runner.verify_ahead.launched > 0
    assert fast.engine.runner.spec.draft_graphs._accept is ops.spec_accept
    assert got == want
    accepted = [llm.engine.spec_stats.num_accepted_tokens for llm in (fast, torch_path)]
    assert accepted[0] == accepted[1]

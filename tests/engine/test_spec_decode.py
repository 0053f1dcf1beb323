"""MTP speculative decoding on a tiny random Qwen3 with a random MTP head (CPU).

A random head almost never guesses right, so the exactness tests also run an oracle proposer:
the real MTP head runs (and writes its KV), then its drafts are replaced by the reference
continuation cut at a random point, so acceptance is partial and rollback is exercised.
"""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from pdserve.engine.core.config import CacheConfig, SpecConfig, compatibility_hash
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.llm import LLM
from pdserve.engine.spec.spec_decoder import SpecStats, greedy_accept, rejection_sample

TINY = dict(device="cpu", block_size=4, num_blocks=256)
PROMPTS = [[5 + i, 17, 99, 3 * i + 1, 42] * (i + 1) for i in range(5)]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def spec_llm(k: int, **kw: object) -> LLM:
    spec = SpecConfig(num_speculative_tokens=k, batch_k_caps=(),
                      forced_acceptance=bool(kw.pop("forced", False)),
                      draft_graphs=str(kw.pop("draft_graphs", "auto")))
    return LLM("tiny-qwen3", speculative=spec, **{**TINY, **kw})


def tokens(results) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in results]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return tokens(LLM("tiny-qwen3", **TINY).generate(PROMPTS, GREEDY))


def use_oracle(llm: LLM, prompts: list[list[int]], outputs: list[list[int]], seed: int = 0):
    """Replace the MTP drafts with the reference continuation, right for a random number
    (0..k) of tokens and wrong after that. The real head still runs first (in whichever path
    drafts: the general propose or the device-side verify + draft of engine/spec/verify_ahead.py)."""
    runner = llm.engine.runner
    full = {tuple(p): p + o for p, o in zip(prompts, outputs)}
    rng, real = random.Random(seed), runner.run
    # with overlapped decode (GPU) a verify launched ahead from the real drafts does not match
    # the replaced ones the next step brings, so it is discarded (DecodeAhead.take)

    def run(out, *args, **kw):
        result = real(out, *args, **kw)
        for s in out.scheduled:
            rid = s.request.request_id
            if rid not in result.drafts:
                continue
            seq = full[tuple(s.request.prompt_token_ids)]
            # index of the token the first draft guesses: after this step's emitted tokens
            base = s.request.num_tokens + len(result.sampled[rid])
            d = result.drafts[rid]
            right = rng.randint(0, len(d))
            result.drafts[rid] = [seq[base + i] if i < right else (seq[base + i] + 1) % 512
                                  for i in range(len(d))]
        return result

    runner.run = run


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_equals_non_speculative(k: int, reference: list[list[int]]) -> None:
    llm = spec_llm(k)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == reference
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_drafts


@pytest.mark.parametrize("k", [1, 3])
def test_partial_acceptance_keeps_greedy_output(k: int, reference: list[list[int]]) -> None:
    llm = spec_llm(k)
    use_oracle(llm, PROMPTS, reference)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == reference
    st = llm.engine.spec_stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens  # some accepted, some rolled back
    assert st.num_accepted_tokens == sum(st.num_accepted_tokens_per_pos)
    # each position is accepted only after every earlier one was
    assert st.num_accepted_tokens_per_pos == sorted(st.num_accepted_tokens_per_pos, reverse=True)
    steps_plain = LLM("tiny-qwen3", **TINY)
    steps_plain.generate(PROMPTS, GREEDY)
    assert llm.engine.stats.steps < steps_plain.engine.stats.steps  # speculation saved steps


def test_chunked_prefill_prefix_cache_and_preemption(reference: list[list[int]]) -> None:
    """Tiny token budget (drafts cut to fit, prefill chunks mixed with verifies), repeated
    prompts (prefix-cache hits) and a small pool (preemption by recompute)."""
    llm = spec_llm(3, num_blocks=24, max_num_batched_tokens=16)
    use_oracle(llm, PROMPTS, reference, seed=1)
    got = tokens(llm.generate(PROMPTS + PROMPTS, GREEDY))
    assert got == reference + reference
    sched = llm.engine.scheduler
    assert sched.num_preemptions > 0
    assert sched.block_manager.prefix_cache_hits > 0
    assert llm.engine.spec_stats.num_accepted_tokens > 0


def _held_kv(llm: LLM, prompt: list[int], params: SamplingParams):
    """Run one request whose blocks stay allocated; its tokens and per-position KV
    [N, num_kv_layers, 2, Hkv, D]."""
    engine = llm.engine
    [rid] = engine.add_request(prompt, params, hold_blocks=True)
    out: list[int] = []
    for o in engine.generate_until_done():
        out += o.new_token_ids
    req = engine.scheduler.get_request(rid)
    kv, bs = engine.runner.kv_cache, engine.config.cache.block_size
    n = req.num_computed_tokens
    # a block is [Hkv, L, 2, BS, D] (heads outermost): position p's [L, 2, Hkv, D]
    per_pos = torch.stack([kv[req.block_table[p // bs], :, :, :, p % bs].permute(1, 2, 0, 3)
                           for p in range(n)])
    return prompt + out, per_pos


@pytest.mark.parametrize("draft_graphs", ["off", "on"])
def test_kv_of_both_caches_matches_a_fresh_prefill(reference: list[list[int]],
                                                   draft_graphs: str) -> None:
    """After decoding with rollbacks, the target layers' and the MTP layer's KV of every
    counted position equal a single prefill of the final sequence (which also runs the MTP
    catch-up over the prompt): rejected drafts left nothing behind -- also when the static
    drafting runs its catch-up over every verify row, rejected ones included."""
    llm = spec_llm(3, draft_graphs=draft_graphs)
    use_oracle(llm, PROMPTS[2:3], reference[2:3], seed=3)
    seq, kv = _held_kv(llm, PROMPTS[2], GREEDY)
    assert seq == PROMPTS[2] + reference[2]
    assert llm.engine.spec_stats.num_accepted_tokens > 0
    fresh = spec_llm(3)
    _, kv_ref = _held_kv(fresh, seq[:-1], SamplingParams(max_tokens=1, temperature=0.0))
    n = len(seq) - 2  # positions whose next token both runs knew
    assert kv.shape[1] == 3  # 2 target layers + 1 MTP layer
    torch.testing.assert_close(kv[:n], kv_ref[:n], atol=1e-4, rtol=1e-4)
    static = llm.engine.runner.spec.draft_graphs
    assert (static is not None and static.served > 0) == (draft_graphs == "on")


@pytest.mark.parametrize("k", [1, 3])
def test_static_drafting_equals_dynamic(k: int, reference: list[list[int]]) -> None:
    """engine/spec/draft_graphs.py (run eagerly here; CUDA graphs on a GPU) proposes exactly the
    drafts of the dynamic path, step for step, with partial acceptance (rows past the
    accepted prefix in its catch-up) and with a batch whose requests end at different steps."""
    logs = _drafts_by_mode(k, reference, {})
    assert logs["on"] == logs["off"]


def _drafts_by_mode(k: int, reference: list[list[int]], kw: dict) -> dict[str, list]:
    """Drafts proposed per step with static drafting off and on (oracle partial acceptance,
    requests ending at different steps); asserts each run's greedy output."""
    params = [dataclasses.replace(GREEDY, max_tokens=20 + 3 * i) for i in range(len(PROMPTS))]
    logs: dict[str, list] = {}
    for mode in ("off", "on"):
        llm = spec_llm(k, draft_graphs=mode, **kw)
        runner, log = llm.engine.runner, []
        spec, real = runner.spec, runner.run

        def logged(out, *args, real=real, log=log, **kw):
            result = real(out, *args, **kw)
            if result.drafts:
                log.append(sorted((rid, tuple(d)) for rid, d in result.drafts.items()))
            return result

        runner.run = logged
        use_oracle(llm, PROMPTS, reference, seed=2)
        got = tokens(llm.generate(PROMPTS, params))
        assert got == [r[:p.max_tokens] for r, p in zip(reference, params)]
        logs[mode] = log
        if mode == "on":
            assert spec.draft_graphs.served > 5  # most verify steps drafted statically
            assert runner.verify_ahead.launched > 0  # acceptance + drafting on the device
        else:
            assert spec.draft_graphs is None
    return logs


def test_forced_acceptance_accepts_everything() -> None:
    llm = spec_llm(2, forced=True)
    res = llm.generate(PROMPTS[:2], GREEDY)
    st = llm.engine.spec_stats
    assert st.num_accepted_tokens == st.num_draft_tokens > 0
    assert all(len(r.outputs[0].token_ids) == 32 for r in res)
    assert SpecConfig().forced_acceptance is False  # never the default


def test_random_sampling_keeps_the_target_support_and_seed() -> None:
    """With top_k=2 a draft outside the target's top-2 has p = 0 and must be rejected:
    every emitted token is in the target's top-2 at its position (teacher-forced check)."""
    params = SamplingParams(max_tokens=24, temperature=1.0, top_k=2, seed=7, ignore_eos=True)
    llm = spec_llm(3)
    out = tokens(llm.generate(PROMPTS, params))
    assert llm.engine.spec_stats.num_draft_tokens > 0
    assert out == tokens(spec_llm(3).generate(PROMPTS, params))  # seeded: reproducible
    model = llm.engine.runner.model
    from pdserve.engine.exec.kv_cache import allocate_kv_cache
    from pdserve.engine.model.attention import make_metadata

    for prompt, o in zip(PROMPTS, out):
        seq = prompt + o
        kv = allocate_kv_cache(model.config, 64, 4, torch.float32, "cpu")
        meta = make_metadata([len(seq)], [len(seq)], [list(range(64))], 4)
        with torch.inference_mode():
            logits = model.compute_logits(model(torch.tensor(seq), torch.arange(len(seq)),
                                                meta, kv))
        top2 = logits.topk(2, dim=-1).indices
        for i, tok in enumerate(o):
            assert tok in top2[len(prompt) - 1 + i].tolist()


def test_greedy_accept_rule() -> None:
    assert greedy_accept([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]
    assert greedy_accept([4, 9, 6], [4, 5, 6, 7]) == [4, 5]
    assert greedy_accept([1], [2, 3]) == [2]


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; survival function via gammaincc (no scipy)."""
    expected = probs * counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    dof = torch.tensor((len(probs) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, stat.double() / 2))


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    """20,000 draws, a draft distribution far from the target, k = 2: the first emitted token
    follows p0 and, after an accepted first draft, the second follows p1 (chi-square does not
    reject); emitting the drafts unchecked would be rejected outright."""
    n, gen = 20_000, torch.Generator().manual_seed(0)
    p = torch.tensor([[0.50, 0.20, 0.15, 0.10, 0.05], [0.10, 0.40, 0.10, 0.10, 0.30],
                      [0.2, 0.2, 0.2, 0.2, 0.2]])
    q = torch.tensor([[0.05, 0.05, 0.10, 0.30, 0.50], [0.60, 0.05, 0.05, 0.25, 0.05]])
    drafts = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=gen)
                          for j in range(2)], dim=1)  # [n, 2]
    uniforms = torch.rand(n, 2, generator=gen)
    noise = torch.empty(n, 3, 5).exponential_(generator=gen)
    num_acc, toks = rejection_sample(p.expand(n, 3, 5), q.expand(n, 2, 5), drafts, uniforms, noise)
    first = torch.bincount(toks[:, 0], minlength=5).double()
    assert _chi2_pvalue(first, p[0].double()) > 0.01
    second = torch.bincount(toks[num_acc >= 1, 1], minlength=5).double()
    assert second.sum() > 2000 and _chi2_pvalue(second, p[1].double()) > 0.01
    # acceptance of the first draft: sum_x min(p, q)
    expect = float(torch.minimum(p[0], q[0]).sum())
    assert abs(float((num_acc >= 1).double().mean()) - expect) < 4 * (expect / n) ** 0.5
    naive = torch.bincount(drafts[:, 0], minlength=5).double()
    assert _chi2_pvalue(naive, p[0].double()) < 1e-6  # the test has power


def test_spec_config_adaptive_k_and_validation() -> None:
    spec = SpecConfig(num_speculative_tokens=3, batch_k_caps=((4, 3), (16, 1)))
    assert [spec.k_for_batch(b) for b in (1, 4, 5, 16, 17, 64)] == [3, 3, 1, 1, 0, 0]
    assert SpecConfig(num_speculative_tokens=2, batch_k_caps=()).k_for_batch(500) == 2
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpecConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="method"):
        SpecConfig(method="eagle9")
    with pytest.raises(ValueError, match="batch_k_caps"):
        SpecConfig(batch_k_caps=((8, 1), (4, 2)))
    stats = SpecStats()
    stats.record(3, 2)
    stats.record(3, 0)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 6, 2)
    assert stats.num_accepted_tokens_per_pos == [1, 1, 0]
    assert stats.mean_accepted_length == 2.0


def test_adaptive_k_turns_speculation_off_for_big_batches(reference) -> None:
    spec = SpecConfig(num_speculative_tokens=2, batch_k_caps=((2, 2),))
    llm = LLM("tiny-qwen3", speculative=spec, **TINY)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == reference  # 5 > 2: no drafts at first
    st = llm.engine.spec_stats
    assert st.num_drafts == 0
    # one request alone: drafts again, from MTP KV kept current meanwhile
    llm.generate(PROMPTS[:1], GREEDY)
    assert llm.engine.spec_stats.num_drafts > 0


def test_compat_hash_covers_speculation() -> None:
    plain, spec = LLM("tiny-qwen3", **TINY).engine, spec_llm(1).engine
    cache = CacheConfig(block_size=4)
    h_plain = compatibility_hash(plain.config.model, cache, plain.compat_extra())
    h_spec = compatibility_hash(spec.config.model, cache, spec.compat_extra())
    assert h_plain != h_spec
    assert spec.config.model.num_mtp_layers == 1 and plain.config.model.num_mtp_layers == 0
    assert spec.compat_extra() == {"speculative": {"method": "mtp", "head": "random:0"}}
    other_head = spec.compat_extra()["speculative"] | {"head": "file:abc"}
    assert compatibility_hash(spec.config.model, cache, {"speculative": other_head}) != h_spec


def test_spec_metrics_exported() -> None:
    from prometheus_client import CollectorRegistry

    from pdserve.worker.metrics import WorkerMetrics

    reg = CollectorRegistry()
    m = WorkerMetrics(reg, "decode", "d0")
    labels = {"role": "decode", "worker": "d0"}
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):  # present at zero
        assert reg.get_sample_value(f"pdserve:spec_decode_{name}_total", labels) == 0.0
    llm = spec_llm(2, forced=True)
    llm.generate(PROMPTS[:2], GREEDY)
    m.refresh(llm.engine)
    st = llm.engine.spec_stats
    assert reg.get_sample_value("pdserve:spec_decode_num_drafts_total", labels) == st.num_drafts
    assert reg.get_sample_value("pdserve:spec_decode_num_accepted_tokens_total",
                                labels) == st.num_accepted_tokens
    for pos, n in enumerate(st.num_accepted_tokens_per_pos):
        assert reg.get_sample_value("pdserve:spec_decode_num_accepted_tokens_per_pos_total",
                                    {**labels, "position": str(pos)}) == n
    m.refresh(llm.engine)  # idempotent: counters advance by deltas
    assert reg.get_sample_value("pdserve:spec_decode_num_drafts_total", labels) == st.num_drafts


@pytest.mark.gpu
def test_verify_steps_replay_cuda_graphs() -> None:
    """Triton kernels + CUDA graphs: uniform verify steps replay a captured graph, and the
    greedy output still equals plain decoding (float32: no bf16 near-ties)."""
    kw = dict(device="cuda", dtype="float32", block_size=16, num_blocks=256, max_num_seqs=8,
              use_triton=True, use_cuda_graphs=True)
    ref = tokens(LLM("tiny-qwen3", **kw).generate(PROMPTS, GREEDY))
    llm = LLM("tiny-qwen3", speculative=SpecConfig(num_speculative_tokens=2, batch_k_caps=()),
              **kw)
    use_oracle(llm, PROMPTS, ref, seed=4)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == ref
    graphs = llm.engine.runner.verify_graphs
    assert sorted(graphs) == [1, 2] and sum(g.replays for g in graphs.values()) > 0
    assert llm.engine.spec_stats.num_accepted_tokens > 0
    assert llm.engine.runner.spec.draft_graphs.replays > 0  # drafting replayed graphs too
    # uniform greedy steps took the device-side acceptance (kernels.spec_accept)
    assert llm.engine.runner.verify_ahead.launched > 0


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 3])
def test_draft_graphs_equal_dynamic_drafting_on_gpu(k: int) -> None:
    """The captured drafting (CUDA graphs) proposes exactly the dynamic path's drafts."""
    kw = dict(device="cuda", dtype="float32", block_size=16, num_blocks=256, max_num_seqs=8,
              use_triton=True, use_cuda_graphs=True)
    ref = tokens(LLM("tiny-qwen3", **kw).generate(PROMPTS, GREEDY))
    logs = _drafts_by_mode(k, ref, {**kw, "block_size": 16})
    assert logs["on"] == logs["off"]


def test_verify_graph_buffers_reproduce_the_eager_forward() -> None:
    """What a verify graph replays, run eagerly (Triton interpreter on CPU): a batch of 3
    verifying sequences copied into the static buffers of a bucket of 4, the padding row
    writing no KV, gives the eager forward's hidden states exactly."""
    from pdserve.engine.spec.verify_graphs import VerifyGraphs

    # the Triton interpreter on a CPU host; compiled kernels (CUDA tensors) on a GPU host
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM("tiny-qwen3", device=device, block_size=4, num_blocks=64, max_num_seqs=4,
              use_triton=True, speculative=SpecConfig(num_speculative_tokens=2, batch_k_caps=()))
    engine, runner = llm.engine, llm.engine.runner
    for i in range(3):
        engine.add_request([5 + i, 6, 7, 8, 9, 10, 11], GREEDY)
    engine.step()
    engine.step()
    out = engine.scheduler.schedule()
    assert [len(s.spec_token_ids) for s in out.scheduled] == [2, 2, 2]
    batch = runner.flatten(out)
    ids, pos, meta = batch.to_device(runner.device)
    kv_before = runner.kv_cache.clone()
    want = runner.model(ids, pos, meta, runner.kv_cache, return_prenorm=True)
    graphs = VerifyGraphs(engine.config, runner.model, runner.kv_cache, 3, 4)
    assert graphs.fits(batch) == 4
    short = dataclasses.replace(batch, query_lens=[3, 3, 2])
    assert graphs.fits(short) is None  # not every sequence verifies k = 2 drafts
    n = ids.shape[0]
    graphs.inputs.stage(batch, 4)
    runner.kv_cache.copy_(kv_before)
    got = graphs.forward_eager(4)
    for a, b in zip(got, want):  # 12 padded rows vs 9: BLAS may round differently (~1e-7)
        torch.testing.assert_close(a[:n], b, atol=1e-5, rtol=1e-5)
    touched = (runner.kv_cache != kv_before).flatten(1).any(1).nonzero().flatten().tolist()
    assert set(touched) <= {b for s in out.scheduled for b in s.request.block_table}

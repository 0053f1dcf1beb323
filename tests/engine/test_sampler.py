"""Sampler: seeded reproducibility, truncation supports, penalties, greedy, logprobs."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine.core.request import Request
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.exec.logits_processors import apply_min_p, apply_penalties, apply_top_k_top_p
from pdserve.engine.exec.sampler import Sampler, SamplerState

V = 32


def make_request(rid: str = "r", prompt: list[int] | None = None, **params) -> Request:
    return Request(rid, prompt or [1, 2, 3], SamplingParams(**params))


def fixed_logits(v: int = V) -> torch.Tensor:
    """Distinct, well-spread logits [V] so supports have no float ties at their edges."""
    g = torch.Generator().manual_seed(1234)
    return torch.randn(v, generator=g, dtype=torch.float64).mul(1.5).float()


def decode_loop(sampler: Sampler, reqs: list[Request], states: list[SamplerState],
                logits_fn, steps: int, watch: int) -> list[int]:
    """Sample `steps` tokens for a batch, appending + observing; returns row `watch`'s tokens."""
    for step in range(steps):
        out = sampler(logits_fn(step), reqs, states)
        for req, st, tok in zip(reqs, states, out.token_ids):
            req.append_token(tok)
            st.observe(tok)
    return reqs[watch].output_token_ids


# -- seeded reproducibility ----------------------------------------------------------------
def _step_logits(row_offsets: list[int]):
    """Step -> [B, V] logits; the seeded request's row is identical wherever it sits."""
    def fn(step: int) -> torch.Tensor:
        rows = [torch.randn(V, generator=torch.Generator().manual_seed(1000 * step + off))
                for off in row_offsets]
        return torch.stack(rows)
    return fn


def test_seeded_sampling_reproduces_alone_and_in_any_batch() -> None:
    params = dict(seed=42, temperature=0.9, top_k=20, max_tokens=30)
    runs = []
    # alone, twice, each time with a fresh engine sampler (different engine seed too)
    for engine_seed in (0, 7):
        s = Sampler(seed=engine_seed)
        req = make_request("a", **params)
        runs.append(decode_loop(s, [req], [s.new_state(req, V, "cpu")], _step_logits([0]), 25, 0))
    # batched with unseeded and differently configured requests, in two orders
    for order in (["a", "b", "c"], ["c", "b", "a"]):
        s = Sampler(seed=3)
        others = {"b": dict(temperature=1.3, top_p=0.5), "c": dict(temperature=0.0, min_p=0.2)}
        reqs = [make_request(r, **(params if r == "a" else others[r])) for r in order]
        states = [s.new_state(r, V, "cpu") for r in reqs]
        offsets = [0 if r == "a" else 1 + i for i, r in enumerate(order)]
        runs.append(decode_loop(s, reqs, states, _step_logits(offsets), 25, order.index("a")))
    assert all(r == runs[0] for r in runs), runs


def test_different_seeds_differ_and_unseeded_requests_differ() -> None:
    s = Sampler()
    def flat(step: int) -> torch.Tensor:  # uniform: any repeat across 25 draws is chance
        return torch.zeros(1, V)

    toks = []
    for seed in (1, 2, None, None):
        req = make_request(seed=seed)
        toks.append(decode_loop(s, [req], [s.new_state(req, V, "cpu")], flat, 25, 0))
    assert len({tuple(t) for t in toks}) == 4


def test_state_created_mid_stream_continues_the_same_stream() -> None:
    """Prefill draws token 0, decode builds a new state from the request and continues."""
    s = Sampler()
    logits = _step_logits([0])
    whole = make_request(seed=5, presence_penalty=0.5)
    full = decode_loop(s, [whole], [s.new_state(whole, V, "cpu")], logits, 6, 0)
    split = make_request(seed=5, presence_penalty=0.5)
    decode_loop(s, [split], [s.new_state(split, V, "cpu")], logits, 1, 0)
    state = s.new_state(split, V, "cpu")  # the decode worker's fresh state
    assert state.output_counts is not None and int(state.output_counts.sum()) == 1
    rest = decode_loop(s, [split], [state], lambda step: logits(step + 1), 5, 0)
    assert rest == full


# -- truncation supports ----------------------------------------------------------------------
def analytic_support(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                     min_p: float) -> torch.Tensor:
    """Target distribution [V] in float64, computed directly from the definitions."""
    p = torch.softmax(logits.double() / temperature, dim=-1)
    order = torch.argsort(p, descending=True).tolist()
    keep = set(order[:top_k] if top_k > 0 else order)
    pk = {t: p[t].item() for t in keep}
    total = sum(pk.values())
    nucleus, mass = set(), 0.0
    for t in order:  # top-p on the top-k renormalised distribution
        if t not in keep or mass >= top_p:
            continue
        nucleus.add(t)
        mass += pk[t] / total
    p_max = max(pk.values())
    support = [t for t in nucleus if p[t].item() >= min_p * p_max]
    target = torch.zeros_like(p)
    target[support] = p[support]
    return target / target.sum()


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 5, 1.0, 0.0),
    (1.0, -1, 0.7, 0.0),
    (0.8, -1, 1.0, 0.15),
    (1.2, 12, 0.8, 0.05),
    (1.0, -1, 1.0, 0.0),
])
def test_truncation_never_leaves_support_and_matches_target(temperature, top_k, top_p,
                                                            min_p) -> None:
    n = 8000
    base = fixed_logits()
    target = analytic_support(base, temperature, top_k, top_p, min_p)
    support = set(torch.nonzero(target).flatten().tolist())
    s = Sampler(seed=11)
    params = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    reqs = [make_request(f"r{i}", **params) for i in range(n)]
    states = [s.new_state(r, V, "cpu") for r in reqs]
    logits = base.expand(n, V).contiguous()

    probs = s.probs_after_processing(logits[:1], reqs[:1], states[:1])[0].double()
    torch.testing.assert_close(probs, target, atol=1e-5, rtol=1e-4)

    draws = torch.tensor(s(logits, reqs, states).token_ids)
    assert set(draws.tolist()) <= support
    freq = torch.bincount(draws, minlength=V).double() / n
    assert (freq - target).abs().max().item() < 0.025  # ~4.5 sigma at p = 0.5
    keep = target > 0
    chi2 = ((freq[keep] - target[keep]) ** 2 / target[keep]).sum().item() * n
    dof = int(keep.sum()) - 1
    assert chi2 < dof + 6 * (2 * max(dof, 1)) ** 0.5 + 10


def test_mixed_settings_in_one_batch_each_row_gets_its_own() -> None:
    base = fixed_logits()
    top = int(base.argmax())
    s = Sampler()
    reqs = [make_request("k1", top_k=1), make_request("greedy", temperature=0.0),
            make_request("p", top_p=1e-6), make_request("free", temperature=5.0),
            make_request("k3", top_k=3)]
    n = 150
    seen: list[set[int]] = [set() for _ in reqs]
    states = [s.new_state(r, V, "cpu") for r in reqs]
    for _ in range(n):
        toks = s(base.expand(len(reqs), V), reqs, states).token_ids
        for i, t in enumerate(toks):
            seen[i].add(t)
        for r in reqs:  # advance positions so each step draws fresh noise
            r.output_token_ids.append(0)
            r.output_token_counts[0] = r.output_token_counts.get(0, 0) + 1
    assert seen[0] == seen[1] == seen[2] == {top}
    assert len(seen[3]) > 10  # a hot row is not truncated by its neighbours' settings
    assert seen[4] == set(torch.topk(base, 3).indices.tolist())


def test_top_k_top_p_and_min_p_helpers_per_row() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    out = apply_top_k_top_p(logits, torch.tensor([4, 2]), torch.tensor([0.8, 1.0]))
    assert torch.isinf(out[0]).tolist() == [False, False, True, True]  # 0.5 + 0.3 reaches 0.8
    assert torch.isinf(out[1]).tolist() == [False, False, True, True]  # top-2
    out = apply_min_p(logits, torch.tensor([0.35, 0.0]))
    assert torch.isinf(out[0]).tolist() == [False, False, True, True]  # 0.15 < 0.35 * 0.5
    assert not torch.isinf(out[1]).any()


# -- penalties --------------------------------------------------------------------------------
def test_penalties_match_their_formulas() -> None:
    prompt, output = [3, 5, 5, 9], [5, 7, 7, 7, 11]
    rep, pres, freq = 1.3, 0.4, 0.25
    logits = fixed_logits()
    logits[3], logits[7] = 2.0, -1.0  # one positive and one negative seen token
    expected = logits.clone().double()
    for t in set(prompt) | set(output):  # repetition: divide positives, multiply negatives
        expected[t] = expected[t] / rep if expected[t] > 0 else expected[t] * rep
    for t in set(output):
        expected[t] -= freq * output.count(t) + pres

    s = Sampler()
    req = Request("r", prompt, SamplingParams(repetition_penalty=rep, presence_penalty=pres,
                                              frequency_penalty=freq))
    state = s.new_state(req, V, "cpu")
    for t in output:
        req.append_token(t)
        state.observe(t)
    probs = s.probs_after_processing(logits[None], [req], [state])[0].double()
    torch.testing.assert_close(probs, torch.softmax(expected, -1), atol=1e-6, rtol=1e-5)
    direct = apply_penalties(logits[None], state.prompt_mask[None], state.output_counts[None],
                             torch.tensor([rep]), torch.tensor([pres]), torch.tensor([freq]))
    torch.testing.assert_close(direct[0].double(), expected, atol=1e-5, rtol=1e-6)


def test_penalty_state_is_incremental() -> None:
    s = Sampler()
    req = Request("r", [4, 4, 8], SamplingParams(frequency_penalty=1.0))
    state = s.new_state(req, V, "cpu")
    assert state.prompt_mask.nonzero().flatten().tolist() == [4, 8]
    counts = state.output_counts
    for t in [2, 6, 2, 31, 2]:
        state.observe(t)
        req.append_token(t)
        assert state.output_counts is counts  # updated in place, never rebuilt
        want = torch.bincount(torch.tensor(req.output_token_ids), minlength=V)
        assert torch.equal(counts.long(), want)
    assert state.num_observed == 5
    assert s.new_state(req, V, "cpu").output_counts.tolist() == counts.tolist()
    with pytest.raises(ValueError, match="token_id"):
        state.observe(V)


def test_unobserved_token_is_an_error_not_a_silent_wrong_penalty() -> None:
    s = Sampler()
    req = make_request(presence_penalty=1.0)
    state = s.new_state(req, V, "cpu")
    req.append_token(3)  # appended but never observed
    with pytest.raises(RuntimeError, match="observe"):
        s(torch.zeros(1, V), [req], [state])


def test_state_made_under_inference_mode_observes_outside_it() -> None:
    """The runner builds states inside inference_mode; the engine observes outside it."""
    s = Sampler()
    req = make_request(frequency_penalty=0.5)
    with torch.inference_mode():
        state = s.new_state(req, V, "cpu")
    state.observe(4)
    assert int(state.output_counts[4]) == 1


def test_no_penalty_requests_keep_no_tensors() -> None:
    state = Sampler().new_state(make_request(), V, "cpu")
    assert state.output_counts is None and state.prompt_mask is None


# -- greedy -----------------------------------------------------------------------------------
def test_greedy_is_argmax() -> None:
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(0))
    s = Sampler()
    reqs = [make_request(f"g{i}", temperature=0.0, top_k=2, top_p=0.3) for i in range(6)]
    out = s(logits, reqs, [s.new_state(r, V, "cpu") for r in reqs])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_greedy_uses_penalised_argmax() -> None:
    logits = torch.zeros(V)
    logits[3], logits[9] = 5.0, 3.0  # token 3 wins raw but sits in the prompt
    s = Sampler()
    plain = make_request(prompt=[3], temperature=0.0)
    penal = make_request(prompt=[3], temperature=0.0, repetition_penalty=2.0)  # 5 / 2 < 3
    out = s(torch.stack([logits, logits]), [plain, penal],
            [s.new_state(plain, V, "cpu"), s.new_state(penal, V, "cpu")])
    assert out.token_ids == [3, 9]
    probs = s.probs_after_processing(logits[None], [penal], [s.new_state(penal, V, "cpu")])
    assert probs[0].tolist() == [1.0 if i == 9 else 0.0 for i in range(V)]


# -- logprobs ---------------------------------------------------------------------------------
def test_logprobs_are_raw_and_top_n_sorted() -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(5)) * 2
    s = Sampler()
    reqs = [make_request("a", logprobs=5, temperature=0.5, repetition_penalty=1.5),
            make_request("b", logprobs=0, temperature=0.0),
            make_request("c")]
    out = s(logits, reqs, [s.new_state(r, V, "cpu") for r in reqs])
    raw = torch.log_softmax(logits, -1)
    chosen, top = out.logprobs[0]
    assert chosen == pytest.approx(raw[0, out.token_ids[0]].item(), abs=1e-6)
    assert len(top) == 5
    assert [t for t, _ in top] == raw[0].topk(5).indices.tolist()
    lps = [lp for _, lp in top]
    assert lps == sorted(lps, reverse=True)
    assert lps[0] == pytest.approx(raw[0].max().item(), abs=1e-6)
    assert out.logprobs[1] == (pytest.approx(raw[1].max().item(), abs=1e-6), [])
    assert out.logprobs[2] is None


def test_bad_shapes_name_the_field() -> None:
    s = Sampler()
    req = make_request()
    with pytest.raises(ValueError, match="logits"):
        s(torch.zeros(2, V), [req], [s.new_state(req, V, "cpu")])
    with pytest.raises(ValueError, match="vocab_size"):
        s(torch.zeros(1, V + 1), [req], [s.new_state(req, V, "cpu")])


@pytest.mark.gpu
def test_cuda_seeded_reproducibility_and_support() -> None:
    dev = "cuda"
    base = fixed_logits().to(dev)
    runs = []
    for order in (["a", "b"], ["b", "a"]):
        s = Sampler()
        reqs = [make_request(r, seed=9 if r == "a" else None, top_k=6, repetition_penalty=1.2)
                for r in order]
        states = [s.new_state(r, V, dev) for r in reqs]
        runs.append(decode_loop(s, reqs, states, lambda step: base.expand(2, V), 20,
                                order.index("a")))
    assert runs[0] == runs[1]
    n = 4000
    s = Sampler()
    reqs = [make_request(f"r{i}", top_p=0.6, min_p=0.1) for i in range(n)]
    draws = s(base.expand(n, V), reqs, [s.new_state(r, V, dev) for r in reqs]).token_ids
    target = analytic_support(base.cpu(), 1.0, -1, 0.6, 0.1)
    assert set(draws) <= set(torch.nonzero(target).flatten().tolist())


# -- logit_bias -------------------------------------------------------------------------------
def test_logit_bias_plus_100_makes_greedy_pick_the_token() -> None:
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(2)) * 3
    s = Sampler()
    targets = [int(logits[i].argmin()) for i in range(4)]  # each row's least likely token
    reqs = [make_request(f"g{i}", temperature=0.0, logit_bias={t: 100}) for i, t in enumerate(targets)]
    out = s(logits, reqs, [s.new_state(r, V, "cpu") for r in reqs])
    assert out.token_ids == targets
    # the same in bfloat16 (the runner hands the sampler the weights' dtype): the bias is
    # added in float32, so the pick does not depend on bf16 rounding
    out16 = s(logits.bfloat16(), reqs, [s.new_state(r, V, "cpu") for r in reqs])
    assert out16.token_ids == targets


def test_logit_bias_minus_100_bans_the_argmax_greedy_takes_the_runner_up() -> None:
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(3)) * 2
    top2 = logits.topk(2, dim=-1).indices  # [5, 2]: best and second best per row
    s = Sampler()
    reqs = [make_request(f"b{i}", temperature=0.0, logit_bias={int(top2[i, 0]): -100})
            for i in range(5)]
    states = [s.new_state(r, V, "cpu") for r in reqs]
    assert s(logits, reqs, states).token_ids == top2[:, 1].tolist()
    probs = s.probs_after_processing(logits, reqs, states)  # what speculation would verify with
    assert probs.argmax(-1).tolist() == top2[:, 1].tolist()


def test_logit_bias_rows_leave_the_other_rows_and_the_logits_untouched() -> None:
    """A mixed batch (greedy, seeded random, penalised, truncated) where one row has a bias:
    every other row's token and logprobs equal an unbiased run; the caller's float32 logits
    are not modified and the biased row's logprobs stay raw (pre-bias, as documented)."""
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(4)) * 2
    before = logits.clone()
    common = [dict(temperature=0.0, logprobs=3), dict(seed=5, temperature=0.8, logprobs=2),
              dict(seed=6, top_k=5, repetition_penalty=1.3), dict(seed=7, top_p=0.6)]
    runs = []
    for bias in (None, {int(logits[4].argmax()): -100, 3: 7.5}):
        s = Sampler()
        reqs = [make_request(f"r{i}", **kw) for i, kw in enumerate(common)]
        reqs.append(make_request("biased", seed=8, temperature=0.7, logprobs=2, logit_bias=bias))
        runs.append(s(logits, reqs, [s.new_state(r, V, "cpu") for r in reqs]))
    plain, biased = runs
    assert biased.token_ids[:4] == plain.token_ids[:4]
    assert biased.logprobs[:4] == plain.logprobs[:4]
    assert biased.logprobs[4][1] == plain.logprobs[4][1]  # raw top-N of the biased row
    assert torch.equal(logits, before)


@pytest.mark.parametrize("temperature", [1.0, 1.5])
def test_random_sampling_never_draws_a_token_banned_by_minus_100(temperature: float) -> None:
    n = 4000
    base = fixed_logits()
    banned = int(base.argmax())  # the likeliest token: unbanned it is drawn very often
    s = Sampler(seed=21)
    reqs = [make_request(f"r{i}", temperature=temperature, logit_bias={banned: -100.0})
            for i in range(n)]
    free = [make_request(f"f{i}", temperature=temperature) for i in range(n)]
    logits = base.expand(n, V).contiguous()
    draws = s(logits, reqs, [s.new_state(r, V, "cpu") for r in reqs]).token_ids
    free_draws = s(logits, free, [s.new_state(r, V, "cpu") for r in free]).token_ids
    assert banned not in draws
    assert free_draws.count(banned) > n // 20  # the ban, not chance, keeps it out
    assert len(set(draws)) > 5  # the rest of the distribution is still sampled


def test_logit_bias_applies_after_penalties() -> None:
    """Token 3 (in the prompt, logit 4) under repetition 2 becomes 2; +3 makes it 5 > 4.5 of
    token 9. Biasing first would give (4 + 3) / 2 = 3.5 < 4.5: the bias is the exact shift
    the client asked for, whatever the penalties (sampler.py docstring)."""
    logits = torch.zeros(V)
    logits[3], logits[9] = 4.0, 4.5
    s = Sampler()
    req = make_request(prompt=[3], temperature=0.0, repetition_penalty=2.0, logit_bias={3: 3.0})
    assert s(logits[None], [req], [s.new_state(req, V, "cpu")]).token_ids == [3]


def test_logit_bias_state_and_vocab_checks_name_the_field() -> None:
    s = Sampler()
    state = s.new_state(make_request(logit_bias={7: 1.5, 2: -3}), V, "cpu")
    assert dict(zip(state.bias_ids.tolist(), state.bias_values.tolist())) == {7: 1.5, 2: -3.0}
    assert s.new_state(make_request(logit_bias={}), V, "cpu").bias_ids is None
    with pytest.raises(ValueError, match="logit_bias"):  # past the logits row
        s.new_state(make_request(logit_bias={V: 1.0}), V, "cpu")
    req = make_request(logit_bias={1: 1.0})
    with pytest.raises(ValueError, match="logit_bias"):  # a state made without the bias
        s(torch.zeros(1, V), [req], [s.new_state(make_request(), V, "cpu")])

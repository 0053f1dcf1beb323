"""logit_bias through the engine on a tiny random model (CPU): validation naming the field,
the wire round trip, the bias deciding real generations, and MTP speculation leaving biased
requests token for token equal to plain decoding."""
from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine.core.config import SpecConfig
from pdserve.engine.core.request import Request
from pdserve.engine.core.sampling_params import InvalidRequestError, SamplingParams
from pdserve.engine.exec.sampler import Sampler
from pdserve.engine.llm import LLM
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto.convert import params_from_proto, params_to_proto

TINY = dict(device="cpu", block_size=4, num_blocks=256)
VOCAB = 512  # tiny-qwen3's
PROMPTS = [[5 + i, 17, 99, 3 * i + 1, 42] * (i + 1) for i in range(4)]


def greedy(**kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, **kw)


def tokens(results) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in results]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-qwen3", **TINY)


# -- validation and the wire ------------------------------------------------------------------
@pytest.mark.parametrize("bias", [
    {-1: 1.0}, {1.5: 1.0}, {"7": 1.0}, {True: 1.0}, {2**32: 1.0},
    {1: 100.5}, {1: -101}, {1: math.nan}, {1: math.inf}, {1: "5"}, {1: None}, {1: False},
    [1, 2], "x", {i: 1.0 for i in range(301)},
])
def test_bad_logit_bias_names_the_field(bias: object) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(logit_bias=bias)
    assert e.value.param == "logit_bias" and str(e.value).startswith("logit_bias: ")


def test_logit_bias_is_normalised_and_checked_against_the_vocabulary() -> None:
    p = SamplingParams(logit_bias={3: 100, 9: -0.5})
    assert p.logit_bias == {3: 100.0, 9: -0.5} and p.has_logit_bias
    assert all(type(v) is float for v in p.logit_bias.values())
    assert SamplingParams(logit_bias={}).logit_bias is None  # {} means off
    assert len(SamplingParams(logit_bias={i: 1.0 for i in range(300)}).logit_bias) == 300
    hash(p)  # still usable as a key (the dict is left out of the hash)
    p.check_vocab(10)
    with pytest.raises(InvalidRequestError, match=r"logit_bias: token id 10 is outside") as e:
        SamplingParams(logit_bias={10: 1.0, 2: 1.0}).check_vocab(10)
    assert e.value.param == "logit_bias"


def test_logit_bias_crosses_the_wire_both_ways() -> None:
    p = SamplingParams(temperature=0.0, logit_bias={0: 0.1, 511: -100, 4_000_000_000: 37.25})
    msg = params_to_proto(p)
    assert dict(msg.logit_bias) == pytest.approx({0: 0.1, 511: -100.0, 4_000_000_000: 37.25})
    assert params_from_proto(pb.SamplingParams.FromString(msg.SerializeToString())) == p
    assert params_from_proto(params_to_proto(SamplingParams())).logit_bias is None
    for bad in ({5: math.nan}, {5: 150.0}, {5: -1e39}):  # float32: -1e39 arrives as -inf
        with pytest.raises(InvalidRequestError) as e:
            params_from_proto(pb.SamplingParams(logit_bias=bad))
        assert e.value.param == "logit_bias"


def test_engine_rejects_out_of_vocabulary_ids_before_admitting(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(PROMPTS[0], greedy(logit_bias={VOCAB: 5.0}))
    assert e.value.param == "logit_bias" and str(VOCAB) in str(e.value)
    assert not llm.engine.has_unfinished()


# -- generation -------------------------------------------------------------------------------
def test_plus_100_makes_every_token_that_id(llm: LLM) -> None:
    plain = tokens(llm.generate(PROMPTS, greedy()))
    forced = 321
    assert all(forced not in t for t in plain)  # not what the model would say anyway
    for params in (greedy(logit_bias={forced: 100}),
                   SamplingParams(max_tokens=12, temperature=0.9, seed=4, ignore_eos=True,
                                  logit_bias={forced: 100})):
        assert tokens(llm.generate(PROMPTS, params)) == [[forced] * 12] * len(PROMPTS)


def test_minus_100_on_the_first_greedy_token_takes_the_runner_up(llm: LLM) -> None:
    [plain] = llm.generate(PROMPTS[1], greedy(logprobs=2))
    first = plain.outputs[0].token_ids[0]
    runner_up = plain.outputs[0].logprobs[0][1][1][0]  # raw top-2 at the first position
    assert plain.outputs[0].logprobs[0][1][0][0] == first
    [banned] = llm.generate(PROMPTS[1], greedy(logit_bias={first: -100}))
    assert banned.outputs[0].token_ids[0] == runner_up != first
    # the bias keeps applying: the token never comes back
    assert first not in banned.outputs[0].token_ids


def test_speculation_leaves_biased_requests_equal_to_plain_decoding() -> None:
    """Biased requests are not drafted for (engine/spec/spec_decoder.py _speculable): their
    tokens equal plain decoding, greedy and seeded random, while unbiased neighbours in the
    same batches draft and verify as usual."""
    plain = LLM("tiny-qwen3", **TINY)
    ref = tokens(plain.generate(PROMPTS[:1], greedy()))
    bias = {ref[0][0]: -100, ref[0][3]: -100, 77: 4.0}
    params = [greedy(logit_bias=bias), greedy(),
              SamplingParams(max_tokens=12, temperature=0.8, seed=11, ignore_eos=True,
                             logit_bias=bias),
              greedy(logit_bias={200: 100})]
    want = tokens(plain.generate(PROMPTS, params))
    spec = LLM("tiny-qwen3", speculative=SpecConfig(num_speculative_tokens=2, batch_k_caps=()),
               **TINY)
    alone = spec.generate(PROMPTS[0], params[0])
    assert tokens(alone) == want[:1] and spec.engine.spec_stats.num_drafts == 0
    assert tokens(spec.generate(PROMPTS, params)) == want
    assert spec.engine.spec_stats.num_drafts > 0  # the unbiased request did speculate
    assert want[3] == [200] * 12


# -- GPU: the fast paths (CUDA graphs, overlapped decode, Triton argmax, MTP draft graphs) -----
GPU = dict(device="cuda", dtype="float32", block_size=16, num_blocks=256, max_num_seqs=8,
           use_triton=True, use_cuda_graphs=True)


@pytest.mark.gpu
def test_cuda_sampler_applies_the_bias_like_the_cpu_one() -> None:
    """The batched add (pinned index copies, repeat_interleave with output_size) on CUDA, bf16
    logits as the runner hands them over: greedy rows pick what the CPU picks; seeded random
    rows (CUDA draws its own noise) keep to the bias and reproduce."""
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(9)) * 3
    top2 = logits.topk(2, dim=-1).indices
    biases = [{int(top2[0, 0]): -100}, None, {7: 100, 8: -3}, {int(top2[3, 0]): -100, 1: 2},
              None, {int(logits[5].argmin()): 100}]

    def run(dev: str) -> list[int]:
        s = Sampler()
        reqs = [Request(f"r{i}", [1], SamplingParams(temperature=0.0 if i % 2 == 0 else 0.8,
                                                     seed=i, logit_bias=b))
                for i, b in enumerate(biases)]
        x = logits.to(dev, torch.bfloat16)
        return s(x, reqs, [s.new_state(r, VOCAB, dev) for r in reqs]).token_ids

    cpu, cuda = run("cpu"), run("cuda")
    assert cuda[0::2] == cpu[0::2] and cuda[0] == int(top2[0, 1]) and cuda[2] == 7
    assert cuda[3] != int(top2[3, 0]) and cuda[5] == int(logits[5].argmin())
    assert run("cuda") == cuda


@pytest.mark.gpu
def test_gpu_fast_paths_apply_the_bias_and_speculation_stays_exact() -> None:
    plain = LLM("tiny-qwen3", **GPU)
    ref = tokens(plain.generate(PROMPTS, greedy()))
    forced = next(t for t in range(100, VOCAB) if all(t not in r for r in ref))
    ban = {ref[0][0]: -100, ref[0][3]: -100}
    params = [greedy(logit_bias=ban), greedy(),
              SamplingParams(max_tokens=12, temperature=0.8, seed=11, ignore_eos=True,
                             logit_bias=ban),
              greedy(logit_bias={forced: 100})]
    ahead = plain.engine.runner.ahead
    assert ahead is not None and plain.engine.runner.cuda_graphs is not None
    hits = ahead.hits
    want = tokens(plain.generate(PROMPTS, params))
    assert ahead.hits > hits  # decode steps launched ahead from the biased sampler's ids
    assert want[3] == [forced] * 12 and want[1] == ref[1]
    assert want[0][0] != ref[0][0] and not set(want[0]) & set(ban)
    spec = LLM("tiny-qwen3", speculative=SpecConfig(num_speculative_tokens=2, batch_k_caps=()),
               **GPU)
    assert spec.engine.runner.spec.draft_graphs is not None
    assert tokens(spec.generate(PROMPTS, params)) == want
    assert tokens(spec.generate(PROMPTS[:1], params[3])) == want[3:]
    assert spec.engine.spec_stats.num_drafts > 0  # the unbiased request speculated

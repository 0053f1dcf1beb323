"""A request resumed with output tokens already sent (a stream continued after its decode
worker died) goes on exactly as the uninterrupted run: same tokens (greedy, penalties,
seeded sampling), the text deltas complete the text already sent (held-back characters and
stop strings across the boundary included), max_tokens counts the resumed tokens."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pdserve.engine.core.detokenizer import IncrementalDetokenizer
from pdserve.engine.core.sampling_params import InvalidRequestError, SamplingParams
from pdserve.engine.llm import LLM
from pdserve.engine.llm_engine import LLMEngine

PROMPT = "The three most famous painters of the Renaissance were"


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLM(device="cpu", dtype="float32", max_num_batched_tokens=256).engine


def run(engine: LLMEngine, params: SamplingParams, resume: list[int] = (),
        prompt: str = PROMPT) -> dict:
    """One request to completion: tokens, per-step text deltas, logprobs, finish, count."""
    [rid] = engine.add_request(prompt, params, resume_output_ids=resume)
    res = {"tokens": [], "deltas": [], "logprobs": [], "finish": None, "count": 0}
    for out in engine.generate_until_done():
        assert out.request_id == rid
        res["tokens"] += out.new_token_ids
        res["deltas"].append(out.new_text)
        res["logprobs"] += out.new_logprobs
        res["finish"], res["count"] = out.finish_reason, out.num_output_tokens
    return res


def check_resumed(engine: LLMEngine, params: SamplingParams, full: dict, k: int) -> dict:
    """Resume at token k of `full` (one token per step there, so deltas[:k] is the text the
    client had): the rest is the same, token for token and character for character."""
    got = run(engine, params, full["tokens"][:k])
    assert got["tokens"] == full["tokens"][k:], k
    assert "".join(full["deltas"][:k]) + "".join(got["deltas"]) == "".join(full["deltas"]), k
    assert (got["finish"], got["count"]) == (full["finish"], full["count"])
    return got


def test_greedy_with_penalties_and_logprobs_continues_exactly(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2,
                            repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3)
    full = run(engine, params)
    assert len(full["tokens"]) == len(full["deltas"]) == 20  # one token per step
    for k in (1, 9):
        got = check_resumed(engine, params, full, k)
        # max_tokens counts the resumed tokens; logprobs go on from position k
        assert len(got["tokens"]) == 20 - k and got["finish"] == "length"
        for (a, top_a), (b, top_b) in zip(got["logprobs"], full["logprobs"][k:], strict=True):
            assert a == pytest.approx(b, abs=1e-3)
            assert [t for t, _ in top_a] == [t for t, _ in top_b]
    # without the penalties the continuation differs: they really saw the resumed tokens
    plain = run(engine, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    assert plain["tokens"] != full["tokens"]


def test_seeded_sampling_continues_the_same_random_stream(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=1234,
                            ignore_eos=True)
    check_resumed(engine, params, run(engine, params), 6)


def test_stop_string_across_the_resume_point_still_matches(engine: LLMEngine) -> None:
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    free = run(engine, greedy)
    text = "".join(free["deltas"])
    # a stop string: the last 3 characters before token k and the first 2 of token k,
    # occurring first right there
    for k in range(4, 20):
        sent = "".join(free["deltas"][:k])
        stop = sent[-3:] + free["deltas"][k][:2]
        if len(free["deltas"][k]) >= 2 and text.find(stop) == len(sent) - 3:
            break
    else:
        raise AssertionError(f"no usable stop string in {text!r}")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
    stopped = run(engine, params)
    assert stopped["finish"] == "stop" and len(stopped["tokens"]) == k + 1
    assert "".join(stopped["deltas"]) == text[:text.find(stop)]
    # the stop string's first part was held back when the stream broke: it never shows
    got = check_resumed(engine, params, stopped, k)
    assert got["tokens"] == [free["tokens"][k]]


def test_resume_that_leaves_nothing_to_generate_is_refused(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=4, temperature=0.0)
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request(PROMPT, params, resume_output_ids=[5, 6, 7, 8])
    assert e.value.param == "resume_output_ids"
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request(PROMPT, params, resume_output_ids=[10**9])
    assert e.value.param == "resume_output_ids"
    assert not engine.has_unfinished()


# -- the detokenizer alone: every split point, held-back bytes and stop prefixes ----------------
@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    """A tiny byte-level BPE trained on ASCII only: emoji and CJK stay split into bytes."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the answer is here and there, the end"] * 20, trainer)
    return tok


@pytest.mark.parametrize("stop", [(), ("日本語", "is here")])
def test_primed_detokenizer_emits_exactly_the_rest(bpe: Tokenizer, stop: tuple[str, ...]) -> None:
    prompt = bpe.encode("Q:").ids
    ids = bpe.encode("the answer 🎉 is here 日本語 and there").ids

    def feed(detok: IncrementalDetokenizer, tokens: list[int]) -> list[str]:
        out = []
        for t in tokens:
            out.append(detok.add([t]).new_text)
            if detok.stopped:
                return out
        return out + [detok.flush()]

    full = feed(IncrementalDetokenizer(bpe, prompt, stop), ids)
    for k in range(len(full) - 1):  # every point at which a stream could break
        detok = IncrementalDetokenizer(bpe, prompt, stop)
        assert not detok.prime(ids[:k])
        assert "".join(full[:k]) + "".join(feed(detok, ids[k:])) == "".join(full), k

"""vLLM's bad_words through the engine on a tiny random model (CPU), as token sequences: a
one-token word is never sampled; a longer one never completes, while its last token still
comes where the output does not end with the rest of it; it applies after logit_bias and to
seeded sampling; validation names the field; the sequences cross the wire; MTP speculation
leaves such requests token for token equal to plain decoding (they are not drafted for). As
words (vLLM's offline API), on the embedded SmolLM2: the engine tokenizes them."""
from __future__ import annotations

import pytest

from pdserve.engine.core.config import SpecConfig
from pdserve.engine.core.sampling_params import InvalidRequestError, SamplingParams
from pdserve.engine.exec.sampler import bad_word_bans
from pdserve.engine.llm import LLM
from pdserve.proto.convert import params_from_proto, params_to_proto

TINY = dict(device="cpu", block_size=4, num_blocks=256)
VOCAB = 512  # tiny-qwen3's
PROMPTS = [[5 + i, 17, 99, 3 * i + 1, 42] * (i + 1) for i in range(4)]


def params(**kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=16, ignore_eos=True, **{"temperature": 0.0, **kw})


def tokens(results) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in results]


def pairs(out: list[int]) -> set[tuple[int, int]]:
    return set(zip(out, out[1:]))


def first_new(out: list[int]) -> int:
    """The first position i > 1 whose token the output has not said before."""
    return next(i for i in range(2, len(out)) if out[i] not in out[:i])


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-qwen3", **TINY)


@pytest.fixture(scope="module")
def plain(llm: LLM) -> list[list[int]]:
    return tokens(llm.generate(PROMPTS, params()))


def test_a_one_token_word_is_never_sampled(llm: LLM, plain: list[list[int]]) -> None:
    i = first_new(plain[0])
    word = plain[0][i]
    got = tokens(llm.generate(PROMPTS, params(bad_words_token_ids=[[word]])))
    assert all(word not in out for out in got)
    assert got[0][:i] == plain[0][:i]  # the same up to the banned token
    hot = tokens(llm.generate(PROMPTS, params(bad_words_token_ids=[[word]], temperature=1.0,
                                              seed=3, logit_bias={word: 100.0})))
    assert all(word not in out for out in hot)  # +100 cannot lift it: the ban comes after


def test_a_longer_word_never_completes_but_its_tokens_stay(llm: LLM,
                                                          plain: list[list[int]]) -> None:
    i = first_new(plain[0])
    a, b = plain[0][i - 1], plain[0][i]  # the plain output says a then b, b first there
    got = tokens(llm.generate(PROMPTS, params(bad_words_token_ids=[(a, b)])))
    assert all((a, b) not in pairs(out) for out in got)
    assert got[0][:i] == plain[0][:i] and got[0][i] != b  # banned right after a
    # a word whose first token the output never says bans nothing
    absent = next(t for t in range(VOCAB) if all(t not in out for out in plain))
    same = tokens(llm.generate(PROMPTS, params(bad_words_token_ids=[(absent, b)])))
    assert same == plain


def test_bans_follow_the_output_so_far() -> None:
    from pdserve.engine.core.request import Request

    p = SamplingParams(bad_words_token_ids=[(7,), (1, 2), (1, 2, 3), (9, 9)])
    req = Request("r", [4, 1, 2], p)  # the prompt's 1, 2 do not count: output only
    assert bad_word_bans(req) == [7]
    req.output_token_ids.extend([1, 2])
    assert bad_word_bans(req) == [3, 7]
    req.output_token_ids.append(9)
    assert bad_word_bans(req) == [7, 9]
    assert bad_word_bans(Request("s", [1], SamplingParams())) == []


def test_bad_words_name_the_field(llm: LLM) -> None:
    for bad in ([[]], [[-1]], [[1.5]], [[True]], [1, 2], "ab", [[1]] * 257, [[1] * 65]):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(bad_words_token_ids=bad)
        assert e.value.param == "bad_words"
    with pytest.raises(InvalidRequestError) as e:  # refused before the request is admitted
        llm.generate(PROMPTS[0], params(bad_words_token_ids=[(3, VOCAB)]))
    assert e.value.param == "bad_words" and str(VOCAB) in str(e.value)
    assert not llm.engine.has_unfinished()
    p = params(bad_words_token_ids=[(5,), (6, 7, 8)])
    assert params_from_proto(params_to_proto(p)) == p
    assert params_from_proto(params_to_proto(params())).bad_words_token_ids is None
    assert SamplingParams(bad_words_token_ids=[]).bad_words_token_ids is None


def test_speculation_leaves_bad_word_requests_equal_to_plain_decoding(
        llm: LLM, plain: list[list[int]]) -> None:
    ban = params(bad_words_token_ids=[(plain[0][first_new(plain[0])],)])
    want = tokens(llm.generate(PROMPTS[:2], [ban, params()]))
    spec = LLM("tiny-qwen3", speculative=SpecConfig(num_speculative_tokens=2, batch_k_caps=()),
               **TINY)
    alone = spec.generate(PROMPTS[0], ban)
    assert tokens(alone) == want[:1] and spec.engine.spec_stats.num_drafts == 0
    assert tokens(spec.generate(PROMPTS[:2], [ban, params()])) == want


def test_offline_words_are_tokenized_by_the_engine(llm: LLM) -> None:
    """SamplingParams(bad_words=[...]) as in vLLM's offline API: the engine tokenizes the
    words (as the router does for HTTP) and the word never comes; a model without a
    tokenizer refuses them naming the field."""
    from pdserve.engine.core.sampling_params import bad_word_sequences

    smol = LLM(**TINY)  # the embedded SmolLM2, with its tokenizer
    prompt = "1, 2, 3, 4,"
    greedy = dict(max_tokens=8, temperature=0.0)
    plain = smol.generate(prompt, SamplingParams(**greedy))[0].outputs[0]
    assert plain.text.lstrip().startswith("5")
    banned = smol.generate(prompt, SamplingParams(**greedy, bad_words=["5"]))[0].outputs[0]
    five = {q[-1] for q in bad_word_sequences(
        lambda t: smol.engine.tokenizer.encode(t, add_special_tokens=False), ["5"])}
    assert not five & set(banned.token_ids) and banned.text != plain.text
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(bad_words=[""])
    assert e.value.param == "bad_words"
    with pytest.raises(InvalidRequestError) as e:  # tiny-qwen3, a preset: no tokenizer
        llm.generate(PROMPTS[0], params(bad_words=["x"]))
    assert e.value.param == "bad_words"

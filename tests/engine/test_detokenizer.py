"""Incremental detokenizer with real byte-level BPE tokenizers: stop strings, UTF-8, windows."""
from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pdserve.engine.core.detokenizer import DetokResult, IncrementalDetokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, the answer is 42 and the question is unknown.",
    "Stop here and continue with more text, please.",
    "Paris is the capital of France; Berlin is the capital of Germany.",
]
PROMPT = "Tell me something:"


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    """A tiny byte-level BPE trained on ASCII only: emoji and CJK stay split into bytes."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    return tok


class CountingTokenizer:
    """The real tokenizer, recording how many ids each decode call sees."""

    def __init__(self, tok) -> None:
        self.tok, self.calls = tok, []
        self.encode = tok.encode

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.calls.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def stream(tok, ids: list[int], stop: tuple[str, ...] = (),
           prompt: str = PROMPT) -> tuple[IncrementalDetokenizer, list[DetokResult]]:
    """Feed ids one at a time, stopping at the first stop-string match."""
    detok = IncrementalDetokenizer(tok, tok.encode(prompt).ids, stop)
    results = []
    for t in ids:
        results.append(detok.add([t]))
        if results[-1].stopped:
            break
    return detok, results


def emitted(results: list[DetokResult]) -> str:
    return "".join(r.new_text for r in results)


def split_point(tok, ids: list[int], text: str, stop: str) -> int:
    """Index of the token that completes the first occurrence of `stop` in text."""
    end = text.index(stop) + len(stop)
    for i in range(len(ids)):
        if len(tok.decode(ids[: i + 1])) >= end:
            return i
    raise AssertionError(f"{stop!r} not in {text!r}")


# -- no stop: the stream is the decode ---------------------------------------------------------
@pytest.mark.parametrize("text", [
    "Hello world, the answer is 42.",
    "Emoji 🎉🚀 and CJK 日本語テキスト, accents: déjà vu, ñ.",
    "  leading spaces and\nnew lines\n\ttabs  ",
])
def test_concatenated_new_text_equals_full_decode(bpe, text: str) -> None:
    ids = bpe.encode(text).ids
    detok, results = stream(bpe, ids)
    tail = detok.flush()
    assert emitted(results) + tail == bpe.decode(ids) == text
    assert detok.text == text
    assert not any(r.stopped for r in results)


def test_multibyte_characters_split_across_tokens_come_out_whole(bpe) -> None:
    text = "ok 🎉 日本 done"
    ids = bpe.encode(text).ids
    assert any("\ufffd" in bpe.decode([t]) for t in ids), "precondition: characters are split"
    detok, results = stream(bpe, ids)
    chunks = [r.new_text for r in results]
    assert all("\ufffd" not in c for c in chunks)
    assert "" in chunks  # some steps had only part of a character: held back
    assert sum("🎉" in c for c in chunks) == 1 and sum("日本" in c for c in chunks) <= 1
    assert "".join(chunks) + detok.flush() == text


def test_random_ids_stream_equals_decode(bpe) -> None:
    """Random byte tokens make invalid UTF-8 mid-stream; the stream still equals the decode."""
    rng = random.Random(0)
    vocab = bpe.get_vocab_size()
    for _ in range(30):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        detok, results = stream(bpe, ids)
        assert emitted(results) + detok.flush() == bpe.decode(ids)


def test_decode_window_stays_small(bpe) -> None:
    ids = bpe.encode(" ".join(CORPUS * 4) + " 🎉 日本語").ids
    assert len(ids) > 150
    counting = CountingTokenizer(bpe)
    detok, results = stream(counting, ids)
    assert emitted(results) + detok.flush() == bpe.decode(ids)
    assert max(counting.calls) <= 5 + 4  # prompt context + a few tokens, never the whole output


def test_special_tokens_skipped(bpe) -> None:
    eos = bpe.token_to_id("<eos>")
    ids = bpe.encode("Hello world").ids + [eos]
    detok, results = stream(bpe, ids)
    assert emitted(results) + detok.flush() == "Hello world"
    kept = IncrementalDetokenizer(bpe, [1], skip_special_tokens=False)
    assert kept.add(ids).new_text + kept.flush() == "Hello world<eos>"


# -- stop strings -------------------------------------------------------------------------------
def test_stop_string_split_across_tokens_ends_output_without_it(bpe) -> None:
    text = "Hello world, I say STOP now and more."
    ids = bpe.encode(text).ids
    stop = "STOP"
    last = split_point(bpe, ids, text, stop)
    assert all(stop not in bpe.decode([t]) for t in ids), "precondition: the stop spans tokens"
    detok, results = stream(bpe, ids, stop=(stop,))
    assert len(results) == last + 1  # stopped on the token that completed it
    assert results[-1].stopped and results[-1].stop_string == stop
    assert emitted(results) == detok.text == "Hello world, I say "
    assert stop not in detok.text and "S" not in detok.text
    assert detok.add(ids[last + 1:]) == DetokResult("", True, stop)
    assert detok.flush() == ""


def test_include_stop_keeps_the_stop_string_as_the_end(bpe) -> None:
    """vLLM's include_stop_str_in_output: the same stop, on the same token, but the text ends
    with the stop string instead of before it (nothing after it)."""
    text = "Hello world, I say STOP now and more."
    ids = bpe.encode(text).ids
    last = split_point(bpe, ids, text, "STOP")
    detok = IncrementalDetokenizer(bpe, bpe.encode(PROMPT).ids, ("STOP",), include_stop=True)
    out = [detok.add([t]) for t in ids[:last + 1]]
    assert out[-1].stopped and out[-1].stop_string == "STOP"
    assert emitted(out) == detok.text == "Hello world, I say STOP"


def test_stop_string_across_a_word_boundary(bpe) -> None:
    text = "the quick brown fox jumps"
    ids = bpe.encode(text).ids
    stop = "k bro"  # tail of one token + head of the next
    assert all(stop not in bpe.decode([t]) for t in ids)
    detok, results = stream(bpe, ids, stop=(stop,))
    assert results[-1].stopped and detok.text == "the quic"


def test_partial_match_is_held_then_released(bpe) -> None:
    text = "Hello world, the end."
    ids = bpe.encode(text).ids
    detok = IncrementalDetokenizer(bpe, bpe.encode(PROMPT).ids, (" world peace",))
    seen = []
    for t in ids:
        r = detok.add([t])
        assert not r.stopped
        seen.append(detok.text)
    upto_world = split_point(bpe, ids, text, " world")
    assert seen[upto_world] == "Hello"  # " world" could begin " world peace": held
    assert seen[upto_world + 1] == "Hello world,"  # "," ruled it out: released
    assert detok.flush() == "" and detok.text == text


def test_flush_releases_a_partial_match_at_the_end(bpe) -> None:
    ids = bpe.encode("the answer is 4").ids
    detok, results = stream(bpe, ids, stop=("42",))
    assert emitted(results) == "the answer is "
    assert detok.flush() == "4"
    assert detok.text == "the answer is 4" and not detok.stopped


def test_earliest_stop_wins_and_stop_at_the_start(bpe) -> None:
    text = "the lazy dog and the quick fox"
    ids = bpe.encode(text).ids
    detok, results = stream(bpe, ids, stop=("quick", "dog"))
    assert results[-1].stop_string == "dog" and detok.text == "the lazy "
    at_once = IncrementalDetokenizer(bpe, [1], ("quick", "dog"))  # both in one chunk
    assert at_once.add(ids) == DetokResult("the lazy ", True, "dog")
    detok, results = stream(bpe, ids, stop=("the",))
    assert results[-1] == DetokResult("", True, "the")  # the output starts with the stop
    assert emitted(results) == detok.text == ""


def test_many_tokens_in_one_add(bpe) -> None:
    """Speculative decoding hands over several accepted tokens at once."""
    text = "Paris is the capital of France; Berlin is next."
    ids = bpe.encode(text).ids
    detok = IncrementalDetokenizer(bpe, bpe.encode(PROMPT).ids, (";",))
    out = [detok.add(ids[i:i + 3]) for i in range(0, len(ids), 3)]
    stops = [i for i, r in enumerate(out) if r.stopped]
    assert stops and detok.text == "Paris is the capital of France"
    assert all(r.new_text == "" for r in out[stops[0] + 1:])


def test_empty_stop_string_rejected(bpe) -> None:
    with pytest.raises(ValueError, match=r"stop\[1\]"):
        IncrementalDetokenizer(bpe, [1], ("ok", ""))


# -- the embedded model's real tokenizer ----------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2(hf_smollm2_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(hf_smollm2_dir)


def test_smollm2_tokenizer_stream_and_stop(smollm2) -> None:
    text = "The capital of France is Paris. 🎉 日本語 ok.\nUser: next question"
    ids = smollm2.encode(text, add_special_tokens=False)
    assert any("\ufffd" in smollm2.decode([t]) for t in ids), "precondition: split characters"
    prompt = smollm2.encode("What is the capital of France?", add_special_tokens=False)
    detok = IncrementalDetokenizer(smollm2, prompt, ())
    chunks = [detok.add([t]).new_text for t in ids]
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) + detok.flush() == smollm2.decode(ids) == text

    detok = IncrementalDetokenizer(smollm2, prompt, ("\nUser:",))
    results = [detok.add([t]) for t in ids]
    stopped = [r for r in results if r.stopped]
    assert stopped and stopped[0].stop_string == "\nUser:"
    assert detok.text == "The capital of France is Paris. 🎉 日本語 ok."

"""Our tokenizer, rebuilt from the embedded SmolLM2 GGUF's metadata (and from a HF folder),
must give transformers' ids, decodes and chat template output."""
from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.engine.model.gguf_weights import open_gguf
from pdserve.engine.model.loader import embedded_gguf_path
from pdserve.engine.model.tokenizer import Tokenizer, TokenizerError, byte_alphabet

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world",
    "What is the capital of France?",
    "  leading, trailing   and  double  spaces  ",
    "héllo wörld — ünïcödé: 日本語のテキスト, Ελληνικά, русский 🤖🚀",
    "def f(x):\n    return x ** 2  # square\n\tprint(f'{x=}')\n",
    "1234567890 3.14159 1,000,000 -42 0x1F 2024-06-01",
    "It's they're we'll I'd DON'T",
    "\n\n\nmultiple\r\nline\rbreaks\n \n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<|im_end|> <|im_start|>",
    "",
    "a" * 40 + " " + "!?" * 7,
]

CHAT = [{"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return Tokenizer.from_gguf(open_gguf(embedded_gguf_path()))


@pytest.fixture(scope="module")
def ref(hf_smollm2_dir):
    return transformers.AutoTokenizer.from_pretrained(hf_smollm2_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_transformers(ours: Tokenizer, ref, text: str) -> None:
    ids = ours.encode(text)
    assert ids == ref(text)["input_ids"]
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)


def test_special_tokens_stay_whole(ours: Tokenizer) -> None:
    ids = ours.encode("<|im_start|>user")
    assert ids[0] == ours.token_to_id("<|im_start|>") == 1
    assert ours.decode(ids) == "user"  # specials are skipped by default
    assert ours.decode(ids, skip_special_tokens=False) == "<|im_start|>user"


def test_chat_template_matches_transformers(ours: Tokenizer, ref) -> None:
    text = ours.apply_chat_template(CHAT)
    assert text == ref.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert ours.encode(text) == ref.apply_chat_template(CHAT, tokenize=True,
                                                        add_generation_prompt=True, return_dict=False)
    # no system message: the template inserts its default one
    user_only = CHAT[1:]
    assert ours.apply_chat_template(user_only, add_generation_prompt=False) == \
        ref.apply_chat_template(user_only, tokenize=False, add_generation_prompt=False)


def test_special_ids_and_sizes(ours: Tokenizer, ref) -> None:
    assert ours.bos_token_id == ref.bos_token_id == 1
    assert ours.eos_token_ids == (ref.eos_token_id,) == (2,)
    assert ours.vocab_size == len(ref) == 49152
    assert ours.id_to_piece(ours.encode(" the")[0]) == "Ġthe"
    assert len(set(byte_alphabet().values())) == 256


def test_hf_folder_tokenizer_matches(ours: Tokenizer, ref, tmp_path: Path) -> None:
    ref.save_pretrained(tmp_path)
    from_dir = Tokenizer.from_hf_dir(tmp_path)
    for text in TEXTS:
        assert from_dir.encode(text) == ours.encode(text)
    assert from_dir.apply_chat_template(CHAT) == ours.apply_chat_template(CHAT)
    assert 2 in from_dir.eos_token_ids


def test_missing_tokenizer_file(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=f"{tmp_path}.*tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)

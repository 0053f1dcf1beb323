"""A 512-token byte-level BPE tokenizer for the tiny presets (which ship none), so grammars can
constrain their random models: ids 0-3 special (2 = </s>, the presets' EOS), 4-259 the 256
bytes, 260-511 two-character merges of JSON punctuation, letters and digits."""
from __future__ import annotations

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from pdserve.engine.model.tokenizer import Tokenizer, byte_alphabet

SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]
EOS = 2


def tiny_tokenizer(vocab_size: int = 512) -> Tokenizer:
    spell = byte_alphabet()
    pieces = SPECIAL + [spell[b] for b in range(256)]
    chars = [spell[ord(c)] for c in '{}":, abcdefghijklmnopqrstuvwxyz0123456789']
    merges = [(a, b) for a in chars for b in chars][:vocab_size - len(pieces)]
    vocab = {p: i for i, p in enumerate(pieces + [a + b for a, b in merges])}
    backend = Backend(models.BPE(vocab=vocab, merges=merges, dropout=None,
                                 continuing_subword_prefix="", end_of_word_suffix="",
                                 fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    assert backend.get_vocab_size() == vocab_size
    return Tokenizer(backend, bos_token_id=1, eos_token_ids=(EOS,), chat_template=None,
                     source="tiny-vocab")

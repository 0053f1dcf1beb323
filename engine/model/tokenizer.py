"""Tokenizer: a `tokenizers` backend plus the chat template, built from a HF folder or a GGUF.

A GGUF carries no tokenizer.json, only llama.cpp metadata (tokens, merges, token types,
special ids, chat template). For byte-level BPE vocabularies ("gpt2") we rebuild the same
pipeline transformers builds from that metadata: BPE over GPT-2's byte alphabet, a byte-level
pre-tokenizer (with the model's split regex where llama.cpp names a known one) and decoder,
and control tokens registered as special so that "<|im_start|>" in text stays one token.
"""
from __future__ import annotations

import json
import logging
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from pdserve.engine.model.identity import gguf_tokenizer_fingerprint, hf_tokenizer_fingerprint

if TYPE_CHECKING:
    from pdserve.engine.model.gguf_reader import GGUFFile

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types

# Split patterns of the pre-tokenizers llama.cpp names in tokenizer.ggml.pre; others use GPT-2's.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
           "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


_GPT2_REGEX_PRES = {None, "", "default", "gpt-2", "gpt2", "smollm", "starcoder", "refact"}
log = logging.getLogger(__name__)


class TokenizerError(ValueError):
    """The tokenizer files or metadata cannot be used; the message names the source."""


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte: printable Latin-1 bytes stand for themselves,
    the rest (controls, space, ...) map to code points 256 and up, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    spelling, extra = {}, 0
    for b in range(256):
        if b in keep:
            spelling[b] = chr(b)
        else:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


def _render_template(template: str, **context: object) -> str:
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: object, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        # jinja's own tojson HTML-escapes; chat templates expect plain JSON
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template).render(**context)


def _cut_after_final(text: str, final: dict) -> str:
    """`text` cut right after the final message's content. Templates often strip a message,
    so the content is looked up stripped; its trailing whitespace is kept when the template
    kept it."""
    content = final.get("content")
    if not isinstance(content, str) or not content.strip():
        raise TokenizerError("continue_final_message: the final message has no text to continue")
    core = content.strip()
    at = text.rfind(core)
    if at < 0:
        raise TokenizerError("continue_final_message: the chat template does not write the "
                             "final message's text")
    kept = content.lstrip()
    end = at + (len(kept) if text[at:at + len(kept)] == kept else len(core))
    return text[:end]


class Tokenizer:
    def __init__(self, backend: Backend, *, bos_token_id: int | None,
                 eos_token_ids: tuple[int, ...], chat_template: str | None,
                 source: str = "", fingerprint: str = "") -> None:
        """fingerprint: a digest of what it was built from (engine/model/identity.py), taken
        by the constructors below while that content is at hand; the KV compatibility payload
        compares it between workers (ModelIdentity.tokenizer). "" for one built by hand."""
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        self.source = source
        self.fingerprint = fingerprint
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)

    # -- text <-> ids --------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_piece(self, token_id: int) -> str | None:
        """The vocabulary entry as stored (byte-level spelling, e.g. 'Ġthe')."""
        return self.backend.id_to_token(token_id)

    def token_to_id(self, piece: str) -> int | None:
        return self.backend.token_to_id(piece)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.id_to_piece(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self.id_to_piece(self.eos_token_ids[0]) if self.eos_token_ids else None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **kwargs: object) -> str:
        """Render the model's jinja chat template, as transformers does (same globals/filters).

        continue_final_message: the text ends inside the last message (an assistant turn the
        model should continue), without the end-of-turn the template writes after it."""
        if not self.chat_template:
            raise TokenizerError(f"{self.source}: this model has no chat template")
        text = _render_template(self.chat_template, messages=messages,
                                add_generation_prompt=add_generation_prompt,
                                bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                **kwargs)
        return _cut_after_final(text, messages[-1]) if continue_final_message else text

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def from_hf_dir(cls, folder: str | Path) -> Tokenizer:
        """tokenizer.json (+ tokenizer_config.json, chat_template.jinja, generation_config.json)."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        try:
            backend = Backend.from_file(str(path))
        except Exception as e:  # missing file or bad JSON; tokenizers raises a plain Exception
            raise TokenizerError(f"{path}: cannot load tokenizer: {e}") from e
        config = _read_json(folder / "tokenizer_config.json")
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = folder / "chat_template.jinja"  # transformers 5 saves it on its own
        if jinja_file.is_file():
            template = jinja_file.read_text()

        def token_id(entry: object) -> int | None:
            text = entry.get("content") if isinstance(entry, dict) else entry
            return backend.token_to_id(text) if isinstance(text, str) else None

        eos = [token_id(config.get("eos_token"))]
        gen_eos = _read_json(folder / "generation_config.json").get("eos_token_id")
        eos += gen_eos if isinstance(gen_eos, list) else [gen_eos]
        return cls(backend, bos_token_id=token_id(config.get("bos_token")),
                   eos_token_ids=tuple(dict.fromkeys(e for e in eos if e is not None)),
                   chat_template=template, source=str(folder),
                   fingerprint=hf_tokenizer_fingerprint(folder))

    @classmethod
    def from_gguf(cls, reader: GGUFFile) -> Tokenizer:
        """Byte-level BPE ("gpt2") tokenizers from GGUF metadata; see the module docstring."""
        source = str(reader.data.filename)

        def meta(key: str, default: object = None) -> object:
            field = reader.fields.get(key)
            return default if field is None else field.value

        kind = meta("tokenizer.ggml.model")
        if kind != "gpt2":
            raise TokenizerError(f"{source}: tokenizer.ggml.model {kind!r} is not supported (gpt2)")
        tokens: list[str] = meta("tokenizer.ggml.tokens")
        if not tokens:
            raise TokenizerError(f"{source}: GGUF metadata 'tokenizer.ggml.tokens' is missing")
        types: list[int] = meta("tokenizer.ggml.token_type", [])
        backend = _byte_level_bpe(tokens, meta("tokenizer.ggml.merges", []),
                                  meta("tokenizer.ggml.pre"),
                                  bool(meta("tokenizer.ggml.add_space_prefix", False)))
        _register_special(backend, tokens, types)
        bos = meta("tokenizer.ggml.bos_token_id")
        if bos is not None and meta("tokenizer.ggml.add_bos_token", False):
            backend.post_processor = processors.TemplateProcessing(
                single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B",
                special_tokens=[(tokens[bos], bos)])
        eos = [meta("tokenizer.ggml.eos_token_id"), meta("tokenizer.ggml.eot_token_id")]
        return cls(backend, bos_token_id=bos,
                   eos_token_ids=tuple(dict.fromkeys(e for e in eos if e is not None)),
                   chat_template=meta("tokenizer.chat_template"), source=source,
                   fingerprint=gguf_tokenizer_fingerprint(reader))


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{path}: cannot read: {e}") from e


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str | None,
                    add_prefix_space: bool) -> Backend:
    alphabet = byte_alphabet()
    letters = set(alphabet.values())
    # llama.cpp stores byte-level spellings; a token with other characters is re-spelled
    vocab = {(t if set(t) <= letters else "".join(alphabet[b] for b in t.encode())): i
             for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = Backend(models.BPE(vocab=vocab, merges=pairs, dropout=None,
                                 continuing_subword_prefix="", end_of_word_suffix="",
                                 fuse_unk=False))
    split = _SPLITS.get(pre or "")
    if split is None and pre not in _GPT2_REGEX_PRES:
        log.warning("GGUF pre-tokenizer %r is not known here; splitting text with GPT-2's regex, "
                    "which may give different ids than llama.cpp", pre)
    if split is None:  # GPT-2's own regex
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def _register_special(backend: Backend, tokens: list[str], types: list[int]) -> None:
    """Control tokens become special (never split, skipped on decode); user-defined ones are
    matched whole. A control token spelled outside the byte alphabet is a llama.cpp mislabel
    and is left alone, as it is not a real vocabulary entry."""
    letters = set(byte_alphabet().values())
    control = [AddedToken(t, special=True, normalized=False)
               for t, kind in zip(tokens, types) if kind == CONTROL and set(t) <= letters]
    user = [AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, types) if kind == USER_DEFINED and set(t) <= letters]
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)

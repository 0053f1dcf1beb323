"""StructuredOutput specs -> xgrammar CompiledGrammars, cached, compiled off the caller's loop.

One GrammarCompiler per tokenizer: the router's frontend has one (it compiles every spec to
refuse a bad one with a 400 before dispatch) and so has every engine (its requests' matchers
need the compiled grammar; the worker services compile on their gRPC thread before admission,
so the engine loop finds it cached).

    cache     bounded LRU keyed by StructuredOutput.key (a sha256 of the spec), holding the
              compile's future: equal specs compile once, a spec being compiled is waited on,
              not compiled twice, and a failure is cached too (sent again, refused at once)
    threads   compiles run on a small pool (xgrammar releases the GIL), never on an event loop
              or the engine loop thread
    deadline  compile(spec, timeout_s) / compile_async wait at most timeout_s, then raise
              InvalidRequestError naming the field. xgrammar cannot be interrupted: the compile
              runs on and lands in the cache (a retry finds it); the pool's size bounds the CPU
              that such compiles take
JSON comes out on one line with Python's default separators (", ", ": "): xgrammar's
any_whitespace would let a small model pad with whitespace until max_tokens.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import importlib
import json
import re
import threading
import types
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pdserve.engine.core.sampling_params import InvalidRequestError, StructuredOutput

if TYPE_CHECKING:
    import xgrammar as xgr


def xgrammar() -> types.ModuleType:
    """xgrammar, imported on the first grammar request: serving without structured outputs
    (and the modules that import this one) does not need it installed."""
    return importlib.import_module("xgrammar")

# "[09:23:34] /project/cpp/json_schema_converter.cc:4944: " and kin prefix xgrammar's errors
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class GrammarCompileError(ValueError):
    """xgrammar refused the spec; the message is xgrammar's, cleaned of its source location."""


def tokenizer_info(tokenizer: object, vocab_size: int, stop_ids: Sequence[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary: token id -> its stored piece, for the model's
    vocab_size rows of logits (padding rows beyond the tokenizer are never allowed).

    Special (control) tokens are given as "": xgrammar then never allows them (the stop tokens
    are its own list), so constrained text never holds a token the detokenizer would drop."""
    backend = tokenizer.backend  # engine.model.tokenizer.Tokenizer's `tokenizers` backend
    encoded = [""] * vocab_size
    for piece, i in backend.get_vocab(with_added_tokens=True).items():
        if i < vocab_size:
            encoded[i] = piece
    for i, added in backend.get_added_tokens_decoder().items():
        if added.special and i < vocab_size:
            encoded[i] = ""
    vocab_type, prefix_space = _vocab_metadata(backend.to_str())
    return xgrammar().TokenizerInfo(encoded, vocab_type=vocab_type, vocab_size=vocab_size,
                             stop_token_ids=list(stop_ids) or None,
                             add_prefix_space=prefix_space)


def _vocab_metadata(backend_json: str) -> tuple[xgr.VocabType, bool]:
    """How pieces spell bytes (byte-level BPE, byte fallback or raw) and whether the
    tokenizer prepends a space: xgrammar's own detection, the one from_huggingface uses."""
    xgr = xgrammar()
    try:
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend_json)
        return meta["vocab_type"], bool(meta["add_prefix_space"])
    except (AttributeError, RuntimeError, ValueError, KeyError):  # a private API moved
        kind = xgr.VocabType.BYTE_LEVEL if '"ByteLevel"' in backend_json else xgr.VocabType.RAW
        return kind, False


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF whose language is exactly the choices (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _clean(e: BaseException) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return _CPP_PREFIX.sub("", first)[:300]


class GrammarCompiler:
    def __init__(self, tokenizer: object, vocab_size: int, stop_ids: Sequence[int],
                 cache_size: int = 128, threads: int = 2) -> None:
        self.vocab_size, self.stop_ids = vocab_size, tuple(stop_ids)
        self.info = tokenizer_info(tokenizer, vocab_size, stop_ids)
        self._xgr = xgrammar().GrammarCompiler(self.info, max_threads=4, cache_enabled=False)
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[str, concurrent.futures.Future] = \
            collections.OrderedDict()
        self.cache_size = cache_size
        self.compiles = 0  # compiles started (a cache hit starts none)

    def submit(self, spec: StructuredOutput) -> concurrent.futures.Future:
        """The future of spec's compile: the cached one, or a new compile on the pool."""
        key = spec.key
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None and not fut.cancelled():
                self._cache.move_to_end(key)
                return fut
            fut = self._pool.submit(self._compile, spec)
            self.compiles += 1
            self._cache[key] = fut
            while len(self._cache) > self.cache_size:  # a running compile evicted runs on
                self._cache.popitem(last=False)
            return fut

    def compile(self, spec: StructuredOutput, timeout_s: float | None = None,
                param: str = "structured_outputs") -> xgr.CompiledGrammar:
        """Blocking compile (cached); errors are InvalidRequestError naming `param`."""
        try:
            return self.submit(spec).result(timeout_s)
        except concurrent.futures.TimeoutError:
            raise _too_slow(param, timeout_s) from None
        except GrammarCompileError as e:
            raise InvalidRequestError(param, f"cannot be compiled: {e}") from e

    async def compile_async(self, spec: StructuredOutput, timeout_s: float | None,
                            param: str) -> xgr.CompiledGrammar:
        """compile() for an event loop: the loop never blocks; the deadline is timeout_s."""
        fut = asyncio.wrap_future(self.submit(spec))
        try:  # shield: a deadline must not cancel the cached compile
            return await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        except TimeoutError:
            raise _too_slow(param, timeout_s) from None
        except GrammarCompileError as e:
            raise InvalidRequestError(param, f"cannot be compiled: {e}") from e

    def _compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        c, kind = self._xgr, spec.kind
        try:
            if kind == "json":
                return c.compile_json_schema(spec.json, any_whitespace=False)
            if kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return c.compile_regex(spec.regex)
            if kind == "choice":
                return c.compile_grammar(choice_grammar(spec.choice))
            if kind == "grammar":
                return c.compile_grammar(spec.grammar)
            return c.compile_structural_tag(spec.structural_tag)
        except Exception as e:  # xgrammar raises RuntimeError, InvalidJSONError, pydantic's...
            raise GrammarCompileError(_clean(e)) from e

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _too_slow(param: str, timeout_s: float | None) -> InvalidRequestError:
    return InvalidRequestError(param, f"took longer than {timeout_s:g} s to compile; "
                                      "simplify it (or send it again: the compile goes on)")

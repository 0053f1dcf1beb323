"""Per-request sampling parameters, validated when built so bad input names its field."""
from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace


class InvalidRequestError(ValueError):
    """A request field is invalid. `param` names the field (it becomes OpenAI's `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


class DuplicateRequestError(InvalidRequestError):
    """The request id is already in use on this engine or worker: a second request under it
    would take the first one's outputs or blocks (workers answer ALREADY_EXISTS)."""

    def __init__(self, request_id: str) -> None:
        super().__init__("request_id", f"{request_id!r} is already in use")


UINT32_MAX = 2**32 - 1
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# OpenAI's logit_bias bounds: |bias| <= 100, at most 300 entries
LOGIT_BIAS_MAX = 100.0
LOGIT_BIAS_MAX_ENTRIES = 300
BAD_WORDS_MAX = 256  # bad-word token sequences per request (a word tokenizes to up to two)
BAD_WORD_MAX_TOKENS = 64
CACHE_SALT_MAX_CHARS = 1024
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
MAX_CHOICES = 1024


@dataclass(frozen=True)
class StructuredOutput:
    """What a completion must match: exactly one field set (vLLM's StructuredOutputsParams).
    Torch- and xgrammar-free: engine/structured/compiler.py compiles it. Hashable, so equal
    specs share one compiled grammar (the compile cache keys on `key`)."""

    json: str | None = None  # a JSON schema, as JSON text (property order is kept)
    json_object: bool = False  # any JSON object (OpenAI's response_format json_object)
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # EBNF (xgrammar's dialect, GBNF-like)
    structural_tag: str | None = None  # an xgrammar structural tag as JSON (tool calls)

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        set_ = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(set_) != 1:
            raise InvalidRequestError("structured_outputs", "exactly one of "
                                      f"{', '.join(STRUCTURED_KINDS)} must be set, got "
                                      f"{set_ or 'none'}")
        kind = set_[0]
        value = getattr(self, kind)
        if kind == "choice":
            if not value or len(value) > MAX_CHOICES or \
                    not all(isinstance(c, str) and c for c in value):
                raise InvalidRequestError("structured_outputs.choice", "must be a list of 1 to "
                                          f"{MAX_CHOICES} non-empty strings")
        elif kind != "json_object" and (not isinstance(value, str) or not value):
            raise InvalidRequestError(f"structured_outputs.{kind}", "must be a non-empty string")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> str:
        """A stable digest of the spec (the compile cache's key, the same in every process)."""
        value = getattr(self, self.kind)
        text = json.dumps([self.kind, list(value) if isinstance(value, tuple) else value])
        return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = -1  # -1 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in prompt or output
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # vLLM's: EOS and stop_token_ids are banned (and stop strings not looked for) until the
    # output has this many tokens
    min_tokens: int = 0
    logprobs: int | None = None  # None = off; N = chosen token + top-N alternatives
    # None = off; N: each prompt token's logprob given the ones before it, + the top N there
    prompt_logprobs: int | None = None
    transfer_failure_policy: str = "retry"  # disaggregated: "retry" | "recompute" | "fail"
    # token id -> bias added to that token's logit before sampling (None = off; {} becomes
    # None). hash=False: a dict is unhashable, and equal params hash equal without it
    logit_bias: dict[int, float] | None = field(default=None, hash=False)
    # structured output (a grammar the tokens must match; None = off)
    structured: StructuredOutput | None = None
    # the output text (vLLM's): special tokens' text dropped (or kept); a matched stop string
    # cut from the text (or kept as its end)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's allowed_token_ids: only these ids may be sampled (None = all)
    allowed_token_ids: tuple[int, ...] | None = None
    # vLLM's bad_words: words no output may complete (the engine or the router tokenizes
    # them into bad_words_token_ids; only those travel on the wire)
    bad_words: tuple[str, ...] | None = None
    # as token sequences: a sequence's last token is banned wherever the output ends with
    # the rest of it (a one-token sequence: always)
    bad_words_token_ids: tuple[tuple[int, ...], ...] | None = None
    # vLLM's cache_salt: mixed into the prompt's first block hash, so only requests with the
    # same salt share prefix-cache blocks (one tenant cannot time another's cached prompts)
    cache_salt: str | None = None
    # vLLM's priority: with scheduling_policy "priority", lower is served (and kept from
    # preemption) first; equal priorities by arrival. Must be 0 under "fcfs"
    priority: int = 0
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        if self.bad_words is not None:
            words = self.bad_words
            if not isinstance(words, (list, tuple)) or not all(
                    isinstance(w, str) and w.strip() for w in words):
                raise InvalidRequestError("bad_words", "must be a list of non-empty strings")
            object.__setattr__(self, "bad_words", tuple(words) or None)
        if self.bad_words_token_ids is not None:
            object.__setattr__(self, "bad_words_token_ids", _checked_bad_words(
                self.bad_words_token_ids))
        object.__setattr__(self, "logit_bias", _checked_logit_bias(self.logit_bias))
        salt = self.cache_salt
        if salt is not None and (not isinstance(salt, str) or not salt
                                 or len(salt) > CACHE_SALT_MAX_CHARS):
            raise InvalidRequestError("cache_salt", f"must be a non-empty string of at most "
                                      f"{CACHE_SALT_MAX_CHARS} characters")
        if type(self.top_k) is int and self.top_k == 0:  # vLLM's other "off"
            object.__setattr__(self, "top_k", -1)
        self._validate()

    def _validate(self) -> None:
        def need(cond: bool, param: str, msg: str) -> None:
            if not cond:
                raise InvalidRequestError(param, msg)

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        # integer ranges are the wire's (proto/pdserve.proto: uint32, int32, int64): a value
        # that cannot cross to a worker is the client's error, named here, not a 500 later
        need(is_int(self.n) and 1 <= self.n <= UINT32_MAX, "n",
             f"must be an integer >= 1, got {self.n!r}")
        need(is_int(self.max_tokens) and 1 <= self.max_tokens <= UINT32_MAX, "max_tokens",
             f"must be an integer in [1, {UINT32_MAX}], got {self.max_tokens!r}")
        need(is_num(self.temperature) and not math.isnan(self.temperature)
             and self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature!r}")
        need(is_int(self.priority) and -INT32_MAX - 1 <= self.priority <= INT32_MAX,
             "priority", f"must be an integer in [{-INT32_MAX - 1}, {INT32_MAX}], "
                         f"got {self.priority!r}")
        need(is_int(self.top_k) and (self.top_k == -1 or 1 <= self.top_k <= INT32_MAX), "top_k",
             f"must be -1 or 0 (off) or in [1, {INT32_MAX}], got {self.top_k!r}")
        need(is_num(self.top_p) and 0 < self.top_p <= 1, "top_p",
             f"must be in (0, 1], got {self.top_p!r}")
        need(is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p",
             f"must be in [0, 1], got {self.min_p!r}")
        need(self.seed is None or (is_int(self.seed) and INT64_MIN <= self.seed <= INT64_MAX),
             "seed", f"must be a 64-bit signed integer, got {self.seed!r}")
        need(is_num(self.repetition_penalty) and self.repetition_penalty > 0,
             "repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            need(is_num(v) and -2 <= v <= 2, name, f"must be in [-2, 2], got {v!r}")
        need(all(isinstance(s, str) and s for s in self.stop), "stop",
             "every stop string must be a non-empty string")
        need(all(is_int(t) and 0 <= t <= UINT32_MAX for t in self.stop_token_ids),
             "stop_token_ids", f"must be integers in [0, {UINT32_MAX}]")
        need(is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
             f"must be an integer in [0, max_tokens = {self.max_tokens}], got {self.min_tokens!r}")
        # a grammar may only end with EOS, which min_tokens bans: the two could deadlock
        need(not (self.min_tokens and self.structured is not None), "min_tokens",
             "cannot be combined with structured outputs")
        need(self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= 20),
             "logprobs", f"must be an integer in [0, 20], got {self.logprobs!r}")
        need(self.prompt_logprobs is None
             or (is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20),
             "prompt_logprobs", f"must be an integer in [0, 20], got {self.prompt_logprobs!r}")
        need(self.transfer_failure_policy in ("retry", "recompute", "fail"),
             "transfer_failure_policy", "must be one of retry, recompute, fail")
        need(self.structured is None or isinstance(self.structured, StructuredOutput),
             "structured_outputs", "must be a StructuredOutput")
        allowed = self.allowed_token_ids
        need(allowed is None or (len(allowed) > 0 and all(
            is_int(t) and 0 <= t <= UINT32_MAX for t in allowed)), "allowed_token_ids",
             f"must be a non-empty list of token ids in [0, {UINT32_MAX}]")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            need(isinstance(getattr(self, name), bool), name,
                 f"must be a boolean, got {getattr(self, name)!r}")

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids that only the model can bound: logit_bias keys must index its logits
        (an id past the row would fail the sampler's indexing, on CUDA with a device assert)."""
        for name, ids in (("logit_bias", self.logit_bias or ()),
                          ("allowed_token_ids", self.allowed_token_ids or ()),
                          ("bad_words", [t for seq in self.bad_words_token_ids or ()
                                         for t in seq])):
            bad = sorted(t for t in ids if t >= vocab_size)
            if bad:
                raise InvalidRequestError(
                    name, f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def has_logit_bias(self) -> bool:
        return bool(self.logit_bias)

    @property
    def has_allowed(self) -> bool:
        return self.allowed_token_ids is not None

    def with_bad_words_tokenized(self, tokenizer: object | None) -> SamplingParams:
        """These params with bad_words as token sequences (bad_word_sequences, words encoded
        by `tokenizer` without special tokens), when they have words and no sequences yet;
        no tokenizer refuses the words."""
        if self.bad_words is None or self.bad_words_token_ids is not None:
            return self
        if tokenizer is None:
            raise InvalidRequestError("bad_words", "this model has no tokenizer; pass "
                                      "bad_words_token_ids")
        seqs = bad_word_sequences(
            lambda text: tokenizer.encode(text, add_special_tokens=False),  # type: ignore[attr-defined]
            self.bad_words)
        return replace(self, bad_words_token_ids=seqs or None)

    @property
    def has_bad_words(self) -> bool:
        return self.bad_words_token_ids is not None

    @property
    def has_grammar(self) -> bool:
        return self.structured is not None


def bad_word_sequences(encode: Callable[[str], list[int]],
                       words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad_words as token sequences: each word as written and after one space (the
    two usual tokenizations of a word inside a text), duplicates dropped. encode: text ->
    ids without special tokens."""
    seqs: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(encode(text))
            if ids:
                seqs[ids] = None
    return tuple(seqs)


def _checked_bad_words(seqs: object) -> tuple[tuple[int, ...], ...] | None:
    """bad_words_token_ids validated (errors name the field bad_words) and copied to tuples;
    None if empty."""
    def ok_seq(seq: object) -> bool:
        return isinstance(seq, (list, tuple)) and 0 < len(seq) <= BAD_WORD_MAX_TOKENS \
            and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= UINT32_MAX
                for t in seq)

    if not isinstance(seqs, (list, tuple)) or not all(ok_seq(q) for q in seqs):
        raise InvalidRequestError("bad_words", f"must be token sequences of 1 to "
                                  f"{BAD_WORD_MAX_TOKENS} ids in [0, {UINT32_MAX}]")
    if len(seqs) > BAD_WORDS_MAX:
        raise InvalidRequestError("bad_words", f"at most {BAD_WORDS_MAX} token sequences, "
                                  f"got {len(seqs)}")
    return tuple(tuple(q) for q in seqs) or None


def _checked_logit_bias(bias: object) -> dict[int, float] | None:
    """logit_bias validated (errors name the field) and copied to {int: float}; None if empty.
    The copy keeps a caller's later edits from bypassing validation of a frozen object."""
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise InvalidRequestError("logit_bias", "must be a map from token id to bias, got "
                                  f"{type(bias).__name__}")
    if len(bias) > LOGIT_BIAS_MAX_ENTRIES:
        raise InvalidRequestError("logit_bias", f"at most {LOGIT_BIAS_MAX_ENTRIES} entries, "
                                  f"got {len(bias)}")
    out: dict[int, float] = {}
    for token, value in bias.items():
        # the wire key is a uint32 (proto/pdserve.proto); the vocabulary bound is check_vocab's
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= UINT32_MAX:
            raise InvalidRequestError("logit_bias", "keys must be token ids (integers in "
                                      f"[0, {UINT32_MAX}]), got {token!r}"[:200])
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not -LOGIT_BIAS_MAX <= value <= LOGIT_BIAS_MAX:  # NaN fails the comparison
            raise InvalidRequestError("logit_bias", f"bias for token {token} must be a number in "
                                      f"[-100, 100], got {value!r}"[:200])
        out[token] = float(value)
    return out or None

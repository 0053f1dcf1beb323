"""Incremental detokenizer with stop strings.

Text is decoded from a sliding window of recent tokens, never the whole output. The window
starts with already-emitted tokens (the "prefix", decoded only to learn where new text
begins: tokenizers that drop a leading space or merge bytes need that context) and ends
with the tokens not yet committed:

    window = ids[0 : read_offset]   prefix, emitted   -> its decode is prefix_len chars
             ids[read_offset : ]    new tokens        -> text past prefix_len is new

Two kinds of text are held back:
  * an incomplete UTF-8 character at the end (decode shows U+FFFD until its last byte
    arrives): nothing past the last complete character is emitted, and the window is only
    slid forward at a clean character boundary;
  * text that could still be the start of a stop string: the longest suffix of the decoded
    text that is a proper prefix of some stop string. It is released once it stops matching.
When a stop string appears, only the text before its first occurrence is emitted.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pdserve.engine.core.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"
# prompt tokens decoded as context so the first output token's spacing is right
PROMPT_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class DetokResult:
    new_text: str  # text safe to emit now
    stopped: bool = False
    stop_string: str | None = None  # the stop string that matched, when stopped


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int],
                 stop: Sequence[str] = (), skip_special_tokens: bool = True,
                 min_tokens: int = 0, include_stop: bool = False) -> None:
        """min_tokens: stop strings are looked for only once this many output tokens were
        added (vLLM's min_tokens), in the text not yet emitted. include_stop: a matched stop
        string ends the text (vLLM's include_stop_str_in_output) instead of being cut."""
        self.stop = tuple(stop)
        self._include_stop = include_stop
        self._min_tokens = min_tokens
        self._count = 0  # output tokens added
        for i, s in enumerate(self.stop):
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop[{i}]: must be a non-empty string, got {s!r}")
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        context_start = max(0, len(prompt_token_ids) - PROMPT_CONTEXT_TOKENS)
        self._ids: list[int] = list(prompt_token_ids[context_start:])  # the decode window
        self._read_offset = len(self._ids)
        self._prefix_len = len(self._decode(self._ids))
        self._taken = 0  # chars past prefix_len already taken from uncommitted tokens
        self._held = ""  # decoded text withheld because it may begin a stop string
        self.text = ""  # everything emitted so far
        self.stopped = False
        self.stop_string: str | None = None


    @classmethod
    def for_params(cls, tokenizer: Decoder, prompt_token_ids: Sequence[int],
                   params: SamplingParams) -> IncrementalDetokenizer:
        """A request's detokenizer, its text options from its params (the engine's and the
        router's alike)."""
        return cls(tokenizer, prompt_token_ids, params.stop,
                   skip_special_tokens=params.skip_special_tokens,
                   min_tokens=params.min_tokens, include_stop=params.include_stop_str_in_output)
    def add(self, token_ids: Sequence[int]) -> DetokResult:
        """Feed new output tokens; returns the text that is safe to emit now."""
        if self.stopped:
            return DetokResult("", True, self.stop_string)
        if not token_ids:
            return DetokResult("")
        self._ids.extend(token_ids)
        self._count += len(token_ids)
        return self._release(self._held + self._decode_new(final=False), final=False)

    def prime(self, token_ids: Sequence[int]) -> bool:
        """Feed output tokens whose text was already emitted elsewhere (a stream continued
        on another worker), discarding their text. One token at a time, as the engine feeds
        a stream, so the state left behind (text held back as an incomplete character or a
        possible stop-string start) is the uninterrupted run's: the next delta is exactly
        what it would have emitted (`text` then includes the primed part). Returns True if
        a stop string already matched."""
        for token in token_ids:
            if self.add([token]).stopped:
                break
        return self.stopped

    def flush(self) -> str:
        """At the end of generation: release held-back text (incomplete bytes included)."""
        if self.stopped:
            return ""
        return self._release(self._held + self._decode_new(final=True), final=True).new_text

    # -- decoding ---------------------------------------------------------------------------
    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _decode_new(self, final: bool) -> str:
        """Newly decodable text from the window; slides the window at a clean boundary."""
        text = self._decode(self._ids)
        # an incomplete trailing character decodes as U+FFFD until its last byte arrives
        end = len(text) if final else len(text.rstrip(REPLACEMENT_CHAR))
        start = self._prefix_len + self._taken
        new = text[start:end] if end > start else ""
        if end == len(text):
            # every token in the window is fully decoded: the new tokens become the prefix
            self._ids = self._ids[self._read_offset:]
            self._read_offset = len(self._ids)
            self._prefix_len = len(self._decode(self._ids))
            self._taken = 0
        else:
            self._taken += len(new)
        return new

    # -- stop strings ---------------------------------------------------------------------
    def _release(self, pending: str, final: bool) -> DetokResult:
        """Emit `pending` (held + new text) up to a stop string or a possible stop prefix
        (all of it while the output is shorter than min_tokens)."""
        if self._count < self._min_tokens:
            self.text += pending
            self._held = ""
            return DetokResult(pending)
        hit = self._find_stop(pending)
        if hit is not None:
            index, stop = hit
            out = pending[:index + (len(stop) if self._include_stop else 0)]
            self._held, self.stopped, self.stop_string = "", True, stop
            self.text += out
            return DetokResult(out, True, stop)
        keep = 0 if final else self._partial_stop_len(pending)
        out, self._held = pending[:len(pending) - keep], pending[len(pending) - keep:]
        self.text += out
        return DetokResult(out)

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """Earliest occurrence of any stop string in text: (index, stop string)."""
        best: tuple[int, str] | None = None
        for stop in self.stop:
            index = text.find(stop)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest

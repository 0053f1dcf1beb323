"""OpenAI completions and chat bodies from the router's deltas, whole (full_body) and streamed
as server-sent events (sse): choices, usage (vLLM's continuous_usage_stats too), the echoed
prompt, vLLM's prompt_logprobs, return_tokens_as_token_ids and return_token_ids. The
Responses API renders its own (router/responses_output.py)."""
from __future__ import annotations

import collections
import contextlib
import json
import logging
from collections.abc import AsyncIterator

from pdserve.router.deltas import Delta
from pdserve.router.errors import RouterError
from pdserve.router.protocol import ParsedRequest
from pdserve.router.responses import (
    chat_choice,
    chat_chunk_choice,
    completion_choice,
    echoed,
    usage_body,
    vllm_prompt_logprobs,
    without_output,
)

log = logging.getLogger(__name__)


def _echoed(parsed: ParsedRequest, d: Delta, fe) -> Delta:
    """Choice d.index's prompt in front of its first delta (completions fan out n choices
    per prompt, in prompt order)."""
    d = without_output(d) if parsed.prompt_only else d
    top = parsed.params.logprobs if parsed.logprobs else None
    i = d.index // parsed.params.n
    return echoed(d, parsed.prompts[i], fe, top, parsed.prompt_texts[i])


class _TokenIds:
    """vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N" (what a client
    can map back without a tokenizer, where a token's text is not unique or not UTF-8)."""

    @staticmethod
    def token_text(token_id: int) -> str:
        return f"token_id:{token_id}"


def _names(parsed: ParsedRequest, fe):
    """What names the tokens of logprobs: the tokenizer's text, or their ids."""
    return _TokenIds() if parsed.tokens_as_ids else fe


def full_body(parsed: ParsedRequest, head: dict, deltas: list[Delta], fe) -> dict:
    names = _names(parsed, fe)
    top = parsed.prompt_logprobs  # vLLM's field: per choice (completions) or per response
    extra: dict = {}
    if parsed.kind == "chat":
        choices = [chat_choice(d, names, parsed.logprobs, parsed.tool_format) for d in deltas]
        obj = "chat.completion"
        if top is not None:
            extra["prompt_logprobs"] = vllm_prompt_logprobs(
                next((d.prompt_logprobs for d in deltas if d.prompt_logprobs), None), top, fe)
    else:
        if parsed.echo:
            deltas = [_echoed(parsed, d, fe) for d in deltas]
        choices = [completion_choice(d, names, parsed.logprobs) for d in deltas]
        if top is not None:
            for choice, d in zip(choices, deltas):
                choice["prompt_logprobs"] = vllm_prompt_logprobs(d.prompt_logprobs, top, fe)
        obj = "text_completion"
    if parsed.token_ids:
        ids = _TokenIdFields(parsed)
        choices = [ids.choice(c, d) for c, d in zip(choices, deltas)]
        extra.update(ids.head())
    prompt_tokens = sum(len(p) for p in parsed.prompts)
    return {**head, "object": obj, "choices": choices, **extra,
            "usage": usage_body(prompt_tokens, deltas)}


class _TokenIdFields:
    """vLLM's return_token_ids: each choice's output token ids ("token_ids"; streamed, the
    chunk's own), and the prompt's ("prompt_token_ids": per choice on completions, once per
    response on chat; streamed, only in the first chunk of each)."""

    def __init__(self, parsed: ParsedRequest) -> None:
        self.parsed, self.chat = parsed, parsed.kind == "chat"
        self._sent_head = False
        self._prompted: set[int] = set()  # completions: choices whose prompt ids went out

    def choice(self, choice: dict, d: Delta) -> dict:
        out = {**choice, "token_ids": list(d.token_ids)}
        if not self.chat and d.index not in self._prompted:
            self._prompted.add(d.index)
            out["prompt_token_ids"] = self.parsed.prompts[d.index // self.parsed.params.n]
        return out

    def head(self) -> dict:
        """{"prompt_token_ids": ...} for a chat response's first body or chunk, else {}."""
        if not self.chat or self._sent_head:
            return {}
        self._sent_head = True
        return {"prompt_token_ids": self.parsed.prompts[0]}


class _RunningUsage:
    """vLLM's stream_options.continuous_usage_stats: every chunk carries its choice's usage so
    far (prompt tokens of the choice's prompt, completion tokens sent); None otherwise."""

    def __init__(self, parsed: ParsedRequest) -> None:
        self.parsed = parsed
        self.sent: collections.Counter[int] = collections.Counter()

    def so_far(self, index: int) -> dict | None:
        if not self.parsed.continuous_usage:
            return None
        prompt = len(self.parsed.prompts[index // self.parsed.params.n])
        done = self.sent[index]
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    def add(self, d: Delta) -> dict | None:
        self.sent[d.index] += len(d.token_ids)
        if d.finish_reason and d.completion_tokens:  # the worker's count is the final word
            self.sent[d.index] = d.completion_tokens
        return self.so_far(d.index)


async def sse(parsed: ParsedRequest, head: dict, gen: AsyncIterator[Delta], first: Delta,
               fe) -> AsyncIterator[str]:
    chat = parsed.kind == "chat"
    head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
    seen: set[int] = set()
    offsets: dict[int, int] = {}
    finals: list[Delta] = []
    tools = parsed.tool_format  # with tools offered: a call parser per choice
    parsers = collections.defaultdict(tools.stream) if tools is not None else None
    running = _RunningUsage(parsed)
    names = _names(parsed, fe)
    ids = _TokenIdFields(parsed) if parsed.token_ids else None

    def chunk(choices: list[dict], usage: dict | None = None) -> str:
        body = {**head, **(ids.head() if ids is not None else {}), "choices": choices}
        if parsed.include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    async with contextlib.aclosing(gen):
        try:
            delta: Delta | None = first
            while delta is not None:
                if chat:
                    if delta.index not in seen:
                        seen.add(delta.index)
                        yield chunk([{"index": delta.index, "logprobs": None, "finish_reason": None,
                                      "delta": {"role": "assistant", "content": ""}}],
                                    running.so_far(delta.index))
                    stream = parsers[delta.index] if parsers is not None else None
                    choice = chat_chunk_choice(delta, names, parsed.logprobs, stream)
                    if ids is not None:
                        choice = ids.choice(choice, delta)
                    usage = running.add(delta)
                    if choice["delta"] or choice["finish_reason"] or choice["logprobs"] \
                            or choice.get("token_ids"):  # held markup's tokens still go out
                        yield chunk([choice], usage)  # not while the tool parser holds markup back
                else:
                    if parsed.echo and delta.index not in seen:
                        seen.add(delta.index)
                        delta = _echoed(parsed, delta, fe)
                    elif parsed.prompt_only:
                        delta = without_output(delta)
                    off = offsets.get(delta.index, 0)
                    offsets[delta.index] = off + len(delta.text)
                    choice = completion_choice(delta, names, parsed.logprobs, off)
                    yield chunk([ids.choice(choice, delta) if ids is not None else choice],
                                running.add(delta))
                if delta.finish_reason:
                    finals.append(delta)
                delta = await anext(gen, None)
            if parsed.include_usage:
                prompt_tokens = sum(len(p) for p in parsed.prompts)
                yield chunk([], usage_body(prompt_tokens, finals))
        except RouterError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        except Exception as e:  # noqa: BLE001 - a bug here must still end the stream properly
            log.exception("internal error in a stream")
            yield f"data: {json.dumps(RouterError(f'internal error: {type(e).__name__}').body())}\n\n"
        yield "data: [DONE]\n\n"

"""OpenAI response bodies from the router's deltas (router/dispatch.py Delta): usage, the
legacy completions logprobs, chat logprobs, whole choices and streamed chunk choices, the
echoed prompt of /v1/completions and vLLM's prompt_logprobs."""
from __future__ import annotations

import dataclasses

from pdserve.engine.core.outputs import PromptLogprob
from pdserve.router.deltas import Delta
from pdserve.router.frontend import Frontend
from pdserve.router.tools import ToolFormat, ToolStream, chunk_delta


def usage_body(prompt_tokens: int, deltas: list[Delta]) -> dict:
    completion = sum(d.completion_tokens or len(d.token_ids) for d in deltas)
    cached = max((d.cached_tokens for d in deltas), default=0)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def completion_logprobs(d: Delta, fe: Frontend, offset: int) -> dict:
    """Legacy completions shape; `offset` is the choice's text length before this delta. An
    echoed prompt's first token has no logprob: None there, as OpenAI writes it."""
    tokens, offsets = [], []
    for tok, _, _ in d.logprobs:
        text = fe.token_text(tok)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in d.logprobs],
            "top_logprobs": [None if lp is None else _top(tok, lp, top, fe)
                             for tok, lp, top in d.logprobs],
            "text_offset": offsets}


def _top(tok: int, lp: float, alternatives: list[tuple[int, float]], fe: Frontend) -> dict:
    """A position's top_logprobs: the N most likely tokens and, as OpenAI's legacy API and
    vLLM give it, always the token itself (so up to N + 1 entries)."""
    top = {fe.token_text(t): v for t, v in alternatives}
    top.setdefault(fe.token_text(tok), lp)
    return top


def without_output(d: Delta) -> Delta:
    """max_tokens 0 with echo: the one token the engine made left out; the choice ends for
    its length, as vLLM's does."""
    ended = d.finish_reason in ("stop", "length")  # the one token's end; others stay
    return dataclasses.replace(d, text="", token_ids=[], logprobs=[], completion_tokens=0,
                               finish_reason="length" if ended else d.finish_reason,
                               stop_reason=None)


def echoed(d: Delta, prompt: list[int], fe: Frontend, top: int | None,
           sent: str | None = None) -> Delta:
    """A choice's first delta with its prompt in front (echo): the prompt's text, and with
    logprobs (top: their N) its tokens' (the first has none; the others came back from the
    prefill, which may have kept more alternatives for vLLM's prompt_logprobs)."""
    # the prompt as sent (`sent`, a text prompt: vLLM echoes it, without the BOS the
    # tokenizer added); token ids decoded with their special tokens, as logprobs' text_offset
    # counts them
    text = sent
    if text is None:
        text = fe.tokenizer.decode(prompt, skip_special_tokens=False) \
            if fe.tokenizer is not None else ""
    lps = d.logprobs
    if top is not None:
        lps = [(prompt[0], None, []),
               *((t, lp, alts[:top]) for t, lp, alts, _ in d.prompt_logprobs or []), *lps]
    return dataclasses.replace(d, text=text + d.text, logprobs=lps)


def vllm_prompt_logprobs(lps: list[PromptLogprob] | None, top: int, fe: Frontend
                         ) -> list[dict | None]:
    """vLLM's prompt_logprobs: None for the first prompt token, then per token {token id:
    {logprob, rank, decoded_token}} for the token itself and the top N there (ranks 1..N)."""
    def entry(tok: int, lp: float, rank: int) -> dict:
        return {"logprob": lp, "rank": rank, "decoded_token": fe.token_text(tok)}

    out: list[dict | None] = [None]
    for tok, lp, alts, rank in lps or []:
        pos = {str(tok): entry(tok, lp, rank)}
        for i, (t, v) in enumerate(alts[:top]):
            pos.setdefault(str(t), entry(t, v, i + 1))
        out.append(pos)
    return out


def chat_logprobs(d: Delta, fe: Frontend) -> dict:
    def entry(tok: int, lp: float) -> dict:
        text = fe.token_text(tok)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return {"content": [dict(entry(tok, lp), top_logprobs=[entry(t, v) for t, v in top])
                        for tok, lp, top in d.logprobs]}


def completion_choice(d: Delta, fe: Frontend, want_lp: bool, offset: int = 0) -> dict:
    return {"index": d.index, "text": d.text,
            "logprobs": completion_logprobs(d, fe, offset) if want_lp else None,
            "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}


def chat_choice(d: Delta, fe: Frontend, want_lp: bool, tools: ToolFormat | None = None) -> dict:
    """The whole message; with tools offered, calls parsed out of the text (OpenAI's
    finish_reason "tool_calls" when the model stopped after making one; "stop" when
    tool_choice named the function, as OpenAI and vLLM say)."""
    message: dict = {"role": "assistant", "content": d.text}
    finish = d.finish_reason
    if tools is not None:
        parsed = tools.parse(d.text)
        message["content"] = parsed.content
        if parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls
            finish = "tool_calls" if finish == "stop" and not tools.named else finish
    return {"index": d.index, "message": message,
            "logprobs": chat_logprobs(d, fe) if want_lp else None, "finish_reason": finish,
            "stop_reason": d.stop_reason}


def chat_chunk_choice(d: Delta, fe: Frontend, want_lp: bool,
                      stream: ToolStream | None = None) -> dict:
    """One chunk's choice; with tools offered, `stream` (this choice's parser) turns the text
    into content and tool_calls deltas."""
    finish = d.finish_reason
    if stream is None:
        delta = {"content": d.text} if d.text or not d.finish_reason else {}
    else:
        events = stream.feed(d.text) + (stream.finish() if finish else [])
        delta = chunk_delta(events)
        if finish == "stop" and stream.calls and not stream.fmt.named:
            finish = "tool_calls"
    return {"index": d.index, "delta": delta,
            "logprobs": chat_logprobs(d, fe) if want_lp and d.logprobs else None,
            "finish_reason": finish, "stop_reason": d.stop_reason}

"""OpenAI's Responses API, output side: the response object of one completion, or its stream
of typed events, from the router's deltas (router/responses_api.py is the request side).

    response.created, response.in_progress
    a message item:     response.output_item.added, response.content_part.added,
                        response.output_text.delta ..., response.output_text.done,
                        response.content_part.done, response.output_item.done
    a function call:    response.output_item.added, response.function_call_arguments.delta ...,
                        response.function_call_arguments.done, response.output_item.done
    response.completed, or response.incomplete (max_output_tokens reached), or on a failure
    after the stream began: error, then response.failed

With tools offered, the text goes through the chat API's call parser (router/tools.py): text
outside calls becomes message items (one opens at the first text that is not whitespace, a
call closes it), each call a function_call item whose arguments stream as the model writes
them. A whole (non-streamed) response is the same builder fed all the text at once, so the
two hold the same items.
"""
from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from pdserve.router.deltas import Delta
from pdserve.router.errors import RouterError
from pdserve.router.tools import CallDelta, ToolFormat

log = logging.getLogger(__name__)


def response_head(request_id: str, model: str, echo: dict) -> dict:
    """The fields every snapshot of a response repeats: its id, time, model and the request's
    echo (router/responses_api.py response_echo)."""
    return {"id": f"resp_{request_id}", "object": "response", "created_at": int(time.time()),
            "model": model, **echo}


class ResponseBuilder:
    """One response's output items as its text arrives, and the events that say so. `head`
    holds the fields every snapshot of the response repeats (id, created_at, model, the
    request's echo)."""

    def __init__(self, head: dict, tools: ToolFormat | None, prompt_tokens: int) -> None:
        self.head, self.prompt_tokens = head, prompt_tokens
        self.parser = tools.stream() if tools is not None else None
        self.output: list[dict] = []
        self.seq = 0
        self.events: list[str] = []
        self.text_at: int | None = None  # output index of the message item taking text
        self.open_call: int | None = None  # output index of the call taking arguments
        self.held = ""  # leading whitespace not yet in a message item
        self.tokens = 0
        self.final: dict = {}  # the finished response (finish)

    # -- what callers use ------------------------------------------------------------------------
    def start(self) -> list[str]:
        self._emit("response.created", response=self.snapshot("in_progress"))
        self._emit("response.in_progress", response=self.snapshot("in_progress"))
        return self._take()

    def feed(self, d: Delta) -> list[str]:
        self.tokens += len(d.token_ids)
        if self.parser is None:
            pieces: list[str | CallDelta] = [d.text] if d.text else []
        else:
            pieces = self.parser.feed(d.text) + (self.parser.finish() if d.finish_reason else [])
        for piece in pieces:
            if isinstance(piece, CallDelta):
                self._call(piece)
            else:
                self._text(piece)
        return self._take()

    def finish(self, last: Delta) -> list[str]:
        """Close the open items; the final response (completed, or incomplete when the
        token budget ended it)."""
        cut = last.finish_reason == "length"
        if self.held and not self.output:  # a reply of only whitespace is still a message
            held, self.held = self.held, ""
            self._open_message()
            self._append(held)
        self._close_text("incomplete" if cut else "completed")
        self._close_call("incomplete" if cut else "completed")
        output = last.completion_tokens or self.tokens
        usage = {"input_tokens": self.prompt_tokens,
                 "input_tokens_details": {"cached_tokens": last.cached_tokens,
                                          "cache_write_tokens": 0},
                 "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": self.prompt_tokens + output}
        if cut:
            self.final = self.snapshot("incomplete", usage,
                                       incomplete_details={"reason": "max_output_tokens"})
            self._emit("response.incomplete", response=self.final)
        else:
            self.final = self.snapshot("completed", usage)
            self._emit("response.completed", response=self.final)
        return self._take()

    def failed(self, e: RouterError) -> list[str]:
        err = e.body()["error"]
        self._emit("error", code=err["code"], message=err["message"], param=err["param"])
        # the response's error.code is one of OpenAI's (the error event keeps pdserve's own)
        code = "rate_limit_exceeded" if e.status == 429 else "server_error"
        self._emit("response.failed", response=self.snapshot(
            "failed", error={"code": code, "message": err["message"]}))
        return self._take()

    def snapshot(self, status: str, usage: dict | None = None, **extra: object) -> dict:
        return {**self.head, "status": status, "output": self.output, "usage": usage,
                "error": None, "incomplete_details": None, **extra}

    # -- items -----------------------------------------------------------------------------------
    def _text(self, text: str) -> None:
        if self.text_at is None:
            if not (self.held + text).strip():
                self.held += text  # whitespace around calls opens no message
                return
            text, self.held = self.held + text, ""
            if self.output:  # text after a call: without the whitespace that followed it
                text = text.lstrip()
            self._close_call("completed")
            self._open_message()
        self._append(text)

    def _append(self, text: str) -> None:
        at = self.text_at
        assert at is not None
        item = self.output[at]
        item["content"][0]["text"] += text
        self._emit("response.output_text.delta", item_id=item["id"], output_index=at,
                   content_index=0, delta=text, logprobs=[])

    def _open_message(self) -> None:
        item = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "status": "in_progress",
                "role": "assistant", "content": []}
        self.output.append(item)
        self.text_at = at = len(self.output) - 1
        self._emit("response.output_item.added", output_index=at, item=item)
        part = {"type": "output_text", "text": "", "annotations": []}
        item["content"].append(part)
        self._emit("response.content_part.added", item_id=item["id"], output_index=at,
                   content_index=0, part=part)

    def _call(self, c: CallDelta) -> None:
        if c.id is not None:  # a call's header: the text before it is a finished message
            self._close_text("completed")
            self._close_call("completed")
            self.held = ""
            item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call",
                    "status": "in_progress", "call_id": c.id, "name": c.name, "arguments": ""}
            self.output.append(item)
            self.open_call = len(self.output) - 1
            self._emit("response.output_item.added", output_index=self.open_call, item=item)
        if c.arguments:  # the parser's pieces follow their call's header, nothing between
            at = self.open_call
            assert at is not None
            item = self.output[at]
            item["arguments"] += c.arguments
            self._emit("response.function_call_arguments.delta", item_id=item["id"],
                       output_index=at, delta=c.arguments)

    def _close_text(self, status: str) -> None:
        if self.text_at is None:
            return
        at, self.text_at = self.text_at, None
        item = self.output[at]
        part = item["content"][0]
        ids = {"item_id": item["id"], "output_index": at, "content_index": 0}
        self._emit("response.output_text.done", **ids, text=part["text"], logprobs=[])
        self._emit("response.content_part.done", **ids, part=part)
        item["status"] = status
        self._emit("response.output_item.done", output_index=at, item=item)

    def _close_call(self, status: str) -> None:
        if self.open_call is None:
            return
        at, self.open_call = self.open_call, None
        item = self.output[at]
        self._emit("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                   arguments=item["arguments"], name=item["name"])
        item["status"] = status
        self._emit("response.output_item.done", output_index=at, item=item)

    # -- events ----------------------------------------------------------------------------------
    def _emit(self, kind: str, **fields: object) -> None:
        """An SSE event, serialized now: later changes to the items do not reach it."""
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        self.events.append(f"event: {kind}\ndata: {json.dumps(body)}\n\n")

    def _take(self) -> list[str]:
        out, self.events = self.events, []
        return out


def whole_response(builder: ResponseBuilder, d: Delta) -> dict:
    """The non-streamed response: d holds the completion's whole text and its finish."""
    builder.feed(d)
    builder.finish(d)
    return builder.final


async def response_events(builder: ResponseBuilder, deltas: AsyncIterator[Delta],
                          first: Delta) -> AsyncIterator[str]:
    """The SSE body of a streamed response (no [DONE]: the Responses API ends with its
    response.completed / incomplete / failed event)."""
    async with contextlib.aclosing(deltas):
        try:
            for event in builder.start():
                yield event
            delta: Delta | None = first
            last = None
            while delta is not None:
                for event in builder.feed(delta):
                    yield event
                if delta.finish_reason:
                    last = delta
                delta = await anext(deltas, None)
            if last is None:
                raise RouterError("internal error: the completion ended without a finish")
            for event in builder.finish(last):
                yield event
        except RouterError as e:
            for event in builder.failed(e):
                yield event
        except Exception as e:  # noqa: BLE001 - a bug here must still end the stream properly
            log.exception("internal error in a response stream")
            for event in builder.failed(RouterError(f"internal error: {type(e).__name__}")):
                yield event

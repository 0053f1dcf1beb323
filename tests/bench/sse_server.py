"""A small, real OpenAI-compatible streaming server for testing the load generator.

FastAPI + uvicorn on 127.0.0.1 (a free port), in a thread of the test process, so the
server's own timestamps (time.perf_counter) share the client's clock. Each request streams
an empty role chunk at once (a TTFT trap: it carries no content), waits first_token_delay,
then streams max_tokens tokens token_delay apart, a finish chunk, a usage chunk when asked,
and `data: [DONE]`. Prompt tokens = whitespace-separated words. Every token's text names
its request ("r7t3" = request 7, token 3) so a test can pair client and server records.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

STANDARD_FIELDS = {"model", "prompt", "messages", "max_tokens", "temperature", "top_p", "n",
                   "stream", "stream_options", "stop", "seed", "user"}


@dataclass
class ServedRequest:
    rid: int
    prompt_tokens: int
    max_tokens: int
    body: dict
    recv: float  # perf_counter when the handler started
    token_times: list[float] = field(default_factory=list)  # perf_counter before each token
    done: float = 0.0

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.recv

    @property
    def span(self) -> float:
        return self.token_times[-1] - self.token_times[0]


class TokenStreamServer:
    def __init__(self, model: str = "test-model", first_token_delay: float = 0.1,
                 token_delay: float = 0.02, send_usage: bool = True,
                 strict_fields: bool = False) -> None:
        self.model = model
        self.first_token_delay = first_token_delay
        self.token_delay = token_delay
        self.send_usage = send_usage
        self.strict_fields = strict_fields  # reject non-OpenAI fields, as OpenAI does
        self.records: list[ServedRequest] = []
        self.rejected = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        self.app = self._build_app()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.base_url = ""

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict:
            return {"object": "list", "data": [{"id": self.model, "object": "model"}]}

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self._handle(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await self._handle(request, chat=True)

        return app

    async def _handle(self, request: Request, chat: bool):
        recv = time.perf_counter()
        body = await request.json()
        unknown = sorted(set(body) - STANDARD_FIELDS)
        if self.strict_fields and unknown:
            with self._lock:
                self.rejected += 1
            return JSONResponse(status_code=400, content={"error": {
                "message": f"Unrecognized request argument supplied: {unknown[0]}",
                "type": "invalid_request_error", "param": unknown[0], "code": None}})
        text = body["messages"][-1]["content"] if chat else body["prompt"]
        with self._lock:
            rec = ServedRequest(len(self.records), len(text.split()), int(body["max_tokens"]),
                                body, recv)
            self.records.append(rec)
        return StreamingResponse(self._stream(rec, chat), media_type="text/event-stream")

    def _chunk(self, rec: ServedRequest, chat: bool, text: str, finish: str | None) -> str:
        choice = ({"index": 0, "delta": {"content": text}, "finish_reason": finish} if chat
                  else {"index": 0, "text": text, "finish_reason": finish})
        obj = {"id": f"cmpl-{rec.rid}", "object": "text_completion", "model": self.model,
               "choices": [choice]}
        return f"data: {json.dumps(obj)}\n\n"

    async def _stream(self, rec: ServedRequest, chat: bool):
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            yield self._chunk(rec, chat, "", None)  # role/empty chunk: not a token
            await asyncio.sleep(self.first_token_delay)
            for i in range(rec.max_tokens):
                if i:
                    await asyncio.sleep(self.token_delay)
                rec.token_times.append(time.perf_counter())
                yield self._chunk(rec, chat, f" r{rec.rid}t{i}", None)
            yield self._chunk(rec, chat, "", "length")
            if self.send_usage:
                usage = {"prompt_tokens": rec.prompt_tokens, "completion_tokens": rec.max_tokens,
                         "total_tokens": rec.prompt_tokens + rec.max_tokens}
                final = {"id": f"cmpl-{rec.rid}", "choices": [], "usage": usage}
                yield f"data: {json.dumps(final)}\n\n"
            yield "data: [DONE]\n\n"
            rec.done = time.perf_counter()
        finally:
            with self._lock:
                self.in_flight -= 1

    def start(self) -> str:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("test SSE server did not start")
            time.sleep(0.01)
        self.base_url = f"http://127.0.0.1:{port}"
        return self.base_url

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)

    def reset(self) -> None:
        with self._lock:
            self.records.clear()
            self.rejected = 0
            self.max_in_flight = 0

    def by_rid(self) -> dict[int, ServedRequest]:
        return {r.rid: r for r in self.records}

"""OpenAI-compatible HTTP face (FastAPI on uvicorn).

    POST /v1/completions, /v1/chat/completions   (SSE when "stream": true, ending in [DONE])
    POST /v1/responses                           (OpenAI's Responses API: stateless, text;
                                                  router/responses_api.py)
    GET  /v1/models, /health, /metrics

Every error is `{"error": {"message", "type", "param", "code"}}`. `--api-key` guards every
route but /health and /metrics. Bodies are read with a size cap (Content-Length and the
bytes actually streamed). A streaming response waits for the first token before sending
headers, so a request that fails before any output gets a real status code; one that fails
later gets an `{"error": ...}` chunk and then `[DONE]`. A client that goes away (before or
during the stream) cancels its request, which frees its blocks on the workers.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.router.core import Job, RouterCore, collect
from pdserve.router.errors import BadRequest, PayloadTooLarge, RouterError, Unauthorized
from pdserve.router.openai_bodies import full_body, sse
from pdserve.router.protocol import REQUEST_ID, ParsedRequest, parse_chat, parse_completion
from pdserve.router.responses_api import ResponsesRequest, parse_responses, renamed
from pdserve.router.responses_output import (
    ResponseBuilder,
    response_events,
    response_head,
    whole_response,
)
from pdserve.router.tokenize import detokenize, tokenize

log = logging.getLogger(__name__)
OPEN_PATHS = ("/health", "/metrics", "/metrics/targets")
# what an over-long prompt's error names, per API
_PROMPT_PARAM = {"completion": "prompt", "chat": "messages", "response": "input"}
T = TypeVar("T")


class ClientGone(Exception):
    pass


def error_response(e: RouterError, retry_after_s: float | None = None) -> JSONResponse:
    """e's JSON body and status. A 429 or 503 always says when to come back: e's own
    Retry-After, else retry_after_s (the router's configured one)."""
    after = e.retry_after(retry_after_s)
    headers = {"Retry-After": after} if after is not None else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


class Guard:
    """Pure ASGI middleware: X-Request-Id (accept a sane one or assign), echoed on every
    response; API key on every route but the open ones; an exception whose 500 was sent
    ends here, so the server does not cut the connection under it."""

    def __init__(self, app: Any, api_key: str | None) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        state = scope.setdefault("state", {})
        state["request_id_given"] = bool(REQUEST_ID.fullmatch(given))
        # a route may still take the body's request_id (vLLM's field) when no header came
        state["request_id"] = given if state["request_id_given"] else uuid.uuid4().hex

        started = False

        async def send_with_id(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                rid = state["request_id"].encode()
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid)]
            await send(message)

        if self.expected is not None and scope["path"] not in OPEN_PATHS:
            got = headers.get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                err = Unauthorized("missing or invalid API key (Authorization: Bearer <key>)")
                return await error_response(err)(scope, receive, send_with_id)
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            # the app's handler for any exception (create_app's _internal) logged it and sent
            # the 500; Starlette raises it again for the server, and uvicorn then closes the
            # connection, cutting off the 500 before the client has read it
            if not started:
                raise


def create_app(core: RouterCore, api_key: str | None = None,
               max_body_bytes: int = 8 * 1024 * 1024) -> Any:
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)
    fe = core.frontend
    created = int(time.time())

    @app.exception_handler(RouterError)
    async def _router_error(request: Request, e: RouterError) -> JSONResponse:
        if request.url.path.startswith("/v1/"):  # a request refused before dispatch counts
            core.count_failure(e)  # too; /tokenize and /detokenize are not requests
        return error_response(e, core.cfg.retry_after_s)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": {"message": str(e.detail), "type": "invalid_request_error",
                                       "param": None, "code": None}}, status_code=e.status_code)

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, e: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; the request was cancelled

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        log.exception("internal error")
        return JSONResponse({"error": {"message": f"internal error: {type(e).__name__}",
                                       "type": "internal_error", "param": None, "code": None}},
                            status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        # lifecycle: restarts so far, seconds to the next one, whether the pool gave up
        workers = [{"worker_id": w.worker_id, "role": w.role, "up": w.up,
                    "incarnation": w.incarnation,
                    "grpc_address": w.endpoints.get("grpc_address", ""),
                    "metrics_address": w.endpoints.get("metrics_address", ""),
                    "stalled": w.stall.stalled, "stuck_s": round(w.stall.stuck_s, 1),
                    **w.ref.lifecycle()}
                   for w in core.pool.workers.values()]
        status = core.status()
        code = 200 if status in ("ok", "degraded") else 503
        headers = {"Retry-After": str(core.cfg.retry_after_s)} if code == 503 else None
        return JSONResponse({"status": status, "workers": workers}, status_code=code,
                            headers=headers)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(core.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/metrics/targets")
    async def metrics_targets() -> list[dict]:
        """Every worker's own /metrics, in Prometheus's HTTP service discovery format
        (http_sd_configs): a relaunched worker's new port is found at the next refresh."""
        return [{"targets": [addr], "labels": {"__meta_pdserve_role": w.role,
                                               "__meta_pdserve_worker": w.worker_id}}
                for w in core.pool.workers.values()
                if (addr := w.endpoints.get("metrics_address", ""))]

    card = {"id": fe.model_id, "object": "model", "created": created, "owned_by": "pdserve",
            "max_model_len": fe.max_model_len}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict:  # the openai client's models.retrieve
        fe.check_model(model)
        return card

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        parsed = parse_completion(await read_json(request, max_body_bytes), fe)
        return await _serve(core, request, parsed)

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> dict:
        return tokenize(await read_json(request, max_body_bytes), fe)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> dict:
        return detokenize(await read_json(request, max_body_bytes), fe)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await read_json(request, max_body_bytes)
        parsed = parse_chat(body, fe, core.max_tokens_default)
        return await _serve(core, request, parsed)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        body = await read_json(request, max_body_bytes)
        return await _serve(core, request, parse_responses(body, fe, core.max_tokens_default))

    return Guard(app, api_key)


async def _serve(core: RouterCore, request: Request, req: ParsedRequest | ResponsesRequest
                 ) -> Response:
    """Dispatch one parsed request; a Responses request's errors name its own fields."""
    if not isinstance(req, ResponsesRequest):
        return await _respond(core, request, req, None)
    try:
        return await _respond(core, request, req.parsed, req.echo)
    except BadRequest as e:  # the router's own checks (grammars, lengths) name chat fields
        raise renamed(e, []) from e


async def _respond(core: RouterCore, request: Request, parsed: ParsedRequest,
                   echo: dict | None) -> Response:
    """The body whole, or streamed as SSE once the first output came (an error before that
    gets a real status); `echo`: a Responses request's fields, its output in that API's shape."""
    fe = core.frontend
    # grammars compile off the event loop, under a deadline: a bad one is a 400 naming its
    # field before any worker sees the request
    if parsed.checks:
        await _unless_gone(fe.check_grammars(parsed.checks), request)
    if parsed.request_id and not request.state.request_id_given:
        request.state.request_id = parsed.request_id  # the body's, as vLLM takes it
    rid = request.state.request_id
    gen = core.generate(Job(f"{rid}-{uuid.uuid4().hex[:8]}", parsed.prompts, parsed.params,
                            prompt_param=_PROMPT_PARAM[parsed.kind]))
    builder = None if echo is None else ResponseBuilder(
        response_head(rid, parsed.model, echo), parsed.tool_format, len(parsed.prompts[0]))
    prefix = "chatcmpl-" if parsed.kind == "chat" else "cmpl-"
    head = {"id": prefix + rid, "created": int(time.time()), "model": parsed.model}
    if not parsed.stream:
        async with contextlib.aclosing(gen):
            deltas = await _unless_gone(collect(gen, len(parsed.prompts) * parsed.params.n),
                                        request)
        return JSONResponse(whole_response(builder, deltas[0]) if builder is not None
                            else full_body(parsed, head, deltas, fe))
    try:
        first = await _unless_gone(anext(gen), request)
    except BaseException:
        await gen.aclose()
        raise
    events = response_events(builder, gen, first) if builder is not None \
        else sse(parsed, head, gen, first, fe)
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def read_json(request: Request, limit: int) -> dict:
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > limit:
        raise PayloadTooLarge(f"body: {length} bytes exceeds the limit of {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise PayloadTooLarge(f"body: exceeds the limit of {limit} bytes")
    try:
        data = json.loads(bytes(body))
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError (invalid UTF-8)
        raise BadRequest(f"body: malformed JSON: {e}") from e
    except RecursionError as e:  # nesting deeper than the decoder's recursion limit
        raise BadRequest(f"body: JSON nested deeper than {MAX_JSON_DEPTH} levels") from e
    if not isinstance(data, dict):
        raise BadRequest("body: must be a JSON object")
    check_json(data)
    return data


MAX_JSON_DEPTH = 32  # OpenAI bodies nest a few levels (tools' schemas a few more)


def check_json(data: dict) -> None:
    """Bounded nesting, and text that is valid Unicode: JSON's \\ud800 escapes decode to lone
    surrogates, which no tokenizer or UTF-8 encoder takes. BadRequest names the field."""
    stack: list[tuple[object, str, int]] = [(data, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise BadRequest(f"{path}: JSON nested deeper than {MAX_JSON_DEPTH} levels",
                             param=path.split("[")[0].split(".")[0] or None)
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise BadRequest(f"{path}: not valid Unicode (an unpaired surrogate at "
                                 f"{e.start})", param=path) from e
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.append((key, path or "body", depth + 1))  # keys are text too
                stack.append((item, f"{path}.{key}" if path else str(key), depth + 1))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))


async def _unless_gone(aw: Awaitable[T], request: Request) -> T:
    """Await `aw`, cancelling it if the client disconnects first."""
    task = asyncio.ensure_future(aw)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone()
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass

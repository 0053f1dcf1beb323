"""gRPC face: the Pdserve service (Generate server streaming, ListModels, Health).

Same validation and errors as HTTP, as gRPC statuses: INVALID_ARGUMENT naming the field,
NOT_FOUND for an unknown model, UNAUTHENTICATED (API key in `authorization: Bearer` metadata,
checked by proto.rpc's interceptor; Health stays open), RESOURCE_EXHAUSTED when full,
UNAVAILABLE while draining. Optional TLS. A structured output (params.structured_output) is
compiled here before dispatch, as HTTP does: a bad or too slow one names its field.

The server is proto.rpc's thread-pool server; each call hands its request to the router's
asyncio loop (where the core and the worker channels live) and reads results from a queue.
A client that cancels cancels the core task, which frees the request on the workers.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import queue
import uuid
from collections.abc import Iterator

import grpc

from pdserve.engine.core.sampling_params import InvalidRequestError
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pbg
from pdserve.proto.convert import (
    logprobs_to_proto,
    params_from_proto,
    prompt_logprobs_to_proto,
    set_stop_reason,
)
from pdserve.proto.rpc import TLSConfig, api_key_interceptor, make_server
from pdserve.router.core import Job, RouterCore
from pdserve.router.deltas import Delta
from pdserve.router.errors import BadRequest, RouterError
from pdserve.router.frontend import CHAT_ROLES
from pdserve.router.protocol import MAX_N, REQUEST_ID, content_text

_END = object()
# StructuredOutput kinds -> their proto field (errors name the field the client set)
_STRUCTURED_FIELD = {"json": "json_schema", "json_object": "json_object", "regex": "regex",
                     "choice": "choice", "grammar": "grammar", "structural_tag": "structural_tag"}


class PdserveServicer(pbg.PdserveServicer):
    def __init__(self, core: RouterCore, loop: asyncio.AbstractEventLoop) -> None:
        self.core, self.loop = core, loop

    # -- Generate ------------------------------------------------------------------------
    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext
                 ) -> Iterator[pb.GenerateResponse]:
        try:
            job, n, rid = self._job(request)
        except RouterError as e:
            self.core.count_failure(e)
            self._abort(context, e)
        q: queue.Queue = queue.Queue()
        fut = asyncio.run_coroutine_threadsafe(self._pump(job, n, rid, q), self.loop)
        # client cancelled or went away; if it already has (while the prompt was checked),
        # add_callback refuses the callback: cancel now, or the request would run unread
        if not context.add_callback(fut.cancel):
            fut.cancel()
        while True:
            item = q.get()
            if item is _END:
                return
            if isinstance(item, RouterError):
                self._abort(context, item)
            if isinstance(item, BaseException):
                context.abort(grpc.StatusCode.INTERNAL, f"internal error: {item!r}")
            yield item

    def _abort(self, context: grpc.ServicerContext, e: RouterError) -> None:
        """e as a status; a refusal that says when to come back (429, 503) carries it as
        `retry-after` trailing metadata (seconds), as HTTP's Retry-After header."""
        after = e.retry_after(self.core.cfg.retry_after_s)
        if after is not None:
            context.set_trailing_metadata((("retry-after", after),))
        context.abort(e.grpc_code, e.message)

    async def _pump(self, job: Job, n: int, rid: str, q: queue.Queue) -> None:
        finished, completion, cached = 0, 0, 0
        prompt_tokens = sum(len(p) for p in job.prompts)
        try:
            async with contextlib.aclosing(self.core.generate(job)) as gen:
                async for d in gen:
                    msg = _to_proto(rid, d)
                    if d.finish_reason:
                        finished += 1
                        completion += d.completion_tokens or len(d.token_ids)
                        cached = max(cached, d.cached_tokens)
                        if finished == n:  # the request's last message carries its usage
                            msg.usage.CopyFrom(pb.Usage(prompt_tokens=prompt_tokens,
                                                        completion_tokens=completion,
                                                        cached_tokens=cached))
                    q.put(msg)
            q.put(_END)
        except asyncio.CancelledError:
            q.put(_END)
            raise
        except BaseException as e:  # noqa: BLE001 - reported to the client as a status
            if isinstance(e, RouterError):
                self.core.count_failure(e)  # refused at admission, before the counted part
            q.put(e)

    def _job(self, request: pb.GenerateRequest) -> tuple[Job, int, str]:
        core, fe = self.core, self.core.frontend
        fe.check_model(request.model or None)
        kind = request.WhichOneof("input")
        if kind is None:
            raise BadRequest("prompt: one of prompt, prompt_token_ids or messages is required",
                             param="prompt")
        if kind == "prompt":
            ids = fe.encode_prompt(request.prompt)
        elif kind == "prompt_token_ids":
            ids = fe.encode_prompt(list(request.prompt_token_ids.ids), param="prompt_token_ids")
        else:
            ids = fe.encode_chat(_messages(request.messages))
        try:
            params = params_from_proto(request.params)
            params.check_vocab(fe.config.vocab_size)  # logit_bias ids, as HTTP checks them
            if params.structured is not None:  # compiled here (this call's thread), as HTTP
                where = f"params.structured_output.{_STRUCTURED_FIELD[params.structured.kind]}"
                fe.check_grammars_sync([(params.structured, where)])
            if not request.params.HasField("max_tokens") and kind == "messages":
                params = dataclasses.replace(params, max_tokens=core.max_tokens_default(len(ids)))
        except InvalidRequestError as e:
            raise _named_as_in_proto(e) from e
        if request.request_id and not REQUEST_ID.fullmatch(request.request_id):
            raise BadRequest("request_id: 1-128 characters of A-Z a-z 0-9 . _ : - (as HTTP's "
                             "X-Request-Id)", param="request_id")
        if request.params.n > MAX_N:  # as HTTP: more completions per request are refused
            raise BadRequest(f"n: must be <= {MAX_N}, got {request.params.n}", param="n")
        rid = request.request_id or uuid.uuid4().hex
        job = Job(f"{rid}-{uuid.uuid4().hex[:8]}", [ids], params,
                  # 0 = the server's default; anything else is checked at admission
                  timeout_s=request.timeout_s if request.timeout_s != 0 else None,
                  prompt_param=kind)  # an over-long input is named as the proto names it
        return job, params.n, rid

    # -- the rest ------------------------------------------------------------------------
    def ListModels(self, request: pb.ListModelsRequest, context) -> pb.ListModelsResponse:
        fe = self.core.frontend
        return pb.ListModelsResponse(models=[pb.ModelCard(id=fe.model_id,
                                                          max_model_len=fe.max_model_len)])

    def Health(self, request: pb.HealthRequest, context) -> pb.HealthResponse:
        core = self.core
        ws = list(core.pool.workers.values())
        status = core.status()  # as HTTP /health says it
        # the pool's KV, summed over the workers that are up, as their last health polls saw
        # it; kv_cache_usage is the fullest decode worker's (what admission runs into)
        seen = [w.health for w in ws if w.up and w.health is not None]
        decode = [w.health.kv_cache_usage for w in ws if w.up and w.health is not None
                  and w.role in ("decode", "colocated")]
        return pb.HealthResponse(
            status=status, role="router", worker_id=core.cfg.router_id,
            num_running=sum(w.inflight for w in ws),
            num_waiting=max(0, core.inflight - sum(w.inflight for w in ws)),
            num_free_blocks=sum(h.num_free_blocks for h in seen),
            num_total_blocks=sum(h.num_total_blocks for h in seen),
            num_pinned_blocks=sum(h.num_pinned_blocks for h in seen),
            num_held_requests=sum(h.num_held_requests for h in seen),
            kv_cache_usage=max(decode, default=0.0))


def _named_as_in_proto(e: InvalidRequestError) -> BadRequest:
    """A BadRequest naming the proto field the client set: SamplingParams' checks name the
    HTTP field (structured_outputs.regex), here it is params.structured_output.regex."""
    prefix = "structured_outputs."
    if not e.param.startswith(prefix):
        return BadRequest.from_invalid(e)
    kind = e.param.removeprefix(prefix).split(".")[0]
    param = f"params.structured_output.{_STRUCTURED_FIELD.get(kind, kind)}"
    return BadRequest(f"{param}: {e.message}", param=param)


def _messages(msgs: pb.ChatMessages) -> list[dict[str, str]]:
    if not msgs.messages:
        raise BadRequest("messages: must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(msgs.messages):
        if m.role not in CHAT_ROLES:
            raise BadRequest(f"messages[{i}].role: must be one of {', '.join(CHAT_ROLES)}, "
                             f"got {m.role!r}", param=f"messages[{i}].role")
        out.append({"role": m.role, "content": content_text(m.content, f"messages[{i}].content", m.role)})
    return out


def _to_proto(request_id: str, d: Delta) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(request_id=request_id, index=d.index, text=d.text,
                              token_ids=d.token_ids, finish_reason=d.finish_reason or "")
    msg.logprobs.extend(logprobs_to_proto(d.logprobs))
    msg.prompt_logprobs.extend(prompt_logprobs_to_proto(d.prompt_logprobs or []))
    set_stop_reason(msg, d.stop_reason)
    if d.trace is not None:
        msg.trace.CopyFrom(d.trace.to_proto())
    return msg


# threads beyond one per admitted completion: Health, ListModels and the Generate calls that
# admission refuses (429) still get one while every admitted stream holds its own
SPARE_THREADS = 64


def start_grpc(core: RouterCore, loop: asyncio.AbstractEventLoop, host: str, port: int,
               api_key: str | None = None, tls: TLSConfig | None = None
               ) -> tuple[grpc.Server, int]:
    """Start the Pdserve service; returns (server, bound port). A Generate stream holds one
    thread of the pool while it runs, and the router admits max_inflight completions (each
    stream at least one): the pool has that many threads plus SPARE_THREADS."""
    auth = api_key_interceptor(api_key, open_methods=("/Health",)) if api_key else None
    server, bound = make_server(host, port, max_workers=core.cfg.max_inflight + SPARE_THREADS,
                                auth=auth, tls=tls)
    pbg.add_PdserveServicer_to_server(PdserveServicer(core, loop), server)
    server.start()
    return server, bound

"""One completion (one `index` of a request) through the pools: plan -> prefill -> decode.

    plan      pick D (KV room, load) and, unless selective disaggregation or colocated mode
              sends it straight to D, P (prefix affinity, load); wait in the router queue
              while every worker is full
    prefill   P runs the prompt under the request deadline; a failure or timeout is retried
              on another P (same request id), within the retry budget
    decode    D pulls the KV and streams; its first token (sampled on P) is held back until
              the pull succeeded, so a transfer failure can be retried on another P without
              the client ever seeing a token twice. `kv_transfer:` failures follow the
              request's policy: retry -> re-prefill elsewhere, fail -> a clear error.
    continue  D fails on its side after output started: another D (never that incarnation)
              runs the request locally from the tokens already sent (resume_output_ids), so
              nothing is lost or repeated; same retry budget; no other D up -> an error.
    stall     a worker whose engine loop stays in one step past --stall-timeout (a hung GPU)
              is marked down by the pool's health poll, which cancels the attempts on it:
              retried on another P (or decode-only), or continued on another D.
Every exit path frees what the request holds: a cancelled or failed attempt aborts the
request on P (its held blocks) and cancels the Decode stream (D aborts on stream close).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Callable, Sequence

import grpc

from pdserve.engine.core.block_manager import compute_block_hashes, root_hash
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto.convert import (
    params_to_proto,
    prompt_logprobs_from_proto,
    stop_reason_from_proto,
)
from pdserve.router.deltas import Delta, Trace, logprobs_of
from pdserve.router.errors import (
    BadRequest,
    KVTransferFailed,
    RequestTimeout,
    WorkerUnavailable,
    param_of,
)
from pdserve.router.metrics import StageTimes
from pdserve.router.planning import reserve_attempt, reserve_continuation
from pdserve.router.policies import blocks_needed
from pdserve.router.pool import WorkerState
from pdserve.router.stall import cancel_on_stall, stalled_cancel

log = logging.getLogger(__name__)
TRACE_LOG = logging.getLogger("pdserve.trace")  # --log-requests: one JSON line per completion


class Retry(Exception):
    """This attempt failed on a worker's side; another worker may succeed."""

    def __init__(self, reason: str, worker_id: str, detail: str, incarnation: str = "") -> None:
        super().__init__(f"{reason} on {worker_id}: {detail}")
        self.reason, self.worker_id, self.incarnation = reason, worker_id, incarnation


class ChoiceRun:
    def __init__(self, core, request_id: str, index: int, prompt_ids: list[int],
                 params: SamplingParams, arrival: float, deadline: float,
                 emit: Callable[[Delta], None]) -> None:
        self.core, self.pool, self.cfg = core, core.pool, core.cfg
        self.rid, self.index, self.prompt_ids, self.params = request_id, index, prompt_ids, params
        self.arrival, self.deadline, self.emit = arrival, deadline, emit
        self.proto_params = params_to_proto(params)
        # the engines' own hashes (salted as theirs are): prefix affinity routes on them
        self.hashes = compute_block_hashes(prompt_ids, self.cfg.block_size,
                                           root_hash(params.cache_salt))
        self.need_blocks = blocks_needed(len(prompt_ids) + 1, self.cfg.block_size)
        self.stages = StageTimes()
        self.dispatched = 0.0
        self.first_msg_at: float | None = None  # the decode stream's first message
        self.last_emit: float | None = None
        self.sent_ids: list[int] = []  # tokens of this completion already sent to the client
        self.prompt_lps: list | None = None  # prompt_logprobs, from the worker that prefilled
        self.prompt_lps_sent = False
        # prompt tokens the prefill worker found in its prefix cache: D pulled the KV, so its
        # own usage says 0 cached for them
        self.prefill_cached = 0
        self.continued = False  # a decode worker failed after output started
        self.last_failure = ""
        self.waiting = False
        self.retries = 0
        self.route = ("", "")  # (prefill worker or "", decode worker) of the latest attempt

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    # -- the retry loop ------------------------------------------------------------------
    async def run(self) -> None:
        try:
            await self._run_attempts()
        except Exception:
            if self.continued:
                self.core.metrics.continuation("failed")
            raise
        if self.continued:
            self.core.metrics.continuation("ok")

    async def _run_attempts(self) -> None:
        """Attempts until one finishes the completion: before output, a retry (another P
        and D); after, a continuation on another D. Both spend the one retry budget."""
        budget, excluded = self.cfg.retry_budget, set()
        dead: set[tuple[str, str]] = set()  # decode workers (id, incarnation) that failed it
        full = 0  # decode_full or in_use answers in a row
        while True:
            try:
                await self._attempt(excluded, dead)
                return
            except Retry as e:
                if e.reason in ("decode_full", "in_use"):  # no fault: no retry spent
                    full += 1
                    await self._wait_for_room(e, full)
                    excluded.add(e.worker_id)
                    continue
                if e.reason in ("decode", "stalled") and self.sent_ids:  # not continued there
                    dead.add((e.worker_id, e.incarnation))
                self.continued |= bool(self.sent_ids)
                self.last_failure = str(e)
                if budget <= 0:
                    started = "; output had started" if self.sent_ids else ""
                    raise WorkerUnavailable(f"request {self.rid} failed after "
                                            f"{self.cfg.retry_budget} retries: {e}{started}") from e
                budget -= 1
                self.retries += 1
                excluded.add(e.worker_id)
                self.core.metrics.retry(e.reason)
                log.warning("%s %s after %d tokens: %s", "continuing" if self.sent_ids
                            else "retrying", self.rid, len(self.sent_ids), e)

    async def _wait_for_room(self, e: Retry, times: int) -> None:
        """After a decode_full answer (re-read that worker's health: its free blocks) or an
        in_use one (the worker still let go of an earlier attempt's id): back off (50 ms
        doubling to 1 s), then plan again; the deadline bounds the whole wait."""
        self.core.metrics.retry(e.reason)
        w = self.pool.workers.get(e.worker_id)
        if w is not None and e.reason == "decode_full":
            await self.pool.poll(w)
        pause = min(0.05 * 2 ** (times - 1), 1.0, self.remaining())
        if pause <= 0:
            raise RequestTimeout(f"request {self.rid}: no decode worker had room before "
                                 "the deadline")
        await asyncio.sleep(pause)

    async def _attempt(self, excluded: set[str], dead: set[tuple[str, str]]) -> None:
        if self.sent_ids:  # output started: only a D, which goes on from the sent tokens
            p, d = None, await self._plan_continuation(dead)
            self.route = (self.route[0], d.worker_id)  # the first token's P stays the P
        else:
            p, d = await self._plan(excluded)
            # a fresh attempt: the trace is this attempt's (a failed one's time stays in
            # router_queue, which runs to this dispatch)
            self.stages = StageTimes()
            self.prefill_cached = 0  # a failed attempt's prefill is not this one's
            self.route = (p.worker_id if p is not None else "", d.worker_id)
        m = self.core.metrics
        m.running.labels(**m.labels).inc()
        try:
            prefill = None
            if p is not None:
                try:
                    prefill = await self._prefill(p)
                finally:
                    self.pool.release(p)
                if prefill.finish_reason:  # the first token already ends it
                    # P may still hold the prompt's blocks for a reader that will never
                    # come: free them (harmless when it already did)
                    self.core.background(self._abort(p))
                    self.route = (p.worker_id, "")  # no decode worker saw it
                    self._finish_at_prefill(prefill)
                    return
            await self._decode(d, p, prefill)
        finally:
            self.pool.release(d)
            m.running.labels(**m.labels).dec()

    # -- plan ------------------------------------------------------------------------------
    async def _plan(self, excluded: set[str]) -> tuple[WorkerState | None, WorkerState]:
        """Reserve a D (and a P) with room; wait in the router queue while none has any."""
        self.set_waiting(True)
        try:
            p, d = await reserve_attempt(self.core, self.need_blocks, self.hashes,
                                         len(self.prompt_ids), excluded, self.rid,
                                         self.arrival, self.deadline)
        finally:
            self.set_waiting(False)
        self.dispatched = time.monotonic()
        return p, d

    async def _plan_continuation(self, dead: set[tuple[str, str]]) -> WorkerState:
        need = blocks_needed(len(self.prompt_ids) + len(self.sent_ids) + 1, self.cfg.block_size)
        return await reserve_continuation(self.core, dead, need, self.rid, self.deadline,
                                          self.last_failure)

    def set_waiting(self, waiting: bool) -> None:
        m = self.core.metrics
        if waiting != self.waiting:
            m.waiting.labels(**m.labels).inc(1 if waiting else -1)
            self.waiting = waiting

    # -- prefill -----------------------------------------------------------------------------
    async def _prefill(self, p: WorkerState) -> pb.PrefillResult:
        # the attempt's limit exists to retry elsewhere; with no other prefill worker up, a
        # retry would only start the same work over (long prompts on slow hardware)
        others = any(w.up for w in self.pool.by_role("prefill") if w is not p)
        timeout = min(self.remaining(), self.cfg.prefill_timeout_s) if others else \
            self.remaining()
        req = pb.PrefillRequest(request_id=self.rid, prompt_token_ids=self.prompt_ids,
                                params=self.proto_params, timeout_s=timeout)
        t0 = time.monotonic()
        call = p.stub.Prefill(req, timeout=timeout)
        watch = cancel_on_stall(p.stall, call, p.worker_id)
        try:
            res: pb.PrefillResult = await call
        except asyncio.CancelledError:
            if stalled_cancel(watch):  # P aborts it on the cancel, once its loop comes round
                raise Retry("stalled", p.worker_id, "its engine loop stalled") from None
            call.cancel()
            self.core.background(self._abort(p))
            raise
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise BadRequest(e.details(), param=param_of(e.details() or "")) from e
            await self._abort(p)  # it may still run (timeout): free it before going elsewhere
            if self.remaining() <= 0:
                raise RequestTimeout(f"request {self.rid} timed out in prefill") from e
            if e.code() == grpc.StatusCode.ALREADY_EXISTS:  # an earlier attempt's, now aborted
                raise Retry("in_use", p.worker_id, e.details() or "") from e
            self.pool.report_failure(p, e.code())
            raise Retry("prefill", p.worker_id, f"{e.code().name}: {e.details()}") from e
        finally:
            watch.cancel()
        self.pool.report_served(p)
        wall = time.monotonic() - t0
        st = res.stages  # the worker's own view; the rest of the RPC is queueing and network
        # worker-reported times are clipped to what the router saw, so stages sum to e2e
        self.stages.prefill = min(st.prefill, wall)
        self.stages.prefill_queue = wall - self.stages.prefill
        self.core.prefill_policy.prefilled(self.hashes, p.worker_id)
        self._keep_prompt_logprobs(res.prompt_logprobs)
        self.prefill_cached = res.num_cached_tokens
        return res

    def _finish_at_prefill(self, res: pb.PrefillResult) -> None:
        detok = self.core.frontend.detokenizer(self.prompt_ids, self.params)
        text, stop, finish = "", stop_reason_from_proto(res), res.finish_reason
        if detok is not None and stop != res.first_token_id:  # a stop token is not text
            got = detok.add([res.first_token_id])
            text = got.new_text + detok.flush()
            if got.stopped:  # a stop string in the first token: "stop", as the engine says
                stop, finish = got.stop_string, "stop"
        lps = logprobs_of([res.first_logprob]) if res.HasField("first_logprob") else []
        self._emit(Delta(self.index, text, [res.first_token_id], lps, finish,
                         stop_reason=stop, completion_tokens=1,
                         cached_tokens=res.num_cached_tokens))

    # -- decode ------------------------------------------------------------------------------
    async def _decode(self, d: WorkerState, p: WorkerState | None,
                      prefill: pb.PrefillResult | None) -> None:
        # resume_output_ids: set only when continuing a stream (then prefill is None)
        req = pb.DecodeRequest(request_id=self.rid, prompt_token_ids=self.prompt_ids,
                               params=self.proto_params, timeout_s=max(0.001, self.remaining()),
                               resume_output_ids=self.sent_ids)
        if prefill is not None:
            if not await self.pool.ensure_peer(p, d):
                await self._abort(p)
                raise Retry("peer", p.worker_id, f"{d.worker_id} does not know this incarnation")
            req.prefill.CopyFrom(prefill)
        t0 = time.monotonic()
        call = d.stub.Decode(req, timeout=max(0.001, self.remaining()))
        watch = cancel_on_stall(d.stall, call, d.worker_id)
        held: list[pb.DecodeOutput] = []
        confirmed = prefill is None  # remote KV: hold output until the pull succeeded
        try:
            async for msg in call:
                if prefill is None and self.stages.prefill == 0.0:
                    self.stages.prefill = time.monotonic() - t0  # D prefilled it itself
                if msg.HasField("stages"):
                    self._decode_stages(msg.stages, t0)
                if not confirmed:
                    if not held:
                        held.append(msg)  # the first token, sent before the pull
                        continue
                    confirmed = True
                    for h in held:
                        self._emit_output(h)
                    held.clear()
                self._emit_output(msg)
                if msg.finish_reason:
                    self.pool.report_served(d)
                    return
        except asyncio.CancelledError:
            call.cancel()  # D aborts on stream close and releases P if it had not read yet
            if not confirmed and p is not None:
                self.core.background(self._abort(p))
            if stalled_cancel(watch):  # retried, or continued on another D
                raise Retry("stalled", d.worker_id, "its engine loop stalled",
                            d.incarnation) from None
            raise
        except grpc.aio.AioRpcError as e:
            await self._decode_failed(e, d, p, confirmed)
        finally:
            watch.cancel()
        # a worker-side failure too: retried, or continued when output had started
        raise Retry("decode", d.worker_id, f"ended {self.rid} without a finish", d.incarnation)

    def _decode_stages(self, st: pb.StageTimes, t0: float) -> None:
        """Fold D's report into router-observed intervals (so stages sum to e2e):
        decode_queue = RPC start -> first message (D's admit + network);
        kv_transfer = D's read time, at most the gap since that first message."""
        now = time.monotonic()
        if st.decode_queue:
            self.stages.decode_queue = now - t0
            self.first_msg_at = now
        if st.kv_transfer:
            since = now - (self.first_msg_at or t0)
            self.stages.kv_transfer = min(st.kv_transfer, since)

    async def _decode_failed(self, e: grpc.aio.AioRpcError, d: WorkerState,
                             p: WorkerState | None, confirmed: bool) -> None:
        code, details = e.code(), e.details() or ""
        if not confirmed and p is not None:
            await self._abort(p)  # the held blocks on P are no longer needed by anyone
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            raise BadRequest(details, param=param_of(details)) from e
        if self.remaining() <= 0 or code == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise RequestTimeout(f"request {self.rid} timed out in decode: {details}") from e
        if details.startswith("kv_transfer:") and p is not None:
            if self.params.transfer_failure_policy == "fail":
                raise KVTransferFailed(f"KV transfer from {p.worker_id} to {d.worker_id} failed "
                                       f"({details}); transfer_failure_policy is 'fail'") from e
            raise Retry("kv_transfer", p.worker_id, details) from e
        if code == grpc.StatusCode.FAILED_PRECONDITION and p is not None:
            d.peers.discard((p.worker_id, p.incarnation))  # re-introduce before the next try
            raise Retry("peer", p.worker_id, details) from e
        if code == grpc.StatusCode.ALREADY_EXISTS:  # an earlier attempt of this request
            await self._abort(d)  # still had the id there (its stream was ending): free it
            raise Retry("in_use", d.worker_id, details) from e
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and details.startswith("decode_full:"):
            # D's KV pool was fuller than its last health report said: not a fault (ANCHORS
            # #4), and no retry spent; plan again once its health is re-read
            raise Retry("decode_full", d.worker_id, details) from e
        self.pool.report_failure(d, code)
        raise Retry("decode", d.worker_id, f"{code.name}: {details}", d.incarnation) from e

    async def _abort(self, w: WorkerState) -> None:
        """Best effort: free whatever `w` holds for this request (held blocks, a running prefill)."""
        try:
            await w.stub.Abort(pb.AbortRequest(request_id=self.rid), timeout=5.0)
        except grpc.aio.AioRpcError as e:
            log.info("abort of %s on %s failed: %s", self.rid, w.worker_id, e.code().name)

    # -- output ------------------------------------------------------------------------------
    def _emit_output(self, msg: pb.DecodeOutput) -> None:
        if not msg.token_ids and not msg.text and not msg.finish_reason:
            return  # a stages-only message
        self._keep_prompt_logprobs(msg.prompt_logprobs)  # a request prefilled on D
        delta = Delta(self.index, msg.text, list(msg.token_ids), logprobs_of(msg.logprobs),
                      msg.finish_reason or None)
        if msg.finish_reason:
            delta.stop_reason = stop_reason_from_proto(msg)
            delta.completion_tokens = msg.usage.completion_tokens or len(self.sent_ids) + len(msg.token_ids)
            # a continuation's prefix-cache hits may cover sent tokens: count prompt ones only
            delta.cached_tokens = min(max(msg.usage.cached_tokens, self.prefill_cached),
                                      len(self.prompt_ids))
        self._emit(delta)

    def _keep_prompt_logprobs(self, lps: Sequence[pb.TokenLogprob]) -> None:
        """The first prompt logprobs a worker sends (a continued stream's are not new)."""
        if lps and self.prompt_lps is None:
            self.prompt_lps = prompt_logprobs_from_proto(lps)

    def _emit(self, delta: Delta) -> None:
        if self.prompt_lps is not None and not self.prompt_lps_sent:
            delta.prompt_logprobs, self.prompt_lps_sent = self.prompt_lps, True
        now = time.monotonic()
        n = len(delta.token_ids)
        if n:
            self.core.metrics.tokens_sent(n, now - (self.last_emit or self.arrival),
                                          first=self.last_emit is None)
            self.last_emit = now
            self.sent_ids += delta.token_ids
        if delta.finish_reason:
            delta.trace = self._observe_finish(now)
        self.emit(delta)

    def _observe_finish(self, now: float) -> Trace:
        m, st = self.core.metrics, self.stages
        st.router_queue = self.dispatched - self.arrival
        e2e = now - self.arrival
        st.decode = max(0.0, e2e - (st.router_queue + st.prefill_queue + st.prefill
                                    + st.kv_transfer + st.decode_queue))
        m.observe_stages(st)
        m.queue_time.labels(**m.labels).observe(st.router_queue)
        m.e2e.labels(**m.labels).observe(e2e)
        trace = Trace(self.rid, self.index, *self.route, self.retries,
                      dataclasses.replace(st), e2e)
        if self.cfg.log_requests:
            TRACE_LOG.info("%s", json.dumps(trace.to_json()))
        return trace


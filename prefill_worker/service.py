"""Prefill worker: request lifecycle.

  1. Prefill(request): the prompt is queued in the engine with max_tokens=1 and
     hold_blocks_on_finish, so when the first token is sampled the prompt's blocks stay
     allocated. The caller waits with the request's deadline. A structured-output request's
     grammar is compiled first (on the gRPC thread) and token 0 is sampled under its mask.
  2. The first token (+ logprobs, + the last pre-norm hidden state for MTP) comes back with
     a KV handle: this worker's id and incarnation, the block ids, the compatibility hash and
     a lease (generation, deadline). The blocks are pinned under that lease.
  3. The decode worker READs the blocks over NIXL, then calls Release(request, generation);
     the reply says whether the lease was still valid: if it expired mid-read the data may
     be stale and the decode side must not use it (ANCHORS #6).
  4. Nobody releases (decode died, release lost): the lease expires on the loop tick and
     the blocks are freed (kv_lease_expired counts it). Abort frees at once.
If the first token already ends the request (EOS, stop token, max_tokens=1), no handle is
made and the blocks are freed immediately.
"""
from __future__ import annotations

import dataclasses
import queue
import threading
import time
from concurrent.futures import CancelledError

import grpc

from pdserve.engine.core.outputs import RequestOutput
from pdserve.engine.core.sampling_params import DuplicateRequestError, InvalidRequestError
from pdserve.engine.llm_engine import LLMEngine
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto.convert import (
    logprob_to_proto,
    params_from_proto,
    prompt_logprobs_to_proto,
    set_stop_reason,
)
from pdserve.worker.runtime import WorkerRuntime


class PrefillService:
    def __init__(self, rt: WorkerRuntime) -> None:
        self.rt = rt

    def prefill(self, req: pb.PrefillRequest, context: grpc.ServicerContext) -> pb.PrefillResult:
        rid, loop = req.request_id, self.rt.loop
        arrival = time.monotonic()
        try:
            params = params_from_proto(req.params)
            # token 0 is sampled here under the grammar: compile it on this thread, not the
            # engine loop's (cached by its hash; the router compiled it once already)
            self.rt.engine.precompile(params, req.timeout_s or 60.0)
        except InvalidRequestError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        wants_decode = params.max_tokens > 1
        # token 0 only; min_tokens >= 1 still bans EOS for it
        local = dataclasses.replace(params, max_tokens=1, n=1,
                                    min_tokens=min(params.min_tokens, 1))
        try:
            q = loop.subscribe(rid)
        except DuplicateRequestError as e:  # another Prefill of this worker runs the id
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        # the caller gone (cancelled, timed out, died) before the handle reached it: free
        handed_over = threading.Event()
        context.add_callback(lambda: None if handed_over.is_set() else self._abandon(rid, q))
        try:
            deadline = arrival + (req.timeout_s or 60.0)
            try:  # queued behind the loop's current step, which can be long (CPU, big chunks)
                loop.admit(rid, q, lambda e: self.rt.metrics.track(e, arrival, e.add_request(
                    list(req.prompt_token_ids), local, request_id=rid, hold_blocks=wants_decode)),
                    timeout_s=max(0.001, deadline - time.monotonic()))
            except DuplicateRequestError as e:  # the engine still holds the id (a lease):
                handed_over.set()  # not this call's to free
                context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
            except InvalidRequestError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except CancelledError:  # the caller left while the admit waited for the loop
                context.abort(grpc.StatusCode.CANCELLED, f"prefill of {rid} cancelled")
            except TimeoutError:
                self._abandon(rid)  # the command may still run: it aborts right after
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"prefill of {rid}: the engine did not take it before the deadline")
            out = self._wait_finished(q, rid, deadline, context)
        finally:
            loop.unsubscribe(rid, q)
        if not context.is_active():  # nobody will read these blocks
            self._abandon(rid)
            context.abort(grpc.StatusCode.CANCELLED, f"prefill of {rid} cancelled")
        result = self._result(rid, out, params, wants_decode, arrival)
        handed_over.set()  # from here the lease (or the reader's Release) owns the blocks
        return result

    def _abandon(self, rid: str, q: queue.Queue | None = None) -> None:
        """Free whatever the request holds, whether it is running, held or leased; from the
        close callback, wake the handler waiting on `q` too, so it lets go of the id now."""
        self.rt.leases.release(rid)
        self.rt.loop.abort_and_wake(rid, q)

    def _wait_finished(self, q: queue.Queue, rid: str, deadline: float,
                       context: grpc.ServicerContext) -> RequestOutput:
        while True:
            remaining = deadline - time.monotonic()
            try:
                item = q.get(timeout=max(0.0, remaining))
            except queue.Empty:  # free it without waiting on the loop (it may be mid-step)
                self._abandon(rid)
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"prefill of {rid} timed out")
            if isinstance(item, BaseException):
                self._abandon(rid)
                context.abort(grpc.StatusCode.INTERNAL, f"prefill failed: {item}")
            if item.finished:
                return item

    def _result(self, rid: str, out: RequestOutput, params, wants_decode: bool,
                arrival: float) -> pb.PrefillResult:
        token = out.new_token_ids[-1]
        res = pb.PrefillResult(request_id=rid, first_token_id=token,
                               num_cached_tokens=out.num_cached_tokens)
        if out.new_logprobs:
            res.first_logprob.CopyFrom(logprob_to_proto(token, out.new_logprobs[-1]))
        if out.prompt_logprobs:
            res.prompt_logprobs.extend(prompt_logprobs_to_proto(out.prompt_logprobs))
        if out.hidden is not None:
            res.last_hidden_state = out.hidden.numpy().astype("<f4").tobytes()
        res.stages.prefill = time.monotonic() - arrival
        if out.finish_reason == "stop" or not wants_decode:
            # the first token ends it (EOS / stop token, or max_tokens 1): nothing to hand
            # over; a request that was held for a reader is released here
            if wants_decode:
                self.rt.loop.call(lambda e: e.release_held(rid), timeout_s=10)
            res.finish_reason = out.finish_reason or "length"
            set_stop_reason(res, out.stop_reason)
            return res
        blocks = self.rt.loop.call(lambda e: _held_blocks(e, rid), timeout_s=10)
        ttl = self.rt.cfg.lease_ttl_s
        lease = self.rt.leases.pin(rid, blocks, ttl)
        res.kv.CopyFrom(pb.KVHandle(
            worker_id=self.rt.cfg.worker_id, incarnation=self.rt.incarnation, block_ids=blocks,
            num_tokens=out.num_prompt_tokens, compat_hash=self.rt.compat_hash,
            lease_generation=lease.generation, lease_deadline_unix=time.time() + ttl))
        return res

    def abort(self, request_id: str) -> bool:
        """End the request wherever it is (running or held) and free its pinned blocks."""
        found = self.rt.abort_local(request_id)
        return self.release(request_id, 0)[0] or found

    def release(self, request_id: str, generation: int) -> tuple[bool, bool]:
        """Free a held request's blocks. Returns (released, lease_was_valid).

        LeaseTable.release returns the blocks (a list, [] for a retried release of the same
        generation) while the lease was alive, None when it had expired or was lost: only a
        list means the reader's data was pinned for the whole read.
        """
        blocks = self.rt.leases.release(request_id, generation or None)
        if blocks is None:  # unknown, expired, or the release was lost (fault injection)
            return False, False
        if not blocks:
            return False, True
        try:  # the RPC thread is not held behind a long step: the release runs after it
            return bool(self.rt.loop.call(lambda e: e.release_held(request_id),
                                          timeout_s=2.0)), True
        except TimeoutError:
            return True, True  # queued on the loop; the lease no longer pins the blocks


def _held_blocks(engine: LLMEngine, rid: str) -> list[int]:
    req = engine.scheduler.get_request(rid)
    if req is None:
        raise KeyError(f"request {rid} is not held")
    bs = engine.config.cache.block_size
    return list(req.block_table[: (req.num_prompt_tokens + bs - 1) // bs])

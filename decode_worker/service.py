"""Decode worker: request lifecycle.

  1. AddPeer(prefill worker's PeerInfo): the router introduces a prefill worker; the
     compatibility hash must match (else refused, saying what differs); a new incarnation
     of a known worker replaces the old handle.
  2. Decode(request with a PrefillResult): blocks are allocated for the prompt, the request
     is parked WAITING_FOR_KV and its first token (sampled by the prefill worker) is
     streamed at once. A grammar (structured outputs) is compiled on the gRPC thread and its
     matcher rebuilt by replaying that first token (or a continued stream's sent tokens).
  3. Pull: NIXL READ of the prefill worker's blocks into ours, with the request's deadline;
     then Release on the prefill worker, whose reply says whether the lease held for the
     whole read. A stale lease counts as a failed read: the data is never used.
  4. Read OK -> the request RUNs and decodes; outputs stream back until it finishes.
     Read failed -> the request's transfer_failure_policy: `recompute` prefills locally
     (counted), `retry` / `fail` end the stream with UNAVAILABLE so the router can re-prefill
     elsewhere or report the error.
  5. Client cancels (stream closed) -> abort on the loop; if the read had not happened yet,
     the prefill worker is told to release. Every wait has the request's deadline.
Without a PrefillResult (colocated / selective disaggregation) it prefills locally; with
resume_output_ids as well, it continues a stream whose decode worker died (the router's
mid-stream continuation): those tokens count as output and only what follows is streamed.
"""
from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import CancelledError

import grpc
import numpy as np
import torch

from pdserve.engine.core.outputs import RequestOutput
from pdserve.engine.core.sampling_params import (
    DuplicateRequestError,
    InvalidRequestError,
    SamplingParams,
)
from pdserve.engine.core.scheduler import NoFreeBlocksError
from pdserve.kv_transfer.errors import KVTransferError, KVTransferTimeout
from pdserve.kv_transfer.handshake import HandshakeError, IncompatiblePeerError
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pbg
from pdserve.proto.convert import (
    logprob_to_proto,
    params_from_proto,
    prompt_logprobs_to_proto,
    set_stop_reason,
)
from pdserve.proto.rpc import make_channel
from pdserve.worker.runtime import WorkerRuntime, peer_from_proto


class KVReadFailed(RuntimeError):
    pass


class _StreamState:
    """Per-stream flags shared by the handler thread and gRPC's close callback.

    A request's local blocks must not be freed while a NIXL read is writing into them
    (they could already belong to another request): a close during the read only marks
    the stream cancelled, and the handler aborts once the read has returned.
    """

    def __init__(self, remote: bool) -> None:
        self.lock = threading.Lock()
        self.pulling = False
        self.pulled = not remote
        self.done = False
        self.cancelled = False


class DecodeService:
    def __init__(self, rt: WorkerRuntime) -> None:
        self.rt = rt
        self._peers: dict[str, tuple[str, pbg.WorkerStub, grpc.Channel]] = {}
        self._lock = threading.Lock()
        # (request_id, remote blocks, local blocks, tokens) of recent successful reads
        self.recent_pulls: collections.deque = collections.deque(maxlen=256)
        self._streams: dict[str, _StreamState] = {}  # open Decode streams by request id

    def close(self) -> None:
        with self._lock:
            for _, _, ch in self._peers.values():
                ch.close()
            self._peers.clear()

    # -- handshake -----------------------------------------------------------------------
    def add_peer(self, msg: pb.PeerInfo) -> pb.AddPeerReply:
        try:
            info = peer_from_proto(msg)
            self.rt.transport.add_peer(info)
        except (IncompatiblePeerError, HandshakeError) as e:
            return pb.AddPeerReply(accepted=False, reason=str(e))
        except KVTransferError as e:  # the transport refused the peer's metadata
            return pb.AddPeerReply(accepted=False, reason=f"peer metadata refused: {e}")
        try:  # the first read to a peer pays connection setup: pay it now, not in a TTFT
            self.rt.transport.warm_up(info.worker_id, info.incarnation,
                                      deadline=time.monotonic() + 10)
        except KVTransferError as e:  # the link may come back: the router asks again later
            return pb.AddPeerReply(accepted=False, reason=f"warm-up read failed: {e}",
                                   retryable=True)
        with self._lock:
            old = self._peers.pop(msg.worker_id, None)
            if old is not None:
                old[2].close()
            ch = make_channel(msg.grpc_address, cluster_secret=self.rt.cfg.cluster_secret)
            self._peers[msg.worker_id] = (msg.incarnation, pbg.WorkerStub(ch), ch)
        return pb.AddPeerReply(accepted=True)

    def _peer_stub(self, worker_id: str, incarnation: str) -> pbg.WorkerStub | None:
        with self._lock:
            entry = self._peers.get(worker_id)
        return entry[1] if entry is not None and entry[0] == incarnation else None

    # -- the stream ----------------------------------------------------------------------
    def decode(self, req: pb.DecodeRequest, context: grpc.ServicerContext) -> Iterator[pb.DecodeOutput]:
        rid, loop = req.request_id, self.rt.loop
        start = time.monotonic()
        deadline = start + (req.timeout_s or 600.0)
        try:
            params = params_from_proto(req.params)
            # the grammar is rebuilt here by replaying the tokens already accepted (the prefill
            # worker's first token or resume_output_ids); compile it off the engine loop
            self.rt.engine.precompile(params, req.timeout_s or 600.0)
        except InvalidRequestError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if req.resume_output_ids and req.HasField("prefill"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "resume_output_ids: a continued stream runs locally, without prefill")
        try:
            q = loop.subscribe(rid)
        except DuplicateRequestError as e:  # another stream of this worker serves the id
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        state = _StreamState(remote=req.HasField("prefill"))
        with self._lock:
            self._streams[rid] = state
        context.add_callback(lambda: self._on_close(rid, req, state, q))
        try:
            if req.HasField("prefill"):
                first, blocks = self._admit(state, context, self._admit_remote, req, params,
                                            context, start, q)
                admitted, m = time.monotonic() - start, self.rt.metrics
                m.decode_queue_stage.labels(**m.labels).observe(admitted)
                yield self._to_proto(first, pb.StageTimes(decode_queue=admitted))
                with state.lock:
                    if state.cancelled:  # closed since: _on_close queued the abort, which
                        return  # frees these blocks; a read into them now could land late
                    state.pulling = True
                try:
                    stages = self._pull(req, params, blocks, deadline, context)
                finally:
                    with state.lock:
                        state.pulling, state.pulled = False, True
                        cancelled = state.cancelled
                if cancelled:  # the client left during the read: free now that it returned
                    loop.call(lambda e: e.abort_request(rid))
                    return
                yield pb.DecodeOutput(request_id=rid, stages=stages)
            else:
                self._admit(state, context, self._admit_local, req, params, context, start, q)
            yield from self._stream(q, rid, deadline, context, state)
        finally:
            loop.unsubscribe(rid, q)
            with self._lock:
                if self._streams.get(rid) is state:
                    self._streams.pop(rid, None)

    def defer_abort(self, rid: str) -> bool:
        """Abort RPC for a stream whose KV read is in flight: mark it; the stream's handler
        frees the blocks once the read returns. False when no read is in flight."""
        with self._lock:
            state = self._streams.get(rid)
        if state is None:
            return False
        with state.lock:
            if not state.pulling:
                return False
            state.cancelled = True
        return True

    @staticmethod
    def _admit(state: _StreamState, context, admit, *args):
        """admit(*args), refusing a request id the engine still has (a stream that ended
        while its request waits to be aborted): ALREADY_EXISTS, and this stream's close
        leaves that request alone (it is not this stream's to free)."""
        try:
            return admit(*args)
        except DuplicateRequestError as e:
            with state.lock:
                state.done = True
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        except CancelledError:  # the stream closed while the admit waited for the loop
            context.abort(grpc.StatusCode.CANCELLED, "stream closed before it was admitted")

    def _admit_local(self, req: pb.DecodeRequest, params: SamplingParams, context,
                     arrival: float, q: queue.Queue) -> None:
        if params.n > 1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "n: the router fans n > 1 out")
        try:
            # resume_output_ids: a stream continued after its decode worker died (the router
            # sends the tokens the client already has; the engine treats them as output)
            self.rt.loop.admit(req.request_id, q, lambda e: self.rt.metrics.track(
                e, arrival, e.add_request(list(req.prompt_token_ids), params,
                                          request_id=req.request_id,
                                          resume_output_ids=list(req.resume_output_ids))))
        except DuplicateRequestError:
            raise
        except InvalidRequestError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def _admit_remote(self, req: pb.DecodeRequest, params: SamplingParams, context,
                      arrival: float, q: queue.Queue) -> tuple[RequestOutput, list[int]]:
        kv = req.prefill.kv
        if self._peer_stub(kv.worker_id, kv.incarnation) is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"unknown prefill peer {kv.worker_id}/{kv.incarnation}")
        if kv.compat_hash != self.rt.compat_hash:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"KV compatibility hash differs: {kv.compat_hash} != {self.rt.compat_hash}")

        def admit(e) -> tuple[list[int], RequestOutput]:
            admitted = e.add_remote_request(
                req.request_id, list(req.prompt_token_ids), req.prefill.first_token_id, params,
                hidden=_hidden_state(req.prefill))  # MTP drafts from it once the KV lands
            self.rt.metrics.track(e, arrival, [req.request_id])
            return admitted

        try:
            blocks, first = self.rt.loop.admit(req.request_id, q, admit)
        except DuplicateRequestError:
            raise
        except InvalidRequestError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except NoFreeBlocksError as e:  # fuller than the router's last health poll said:
            # a full pool, not a fault (the router retries without holding it against us)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"decode_full: {e}")
        if req.prefill.HasField("first_logprob"):
            lp = req.prefill.first_logprob
            first.new_logprobs = [(lp.logprob, [(t.token_id, t.logprob) for t in lp.top])]
        return first, blocks

    def _pull(self, req: pb.DecodeRequest, params: SamplingParams, blocks: list[int],
              deadline: float, context) -> pb.StageTimes:
        """Read the prompt's KV from the prefill worker, then release it there."""
        rid, kv = req.request_id, req.prefill.kv
        t0 = time.monotonic()
        try:
            remote = list(kv.block_ids)
            self.rt.transport.read_blocks(kv.worker_id, kv.incarnation, remote,
                                          blocks[: len(remote)],
                                          deadline=min(deadline, t0 + self.rt.cfg.transfer_timeout_s))
            released, valid = self._release_remote(kv, rid, deadline)
            if not valid:
                raise KVReadFailed(f"lease of {rid} on {kv.worker_id} was not valid for the "
                                   f"whole read (released={released}): data discarded")
        except Exception as e:  # every transfer failure takes the request's policy
            self._release_remote(kv, rid, deadline)  # best effort: never leave P pinned
            broken = getattr(self.rt.transport, "broken", None)
            if broken:  # a rank of this TP worker is gone: the worker ends, not the peer's
                # fault, so the router marks this worker down and retries elsewhere
                context.abort(grpc.StatusCode.UNAVAILABLE, f"decode worker "
                              f"{self.rt.cfg.worker_id}: tensor-parallel group broken: {broken}")
            if isinstance(e, KVTransferTimeout) and not e.local_blocks_safe:
                # NIXL could not abort the read: our blocks may still be written. Keep them
                # out of the pool (counted) rather than hand them to another request.
                self.rt.loop.call(lambda en: en.quarantine_request(rid))
                context.abort(grpc.StatusCode.UNAVAILABLE, f"kv_transfer: {e}")
            if isinstance(e, KVReadFailed):  # the transport counts its own failures
                self.rt.kv_metrics.transfer_failed()
            if params.transfer_failure_policy == "recompute":
                self.rt.loop.call(lambda en: en.kv_failed(rid))
                return pb.StageTimes(kv_transfer=time.monotonic() - t0)
            self.rt.loop.call(lambda en: en.abort_request(rid))
            context.abort(grpc.StatusCode.UNAVAILABLE, f"kv_transfer: {e}")
        self.rt.loop.call(lambda en: en.kv_arrived(rid))
        self.recent_pulls.append((rid, remote, blocks[: len(remote)], kv.num_tokens))
        took = time.monotonic() - t0
        self.rt.metrics.kv_transfer_stage.labels(**self.rt.metrics.labels).observe(took)
        return pb.StageTimes(kv_transfer=took)

    def _release_remote(self, kv: pb.KVHandle, rid: str, deadline: float) -> tuple[bool, bool]:
        stub = self._peer_stub(kv.worker_id, kv.incarnation)
        if stub is None:
            return False, False
        timeout = max(0.1, min(5.0, deadline - time.monotonic()))
        try:
            reply = stub.Release(pb.ReleaseRequest(request_id=rid,
                                                   lease_generation=kv.lease_generation),
                                 timeout=timeout)
        except grpc.RpcError:
            return False, False  # the lease on the prefill side is the backstop
        return reply.released, reply.lease_was_valid

    def _stream(self, q: queue.Queue, rid: str, deadline: float, context,
                state: dict) -> Iterator[pb.DecodeOutput]:
        pending: RequestOutput | BaseException | None = None
        while True:
            item, pending = pending, None
            if item is None:
                try:
                    item = q.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    self.rt.loop.submit(lambda e: e.abort_request(rid))
                    context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  f"decode of {rid} timed out")
            if isinstance(item, BaseException):
                context.abort(grpc.StatusCode.INTERNAL, f"decode failed: {item}")
            item, pending = _coalesce(item, q)
            if item.finished:
                state.done = True
            yield self._to_proto(item)
            if item.finished:
                return

    def _on_close(self, rid: str, req: pb.DecodeRequest, state: _StreamState,
                  q: queue.Queue) -> None:
        """RPC ended (finished, cancelled or failed): make sure nothing stays allocated, and
        wake the handler (it may wait on `q` until its deadline) so it lets go of the id."""
        with state.lock:
            if state.done:
                return
            state.cancelled = True
            if state.pulling:
                return  # the handler frees once the read returns
            pulled = state.pulled
        self.rt.loop.abort_and_wake(rid, q)
        if not pulled:  # the prefill worker still pins the prompt: release it now
            threading.Thread(target=self._release_remote,
                             args=(req.prefill.kv, rid, time.monotonic() + 5), daemon=True).start()

    @staticmethod
    def _to_proto(out: RequestOutput, stages: pb.StageTimes | None = None) -> pb.DecodeOutput:
        msg = pb.DecodeOutput(request_id=out.request_id, token_ids=out.new_token_ids,
                              text=out.new_text, finish_reason=out.finish_reason or "")
        for tok, lp in zip(out.new_token_ids, out.new_logprobs):
            msg.logprobs.append(logprob_to_proto(tok, lp))
        if out.prompt_logprobs:  # a request prefilled here
            msg.prompt_logprobs.extend(prompt_logprobs_to_proto(out.prompt_logprobs))
        set_stop_reason(msg, out.stop_reason)
        if out.finished:
            msg.usage.CopyFrom(pb.Usage(prompt_tokens=out.num_prompt_tokens,
                                        completion_tokens=out.num_output_tokens,
                                        cached_tokens=out.num_cached_tokens))
        if stages is not None:
            msg.stages.CopyFrom(stages)
        return msg


def _coalesce(first: RequestOutput, q: queue.Queue
              ) -> tuple[RequestOutput, RequestOutput | BaseException | None]:
    """`first` merged with the outputs already queued behind it, so a stream that fell behind
    the engine catches up in one message (each message is Python work on a stream thread,
    which competes for the GIL with the engine loop). Returns (merged, an error that was
    queued after them, to raise next)."""
    items = [first]
    while not items[-1].finished:
        try:
            nxt = q.get_nowait()
        except queue.Empty:
            break
        if isinstance(nxt, BaseException):
            return _merge(items), nxt
        items.append(nxt)
    return _merge(items), None


def _merge(items: list[RequestOutput]) -> RequestOutput:
    if len(items) == 1:
        return items[0]
    last = items[-1]
    return dataclasses.replace(
        last, new_token_ids=[t for o in items for t in o.new_token_ids],
        new_text="".join(o.new_text for o in items),
        new_logprobs=[lp for o in items for lp in o.new_logprobs],
        prompt_logprobs=items[0].prompt_logprobs)  # only a request's first output has them


def _hidden_state(result: pb.PrefillResult) -> torch.Tensor | None:
    """The prefill worker's last pre-norm hidden state (float32 little-endian), if shipped."""
    if not result.last_hidden_state:
        return None
    return torch.from_numpy(np.frombuffer(result.last_hidden_state, dtype="<f4").copy())

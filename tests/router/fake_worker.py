"""An in-process stand-in for the Worker gRPC service, for router unit tests only.

It speaks the real proto over real gRPC and keeps the bookkeeping the router must get right
(held prefill blocks under a lease, decode streams, aborts, peers), with a trivial "model":
greedy output continues the prompt's last token id upwards; a seeded request starts from
its seed. Switches inject the failures the router must survive. The real workers are tested
by the end-to-end tests (test_e2e_*.py), which start `pdserve serve`.
"""
from __future__ import annotations

import threading
import time
import uuid

import grpc

from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pbg
from pdserve.proto.rpc import cluster_interceptor, make_server

from tests.cluster_secret import SECRET

BLOCKS = 256
BLOCK_SIZE = 16


class FakeWorker(pbg.WorkerServicer):
    registry: dict[str, FakeWorker] = {}  # worker id -> instance (decode "pulls" from it)

    def __init__(self, worker_id: str, role: str, vocab: int = 49152, eos: int = 2) -> None:
        self.worker_id, self.role, self.vocab, self.eos = worker_id, role, vocab, eos
        self.incarnation = uuid.uuid4().hex[:8]
        self.lock = threading.Lock()
        self.held: dict[str, int] = {}  # prefill: request id -> pinned blocks
        self.active: set[str] = set()  # decode: streams running
        self.cancelled: list[str] = []  # decode: streams the caller closed early
        self.aborted: list[str] = []
        self.prefills: list[str] = []
        self.params_seen: list[pb.SamplingParams] = []  # every Prefill's and Decode's params
        self.peers: set[tuple[str, str]] = set()
        self.seen: set[tuple[int, ...]] = set()  # prefill: prompts prefilled (prefix cache)
        # failure switches
        self.fail_prefills = 0  # the next N Prefill calls fail with UNAVAILABLE
        self.prefill_delay_s = 0.0
        self.fail_transfers = 0  # the next N remote Decode calls fail the KV read
        self.full_decodes = 0  # the next N remote Decode calls find the KV pool full
        self.in_use_decodes = 0  # the next N Decode calls find their id still in use
        self.token_delay_s = 0.0
        self.fail_after_tokens = 0  # decode crashes (INTERNAL) after streaming N tokens
        self.invalid_detail: str | None = None  # Prefill/Decode answer INVALID_ARGUMENT
        self.refuse_peers = 0  # decode: the next N AddPeer calls refuse the pair
        self.refuse_retryable = True  # ... for a passing reason (else: incompatible)
        self.add_peer_calls = 0
        # Health: its status and loop_busy_s (a real worker inside a long step answers
        # "busy"), answered after health_delay_s (a worker with no free server thread)
        self.health_status, self.loop_busy_s, self.health_delay_s = "ok", 0.0, 0.0
        self.server: grpc.Server | None = None
        self.address = ""
        FakeWorker.registry[worker_id] = self

    def start(self) -> FakeWorker:
        # it checks the cluster secret as a real worker does (the router must always send it)
        self.server, port = make_server("127.0.0.1", 0, max_workers=128,
                                        auth=cluster_interceptor(SECRET))
        pbg.add_WorkerServicer_to_server(self, self.server)
        self.server.start()
        self.address = f"127.0.0.1:{port}"
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(0)

    def restart(self) -> None:
        """A new process: new incarnation, new port, nothing held, no peers."""
        self.stop()
        self.incarnation = uuid.uuid4().hex[:8]
        self.held.clear()
        self.peers.clear()
        self.start()

    # -- the "model" -----------------------------------------------------------------------
    def _tokens(self, prompt: list[int], params: pb.SamplingParams) -> list[int]:
        start = params.seed if params.HasField("seed") else prompt[-1]
        n = params.max_tokens if params.HasField("max_tokens") else 16
        tokens = [(start + 1 + i) % self.vocab for i in range(n)]
        ends = [i for i, t in enumerate(tokens) if t in params.stop_token_ids]
        return tokens[:ends[0] + 1] if ends else tokens  # a stop token ends it, included

    @staticmethod
    def _lp(tok: int, params: pb.SamplingParams) -> list[pb.TokenLogprob]:
        if not params.HasField("logprobs"):
            return []
        top = [pb.TopLogprob(token_id=tok, logprob=-0.5)][: params.logprobs]
        return [pb.TokenLogprob(token_id=tok, logprob=-0.5, top=top)]

    # -- RPCs ------------------------------------------------------------------------------
    def Prefill(self, req: pb.PrefillRequest, context) -> pb.PrefillResult:
        self.prefills.append(req.request_id)
        self.params_seen.append(req.params)
        if self.invalid_detail:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, self.invalid_detail)
        with self.lock:
            if self.fail_prefills > 0:
                self.fail_prefills -= 1
                context.abort(grpc.StatusCode.UNAVAILABLE, "injected prefill failure")
        time.sleep(self.prefill_delay_s)
        if not context.is_active():  # the caller gave up: pin nothing (what a worker must do)
            context.abort(grpc.StatusCode.CANCELLED, "caller went away")
        tokens = self._tokens(list(req.prompt_token_ids), req.params)
        prompt = tuple(req.prompt_token_ids)
        with self.lock:  # a prefix cache of whole prompts: a repeat hits its full blocks
            cached = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE if prompt in self.seen else 0
            self.seen.add(prompt)
        res = pb.PrefillResult(request_id=req.request_id, first_token_id=tokens[0],
                               stages=pb.StageTimes(prefill=0.001), num_cached_tokens=cached)
        lps = self._lp(tokens[0], req.params)
        if lps:
            res.first_logprob.CopyFrom(lps[0])
        if len(tokens) == 1:
            res.finish_reason = "length"
            return res
        blocks = -(-len(req.prompt_token_ids) // BLOCK_SIZE)
        with self.lock:
            self.held[req.request_id] = blocks
        res.kv.CopyFrom(pb.KVHandle(worker_id=self.worker_id, incarnation=self.incarnation,
                                    block_ids=list(range(blocks)),
                                    num_tokens=len(req.prompt_token_ids), lease_generation=1))
        return res

    def release(self, rid: str) -> bool:
        with self.lock:
            return self.held.pop(rid, None) is not None

    def Decode(self, req: pb.DecodeRequest, context):
        rid, remote = req.request_id, req.HasField("prefill")
        self.params_seen.append(req.params)
        if self.invalid_detail:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, self.invalid_detail)
        src = FakeWorker.registry.get(req.prefill.kv.worker_id) if remote else None
        if remote and (req.prefill.kv.worker_id, req.prefill.kv.incarnation) not in self.peers:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "unknown prefill peer")
        with self.lock:
            full = remote and self.full_decodes > 0
            self.full_decodes -= full
            in_use = self.in_use_decodes > 0
            self.in_use_decodes -= in_use
        if full:  # as decode_worker/service.py answers a NoFreeBlocksError at admission
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "decode_full: injected full pool")
        if in_use:  # as it answers an id an earlier attempt's stream still holds
            context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {rid!r} is already in use")
        state = {"done": False, "pulled": not remote}

        def on_close() -> None:
            with self.lock:
                self.active.discard(rid)
                if not state["done"]:
                    self.cancelled.append(rid)
            if not state["pulled"] and src is not None:
                src.release(rid)
        context.add_callback(on_close)
        with self.lock:
            self.active.add(rid)
        tokens = self._tokens(list(req.prompt_token_ids), req.params)
        if remote:
            yield pb.DecodeOutput(request_id=rid, token_ids=[tokens[0]], text=f" t{tokens[0]}",
                                  logprobs=self._lp(tokens[0], req.params),
                                  stages=pb.StageTimes(decode_queue=0.001))
            tokens = tokens[1:]
            src.release(rid)
            state["pulled"] = True
            with self.lock:
                fail = self.fail_transfers > 0
                self.fail_transfers -= fail
            if fail:
                context.abort(grpc.StatusCode.UNAVAILABLE, "kv_transfer: injected read failure")
            yield pb.DecodeOutput(request_id=rid, stages=pb.StageTimes(kv_transfer=0.002))
        for i, tok in enumerate(tokens):
            time.sleep(self.token_delay_s)
            if not context.is_active():
                return
            if self.fail_after_tokens and i == self.fail_after_tokens:
                context.abort(grpc.StatusCode.INTERNAL, "injected decode crash")
            last = i == len(tokens) - 1
            stopped = last and tok in req.params.stop_token_ids
            msg = pb.DecodeOutput(request_id=rid, token_ids=[tok], text=f" t{tok}",
                                  logprobs=self._lp(tok, req.params),
                                  finish_reason="stop" if stopped else "length" if last else "")
            if stopped:
                msg.stop_token_id = tok
            if last:
                total = len(tokens) + (1 if remote else 0)
                msg.usage.CopyFrom(pb.Usage(prompt_tokens=len(req.prompt_token_ids),
                                            completion_tokens=total))
                state["done"] = True
            yield msg

    def Abort(self, req: pb.AbortRequest, context) -> pb.AbortReply:
        self.aborted.append(req.request_id)
        return pb.AbortReply(found=self.release(req.request_id))

    def GetPeerInfo(self, req, context) -> pb.PeerInfo:
        return pb.PeerInfo(worker_id=self.worker_id, incarnation=self.incarnation,
                           role=self.role, grpc_address=self.address)

    def AddPeer(self, req: pb.PeerInfo, context) -> pb.AddPeerReply:
        with self.lock:
            self.add_peer_calls += 1
            if self.refuse_peers > 0:
                self.refuse_peers -= 1
                why = "warm-up read failed: injected" if self.refuse_retryable else \
                    "incompatible peer: injected"
                return pb.AddPeerReply(accepted=False, reason=why,
                                       retryable=self.refuse_retryable)
        self.peers.add((req.worker_id, req.incarnation))
        return pb.AddPeerReply(accepted=True)

    def Health(self, req, context) -> pb.HealthResponse:
        time.sleep(self.health_delay_s)
        with self.lock:
            pinned = sum(self.held.values())
            running = len(self.active)
        return pb.HealthResponse(status=self.health_status, loop_busy_s=self.loop_busy_s,
                                 role=self.role, worker_id=self.worker_id,
                                 incarnation=self.incarnation, num_running=running,
                                 num_free_blocks=BLOCKS - pinned, num_total_blocks=BLOCKS,
                                 num_pinned_blocks=pinned, num_held_requests=len(self.held))


class FakeRef:
    """WorkerRef over a FakeWorker: endpoints follow its restarts, like a Ray actor's."""

    def __init__(self, w: FakeWorker, alive: bool | None = None) -> None:
        self.w, self.worker_id, self.role = w, w.worker_id, w.role
        self.lives = alive  # what alive() says (None: unknown, as for a fixed address)
        self.restarts = 0  # restart() calls (it cannot restart a fake: False)

    async def endpoints(self) -> dict:
        return {"worker_id": self.worker_id, "role": self.role, "grpc_address": self.w.address,
                "incarnation": self.w.incarnation, "metrics_address": ""}

    async def alive(self) -> bool | None:
        return self.lives

    async def shutdown(self) -> None:
        self.w.stop()

    async def restart(self) -> bool:
        self.restarts += 1
        return False

    def lifecycle(self) -> dict:
        return {}

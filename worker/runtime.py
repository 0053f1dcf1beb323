"""WorkerRuntime: one worker process = engine + loop thread + NIXL transport + gRPC server.

The role decides which handlers answer: prefill (Prefill, Release), decode (Decode with a
remote KV pull), colocated (Decode without a prefill). All roles answer Abort, Health,
GetPeerInfo and AddPeer. Ray actors (worker/actor.py) construct one of these; tests may
construct it in-process.
"""
from __future__ import annotations

import hashlib
import logging

import grpc
import torch
from prometheus_client import CollectorRegistry

from engine.engine import LLMEngine, RequestOutput
from engine.llm import build_engine
from engine.loop import EngineLoop
from kv_transfer.faults import FaultInjector
from kv_transfer.handshake import HandshakeError, PeerInfo, compat_config
from kv_transfer.lease import LeaseTable
from kv_transfer.metrics import kv_metrics
from kv_transfer.nixl_transport import NixlKVTransport
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pbg
from proto.rpc import make_server
from worker.config import WorkerConfig
from worker.metrics import WorkerMetrics, serve_metrics

log = logging.getLogger(__name__)


def build_worker_engine(cfg: WorkerConfig) -> LLMEngine:
    engine = build_engine(cfg.model, device=cfg.device, dtype=cfg.dtype,
                          num_blocks=cfg.num_blocks, block_size=cfg.block_size,
                          max_num_seqs=cfg.max_num_seqs,
                          max_num_batched_tokens=cfg.max_num_batched_tokens,
                          max_model_len=cfg.max_model_len,
                          enable_prefix_caching=cfg.enable_prefix_caching,
                          use_triton=cfg.use_triton,
                          use_cuda_graphs=cfg.use_cuda_graphs, seed=cfg.seed,
                          speculative=cfg.speculative,
                          num_speculative_tokens=cfg.num_speculative_tokens,
                          mtp_head=cfg.mtp_head, draft_vocab=cfg.draft_vocab)
    # prefill role: ship the last hidden state (with MTP the decode worker drafts from it;
    # the MTP layer's KV of the prompt is written here and travels in the same blocks)
    engine.keep_hidden = cfg.role == "prefill"
    return engine


class WorkerRuntime:
    def __init__(self, cfg: WorkerConfig, engine: LLMEngine | None = None) -> None:
        self.cfg = cfg
        self.engine = engine or build_worker_engine(cfg)
        self.registry = CollectorRegistry()
        self.metrics = WorkerMetrics(self.registry, cfg.role, cfg.worker_id)
        self.kv_metrics = kv_metrics(self.registry).bind(cfg.role, cfg.worker_id)
        ec = self.engine.config
        self.faults = FaultInjector(cfg.faults)
        self.transport = NixlKVTransport(self.engine.runner.kv_cache, cfg.worker_id,
                                         compat_config(ec.model, ec.cache, self.engine.compat_extra()), faults=self.faults,
                                         role=cfg.role, metrics=self.kv_metrics)
        # a restart makes a new transport, hence a new incarnation (ANCHORS #3)
        self.incarnation = self.transport.incarnation
        self.compat_hash = self.transport.peer_info().compat_hash
        self.leases = LeaseTable(faults=self.faults, metrics=self.kv_metrics)
        self.loop = EngineLoop(self.engine, on_tick=self._tick,
                               on_step=self.metrics.observe_step)
        self.server: grpc.Server | None = None
        self.address = ""
        self.metrics_address = ""
        self.draining = False

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> "WorkerRuntime":
        from decode_worker.service import DecodeService
        from prefill_worker.service import PrefillService

        self.loop.start()
        self.prefill = PrefillService(self)
        self.decode = DecodeService(self)
        # one thread per open Prefill/Decode stream, plus room for Health/Release/Abort
        self.server, port = make_server(self.cfg.host, self.cfg.grpc_port,
                                        max_workers=max(64, self.cfg.max_num_seqs + 16))
        pbg.add_WorkerServicer_to_server(WorkerServicer(self), self.server)
        self.server.start()
        self.address = f"{self.cfg.host}:{port}"
        if self.cfg.metrics_port >= 0:
            httpd = serve_metrics(self.registry, self.cfg.host, self.cfg.metrics_port)
            self._metrics_httpd = httpd
            self.metrics_address = f"{self.cfg.host}:{httpd.server_port}"
        log.info("worker %s (%s) gRPC %s metrics %s", self.cfg.worker_id, self.cfg.role,
                 self.address, self.metrics_address)
        return self

    def stop(self, grace_s: float = 2.0) -> None:
        if self.server is not None:
            self.server.stop(grace_s).wait(grace_s + 1)
        if getattr(self, "_metrics_httpd", None) is not None:
            self._metrics_httpd.shutdown()
        self.loop.stop()
        self.decode.close() if hasattr(self, "decode") else None
        self.transport.close()

    def _tick(self, engine: LLMEngine) -> None:
        """Loop-thread housekeeping: expire leases, refresh gauges."""
        for lease in self.leases.expire():  # counts kv_lease_expired itself
            engine.release_held(lease.request_id)
        self.metrics.refresh(engine)

    # -- shared RPCs ---------------------------------------------------------------------
    def peer_info(self) -> pb.PeerInfo:
        info = self.transport.peer_info()
        return pb.PeerInfo(worker_id=info.worker_id, incarnation=info.incarnation,
                           role=self.cfg.role, grpc_address=self.address,
                           compat_hash=info.compat_hash, transport_info=info.to_bytes())

    def health(self) -> pb.HealthResponse:
        def snapshot(e: LLMEngine) -> pb.HealthResponse:
            s, bm = e.scheduler, e.scheduler.block_manager
            return pb.HealthResponse(
                status="draining" if self.draining else "ok", role=self.cfg.role,
                worker_id=self.cfg.worker_id, incarnation=self.incarnation,
                num_running=s.num_running, num_waiting=s.num_waiting,
                num_free_blocks=bm.num_free_blocks, num_total_blocks=bm.num_blocks,
                num_pinned_blocks=self.leases.pinned_blocks, kv_cache_usage=bm.usage,
                num_held_requests=len(s.held_request_ids()))
        return self.loop.call(snapshot, timeout_s=10)

    def kv_digests(self, block_ids: list[int], num_tokens: int) -> list[str]:
        """sha256 of each block's first tokens (all layers, K and V): tests compare P and D."""
        def digest(e: LLMEngine) -> list[str]:
            kv, bs, out = e.runner.kv_cache, e.config.cache.block_size, []
            for i, b in enumerate(block_ids):
                n = min(bs, num_tokens - i * bs)
                raw = kv[b, :, :, :n].contiguous().cpu().view(torch.uint8).numpy().tobytes()
                out.append(hashlib.sha256(raw).hexdigest())
            return out
        return self.loop.call(digest, timeout_s=30)

    def abort(self, request_id: str) -> bool:
        """Abort a running request and/or free its held blocks, whatever state it is in."""
        if self.decode.defer_abort(request_id):
            return True
        found = self.loop.call(lambda e: e.abort_request(request_id), timeout_s=10)
        if found:  # an open stream for it ends now, not at its deadline
            self.loop.publish(request_id, RequestOutput(request_id, [], "", True, "abort"))
        released = self.prefill.release(request_id, 0)[0]
        return found or released


def peer_from_proto(msg: pb.PeerInfo) -> PeerInfo:
    info = PeerInfo.from_bytes(msg.transport_info)  # strict: names the bad field
    if (info.worker_id, info.incarnation) != (msg.worker_id, msg.incarnation):
        raise HandshakeError("peer_info.worker_id/incarnation: envelope and transport info differ")
    return info


class WorkerServicer(pbg.WorkerServicer):
    """Thin gRPC adapter: every method delegates to the role services of the runtime."""

    def __init__(self, rt: WorkerRuntime) -> None:
        self.rt = rt

    def Prefill(self, request, context):
        return self.rt.prefill.prefill(request, context)

    def Decode(self, request, context):
        yield from self.rt.decode.decode(request, context)

    def Release(self, request, context):
        released, valid = self.rt.prefill.release(request.request_id, request.lease_generation)
        return pb.ReleaseReply(released=released, lease_was_valid=valid)

    def Abort(self, request, context):
        return pb.AbortReply(found=self.rt.abort(request.request_id))

    def GetPeerInfo(self, request, context):
        return self.rt.peer_info()

    def AddPeer(self, request, context):
        return self.rt.decode.add_peer(request)

    def Health(self, request, context):
        return self.rt.health()

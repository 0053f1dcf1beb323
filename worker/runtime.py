"""WorkerRuntime: what every role of a worker shares -- engine + loop thread + KV transport +
leases + metrics -- and the RPCs every role answers (peer info, health, KV digests).

The role services (prefill_worker/service.py, decode_worker/service.py) are built on top of
it, and worker/server.py assembles a runtime, its services and the gRPC server into one
worker process. This module imports neither, so the arrows point one way.
"""
from __future__ import annotations

import hashlib
import logging

import torch
from prometheus_client import CollectorRegistry

from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.llm import build_engine
from pdserve.engine.llm_engine import LLMEngine, RequestOutput
from pdserve.kv_transfer.faults import FaultInjector
from pdserve.kv_transfer.handshake import HandshakeError, PeerInfo
from pdserve.kv_transfer.lease import LeaseTable
from pdserve.kv_transfer.metrics import kv_metrics
from pdserve.kv_transfer.transport import KVTransport, make_transport
from pdserve.proto import pdserve_pb2 as pb
from pdserve.worker.config import WorkerConfig
from pdserve.worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)


def build_worker_engine(cfg: WorkerConfig) -> LLMEngine:
    engine = build_engine(cfg.engine)
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
        self.faults = FaultInjector(cfg.faults)
        self.transport: KVTransport = make_transport(
            cfg.kv_transport, self.engine.runner.kv_cache, cfg.worker_id,
            self.engine.kv_compat_payload(), faults=self.faults, role=cfg.role,
            metrics=self.kv_metrics)
        # a restart makes a new transport, hence a new incarnation (ANCHORS #3)
        self.incarnation = self.transport.incarnation
        self.compat_hash = self.transport.peer_info().compat_hash
        self.leases = LeaseTable(faults=self.faults, metrics=self.kv_metrics)
        self.loop = EngineLoop(self.engine, on_tick=self._tick,
                               on_step=self.metrics.observe_step)
        self.address = ""  # gRPC address, set when the server starts (worker/server.py)
        self.draining = False

    def close(self) -> None:
        """Stop the loop thread and the transport (the server is stopped before this)."""
        self.loop.stop()
        self.transport.close()

    def _tick(self, engine: LLMEngine) -> None:
        """Loop-thread housekeeping: expire leases, refresh gauges."""
        for lease in self.leases.expire():  # counts kv_lease_expired itself
            engine.release_held(lease.request_id)
        self.metrics.refresh(engine)

    def abort_local(self, request_id: str) -> bool:
        """Abort the request in the engine (running, waiting or held); an open stream for it
        ends now, not at its deadline. True when the engine knew it."""
        found = self.loop.call(lambda e: e.abort_request(request_id), timeout_s=10)
        if found:
            self.loop.publish(request_id, RequestOutput(request_id, [], "", True, "abort"))
        return found

    # -- RPCs every role answers ---------------------------------------------------------
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


def peer_from_proto(msg: pb.PeerInfo) -> PeerInfo:
    info = PeerInfo.from_bytes(msg.transport_info)  # strict: names the bad field
    if (info.worker_id, info.incarnation) != (msg.worker_id, msg.incarnation):
        raise HandshakeError("peer_info.worker_id/incarnation: envelope and transport info differ")
    return info

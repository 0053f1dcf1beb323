"""WorkerRuntime: what every role of a worker shares -- engine + loop thread + KV transport +
leases + metrics -- and the RPCs every role answers (peer info, health, KV digests).

The role services (prefill_worker/service.py, decode_worker/service.py) are built on top of
it, and worker/server.py assembles a runtime, its services and the gRPC server into one
worker process. This module imports neither, so the arrows point one way.
"""
from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable

import torch
from prometheus_client import CollectorRegistry

from pdserve.engine.core.outputs import RequestOutput
from pdserve.engine.engine_loop import EngineLoop, EngineLoopError
from pdserve.engine.exec.kv_cache import layer_views
from pdserve.engine.llm import build_engine
from pdserve.engine.llm_engine import LLMEngine
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
    if cfg.engine.tensor_parallel_size > 1:  # each rank needs its transport (tp_worker.py)
        raise ValueError(f"engine.tensor_parallel_size: a worker of "
                         f"{cfg.engine.tensor_parallel_size} ranks is launched by "
                         f"worker/tp_worker.py launch_tp_worker, which builds rank 0's engine "
                         f"and every rank's KV transport")
    engine = build_engine(cfg.engine)
    # prefill role: ship the last hidden state (with MTP the decode worker drafts from it;
    # the MTP layer's KV of the prompt is written here and travels in the same blocks)
    engine.keep_hidden = cfg.role == "prefill"
    return engine


class WorkerRuntime:
    """transport: built here over the engine's cache (TP 1), or given: a tensor-parallel
    worker's GroupTransport over every rank's (worker/tp_worker.py), made with this
    runtime's faults and kv_metrics (make_metrics)."""

    def __init__(self, cfg: WorkerConfig, engine: LLMEngine | None = None,
                 transport: Callable[[WorkerRuntime], KVTransport] | None = None) -> None:
        self.cfg = cfg
        self.engine = engine or build_worker_engine(cfg)
        self.registry = CollectorRegistry()
        self.metrics = WorkerMetrics(self.registry, cfg.role, cfg.worker_id)
        self.kv_metrics = kv_metrics(self.registry).bind(cfg.role, cfg.worker_id)
        self.faults = FaultInjector(cfg.faults)
        self.transport: KVTransport = transport(self) if transport is not None else \
            make_transport(cfg.kv_transport, self.engine.runner.kv_cache, cfg.worker_id,
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
        # Health waits this long for the loop to come round, then answers "busy" from the
        # last snapshot (a step is milliseconds on a GPU, seconds for a big chunk on a CPU);
        # within the router's health RPC deadline (router/pool.py rpc_timeout_s, 5 s)
        self.health_timeout_s = 2.0
        self._last_health = self._snapshot(self.engine)  # the loop has not started: safe

    def _snapshot(self, e: LLMEngine) -> pb.HealthResponse:
        """The worker's state (on the loop thread, or before the loop starts); kept as the
        last one, which a Health call answers from while the loop is inside a long step."""
        s, bm = e.scheduler, e.scheduler.block_manager
        self._last_health = pb.HealthResponse(
            status="draining" if self.draining else "ok", role=self.cfg.role,
            worker_id=self.cfg.worker_id, incarnation=self.incarnation,
            num_running=s.num_running, num_waiting=s.num_waiting,
            num_free_blocks=bm.num_free_blocks, num_total_blocks=bm.num_blocks,
            num_pinned_blocks=self.leases.pinned_blocks, kv_cache_usage=bm.usage,
            num_held_requests=len(s.held_request_ids()))
        return self._last_health

    def close(self) -> None:
        """Stop the loop thread and the transport (the server is stopped before this)."""
        self.loop.stop()
        self.transport.close()

    def _tick(self, engine: LLMEngine) -> None:
        """Loop-thread housekeeping: expire leases, refresh gauges (and the test switch
        faults.stall_loop_s: the loop stops once, with requests in it, as a hung device
        would stop it)."""
        if engine.has_unfinished() and (stall := self.faults.take_loop_stall()):
            log.warning("faults.stall_loop_s: the engine loop stops for %g s", stall)
            time.sleep(stall)
        for lease in self.leases.expire():  # counts kv_lease_expired itself
            engine.release_held(lease.request_id)
        self.metrics.refresh(engine)

    def abort_local(self, request_id: str, wait_s: float = 2.0) -> bool:
        """Abort the request in the engine (running, waiting or held); an open stream for it
        ends then, not at its deadline. True when the engine knew it; False too when the
        loop did not come round within wait_s (inside a long step): the abort stays queued
        and runs when it does, and the RPC thread is not held meanwhile."""
        def run(e: LLMEngine) -> bool:
            found = e.abort_request(request_id)
            if found:
                self.loop.publish(request_id, RequestOutput(request_id, [], "", True, "abort"))
            return found
        try:
            return self.loop.call(run, timeout_s=wait_s)
        except TimeoutError:
            log.info("abort of %s queued behind a long engine step", request_id)
            return False

    # -- RPCs every role answers ---------------------------------------------------------
    def peer_info(self) -> pb.PeerInfo:
        info = self.transport.peer_info()
        return pb.PeerInfo(worker_id=info.worker_id, incarnation=info.incarnation,
                           role=self.cfg.role, grpc_address=self.address,
                           compat_hash=info.compat_hash, transport_info=info.to_bytes())

    def health(self) -> pb.HealthResponse:
        """The loop's snapshot, or, when the loop does not come round within
        health_timeout_s (one long step, or stuck): the last one, status "busy" ("draining"
        while draining) and loop_busy_s, how long the loop has been away."""
        if self.loop.fatal is not None:
            raise EngineLoopError("engine loop died") from self.loop.fatal
        fut = self.loop.submit(self._snapshot)
        try:
            return fut.result(timeout=self.health_timeout_s)
        except TimeoutError:
            fut.cancel()  # not run later: polls do not pile up behind a stuck step
            busy = pb.HealthResponse()
            busy.CopyFrom(self._last_health)
            busy.status = "draining" if self.draining else "busy"
            busy.loop_busy_s = self.loop.busy_s()
            return busy

    def kv_digests(self, block_ids: list[int], num_tokens: int) -> list[str]:
        """sha256 of each block's first tokens (all layers, K and V): tests compare P and D."""
        def digest(e: LLMEngine) -> list[str]:
            return block_digests(e.runner.kv_cache, e.config.model.num_kv_layers, block_ids,
                                 num_tokens, e.config.cache.block_size)
        return self.loop.call(digest, timeout_s=30)

    def kv_head_digests(self, block_ids: list[int], num_tokens: int,
                        first_head: int = 0) -> dict[int, list[str]]:
        """Per KV head of this rank's cache (global index = first_head + local): the sha256
        of each block's first tokens of that head (all layers, K and V, and its FP8 scales).
        A TP worker's ranks each answer for their heads; tests compare them with the prefill
        ranks' heads."""
        def digest(e: LLMEngine) -> dict[int, list[str]]:
            return head_digests(e.runner.kv_cache, e.config.model.num_kv_layers, first_head,
                                block_ids, num_tokens, e.config.cache.block_size)
        return self.loop.call(digest, timeout_s=30)


def _head_bytes(kv: torch.Tensor, layers: int, block: int, n: int, heads: slice) -> bytes:
    """The bytes of tokens [:n] of `heads` in one block, layer by layer (K, V, then the FP8
    scales), through the cache's logical views: the same bytes whatever the physical layout
    (heads inside or outside the block's layers)."""
    parts = []
    for layer in range(layers):
        view = layer_views(kv, layer)  # k, v [NB, BS, Hkv, D]; scales [NB, Hkv]
        parts += [view.k[block, :n, heads], view.v[block, :n, heads]]
        if view.scales is not None:
            parts += [view.scales.k[block, heads], view.scales.v[block, heads]]
    return b"".join(p.contiguous().cpu().view(torch.uint8).numpy().tobytes() for p in parts)


def block_digests(kv: torch.Tensor, layers: int, block_ids: list[int], num_tokens: int,
                  block_size: int) -> list[str]:
    """sha256 per block of its first tokens, every head (see _head_bytes)."""
    out = []
    for i, b in enumerate(block_ids):
        n = min(block_size, num_tokens - i * block_size)
        out.append(hashlib.sha256(_head_bytes(kv, layers, b, n, slice(None))).hexdigest())
    return out


def head_digests(kv: torch.Tensor, layers: int, first_head: int, block_ids: list[int],
                 num_tokens: int, block_size: int) -> dict[int, list[str]]:
    """{global KV head: sha256 per block of that head's first tokens} for the heads of this
    cache (layer_views' head dim), numbered from first_head."""
    heads = layer_views(kv, 0).k.shape[2]
    out: dict[int, list[str]] = {}
    for h in range(heads):
        out[first_head + h] = []
        for i, b in enumerate(block_ids):
            n = min(block_size, num_tokens - i * block_size)
            raw = _head_bytes(kv, layers, b, n, slice(h, h + 1))
            out[first_head + h].append(hashlib.sha256(raw).hexdigest())
    return out


def peer_from_proto(msg: pb.PeerInfo) -> PeerInfo:
    info = PeerInfo.from_bytes(msg.transport_info)  # strict: names the bad field
    if (info.worker_id, info.incarnation) != (msg.worker_id, msg.incarnation):
        raise HandshakeError("peer_info.worker_id/incarnation: envelope and transport info differ")
    return info

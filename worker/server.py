"""Worker: one worker process assembled -- the shared runtime, both role services, the gRPC
server (WorkerServicer) and the metrics endpoint.

The role decides which calls make sense: prefill (Prefill, Release), decode (Decode with a
remote KV pull), colocated (Decode without a prefill); all roles answer Abort, Health,
GetPeerInfo and AddPeer. Ray actors (worker/actor.py) construct one; tests may construct it
in-process, with the in-process KV transport where NIXL is not the point.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import grpc

from pdserve.decode_worker.service import DecodeService
from pdserve.engine.engine_loop import EngineLoopError
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kv_transfer.transport import KVTransport
from pdserve.prefill_worker.service import PrefillService
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pbg
from pdserve.proto.rpc import cluster_interceptor, make_server
from pdserve.worker.config import WorkerConfig
from pdserve.worker.metrics import serve_metrics
from pdserve.worker.runtime import WorkerRuntime

log = logging.getLogger(__name__)


class Worker:
    def __init__(self, cfg: WorkerConfig, engine: LLMEngine | None = None,
                 transport: Callable[[WorkerRuntime], KVTransport] | None = None) -> None:
        """engine and transport: given by a tensor-parallel worker's rank 0 (its engine
        leads the other ranks; its GroupTransport spans them, worker/tp_worker.py)."""
        self.rt = WorkerRuntime(cfg, engine, transport)
        self.prefill = PrefillService(self.rt)
        self.decode = DecodeService(self.rt)
        self.server: grpc.Server | None = None
        self.metrics_address = ""
        self._metrics_httpd = None

    @property
    def cfg(self) -> WorkerConfig:
        return self.rt.cfg

    @property
    def engine(self) -> LLMEngine:
        return self.rt.engine

    @property
    def address(self) -> str:
        return self.rt.address

    @property
    def incarnation(self) -> str:
        return self.rt.incarnation

    def start(self) -> Worker:
        cfg = self.rt.cfg
        self.rt.loop.start()
        # one thread per open Prefill/Decode stream, plus room for Health/Release/Abort
        # every RPC, Health included, needs the cluster secret: only the router and peers call
        self.server, port = make_server(cfg.host, cfg.grpc_port,
                                        max_workers=max(64, cfg.engine.max_num_seqs + 16),
                                        auth=cluster_interceptor(cfg.cluster_secret))
        pbg.add_WorkerServicer_to_server(WorkerServicer(self), self.server)
        self.server.start()
        self.rt.address = f"{cfg.host}:{port}"
        if cfg.metrics_port >= 0:
            self._metrics_httpd = serve_metrics(self.rt.registry, cfg.host, cfg.metrics_port)
            self.metrics_address = f"{cfg.host}:{self._metrics_httpd.server_port}"
        log.info("worker %s (%s) gRPC %s metrics %s", cfg.worker_id, cfg.role,
                 self.address, self.metrics_address)
        return self

    def stop(self, grace_s: float = 2.0) -> None:
        if self.server is not None:
            self.server.stop(grace_s).wait(grace_s + 1)
        if self._metrics_httpd is not None:
            self._metrics_httpd.shutdown()
        self.decode.close()
        self.rt.close()

    def abort(self, request_id: str) -> bool:
        """Abort a running request and/or free its held blocks, whatever state it is in."""
        if self.decode.defer_abort(request_id):
            return True
        found = self.rt.abort_local(request_id)
        released = self.prefill.release(request_id, 0)[0]
        return found or released


class WorkerServicer(pbg.WorkerServicer):
    """Thin gRPC adapter: every method delegates to the worker's role services."""

    def __init__(self, worker: Worker) -> None:
        self.w = worker

    def Prefill(self, request, context):
        return self.w.prefill.prefill(request, context)

    def Decode(self, request, context):
        yield from self.w.decode.decode(request, context)

    def Release(self, request, context):
        released, valid = self.w.prefill.release(request.request_id, request.lease_generation)
        return pb.ReleaseReply(released=released, lease_was_valid=valid)

    def Abort(self, request, context):
        return pb.AbortReply(found=self.w.abort(request.request_id))

    def GetPeerInfo(self, request, context):
        return self.w.rt.peer_info()

    def AddPeer(self, request, context):
        return self.w.decode.add_peer(request)

    def Health(self, request, context):
        try:  # a loop inside one step answers "busy" and for how long (runtime.health)
            return self.w.rt.health()
        except EngineLoopError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"engine loop died: {e.__cause__!r}")

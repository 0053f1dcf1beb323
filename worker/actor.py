"""Ray actor that hosts one Worker (prefill, decode or colocated).

Ray owns placement (num_gpus=1 on GPU hosts, CPU actors otherwise); restarts are the
router's (router/worker_refs.py RayWorkerRef relaunches a dead worker with backoff). Only
control-plane calls go through Ray (endpoints, ping); requests and KV move over gRPC and
NIXL. A relaunched actor builds a new runtime: new incarnation, new ports, so the router
re-reads endpoints() and re-introduces peers.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import ray
from google.protobuf.json_format import MessageToDict

from pdserve.engine.exec.heap import freeze_startup_heap
from pdserve.kernels.triton_mode import select_triton_mode
from pdserve.kv_transfer.ucx_binding import bind_ucx
from pdserve.worker.config import WorkerConfig

if TYPE_CHECKING:
    from pdserve.worker.runtime import WorkerRuntime

DIE_DELAY_S = 0.2  # lets open streams send the loop's error before the process ends


@dataclass(frozen=True)
class Endpoints:
    worker_id: str
    role: str
    incarnation: str
    grpc_address: str
    metrics_address: str
    node_ip: str


def watch_engine_loop(rt: WorkerRuntime, on_death: Callable[[BaseException], None],
                      stopping: Callable[[], bool]) -> None:
    """Block until rt's engine loop dies (Health answers UNAVAILABLE from then on); give open
    streams DIE_DELAY_S to send the loop's error, then call on_death(the loop's error),
    unless the worker is being shut down (a step failing as the transport closes)."""
    rt.loop.died.wait()
    time.sleep(DIE_DELAY_S)
    if not stopping():
        on_death(rt.loop.fatal or RuntimeError("engine loop died"))


def _end_process(why: BaseException) -> None:
    from pdserve.engine.dist.watchdog import end_process  # imports torch: in the worker only
    end_process(f"the engine loop died ({why!r}): ending this worker process; the router "
                "launches a new one")


class WorkerActor:
    def __init__(self, cfg: WorkerConfig) -> None:
        # the actor process is an entry point: compiled or interpreted Triton is chosen here,
        # before the engine imports triton
        select_triton_mode()
        cfg = cfg.on_node()
        # UCX (under NIXL) listens only on the interface of the worker's host: set before
        # the transport creates its NIXL agent
        bind_ucx(cfg.host)
        from pdserve.worker.server import Worker  # after the Triton mode is set

        logging.basicConfig(level=cfg.log_level.upper())
        self.w = Worker(cfg).start()
        self.frozen_objects = freeze_startup_heap()  # serving: full GC pauses out of decode
        self._stopping = False
        # a dead engine loop must not leave a live process that answers Ray's ping (the
        # router would keep routing to it): end the process, and the router relaunches it
        threading.Thread(target=watch_engine_loop,
                         args=(self.w.rt, _end_process, lambda: self._stopping),
                         name="engine-watch", daemon=True).start()

    def endpoints(self) -> dict:
        w = self.w
        return asdict(Endpoints(w.cfg.worker_id, w.cfg.role, w.incarnation, w.address,
                                w.metrics_address, ray.util.get_node_ip_address()))

    def ping(self) -> str:
        return self.w.incarnation

    def health(self) -> dict:
        return MessageToDict(self.w.rt.health(), preserving_proto_field_name=True,
                             always_print_fields_with_no_presence=True)

    def gc_frozen_objects(self) -> int:
        """Objects the start-up freeze took out of the garbage collector's scans."""
        return self.frozen_objects

    def kv_digests(self, block_ids: list[int], num_tokens: int) -> list[str]:
        return self.w.rt.kv_digests(block_ids, num_tokens)

    def kv_head_digests(self, block_ids: list[int], num_tokens: int) -> dict[int, list[str]]:
        """{KV head: sha256 per block} of this rank's heads (a TP worker's followers answer
        for theirs: follower_handles)."""
        return self.w.rt.kv_head_digests(block_ids, num_tokens)

    def follower_handles(self) -> list:
        """The actors of ranks 1..N-1 (none: a one-rank worker)."""
        return []

    def recent_pulls(self) -> list[tuple[str, list[int], list[int], int]]:
        return list(self.w.decode.recent_pulls)

    def drain(self) -> None:
        self.w.rt.draining = True

    def shutdown(self) -> None:
        self._stopping = True
        self.w.stop()


def launch_worker(cfg: WorkerConfig, num_gpus: float = 0, num_cpus: float = 1,
                  max_restarts: int = 0, generation: int = 0,
                  node_labels: dict[str, str] | None = None) -> ray.actor.ActorHandle:
    """Start a named worker actor: worker_id, then worker_id.rN for the pool's Nth relaunch
    (Ray keeps a dead actor's name for a while). node_labels: only on a Ray node that has
    these labels (a pool's own node group; Ray waits until one has room)."""
    actor_cls = ray.remote(WorkerActor)
    name = cfg.worker_id if generation == 0 else f"{cfg.worker_id}.r{generation}"
    placed = {"label_selector": dict(node_labels)} if node_labels else {}
    return actor_cls.options(name=name, num_gpus=num_gpus, num_cpus=num_cpus,
                             max_restarts=max_restarts, max_task_retries=0,
                             max_concurrency=4, **placed).remote(cfg)

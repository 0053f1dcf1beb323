"""A serving tensor-parallel worker: N rank actors in one STRICT_PACK placement group.

    actor = launch_tp_worker(cfg, generation=0)   # rank 0's actor, returned at once
    ray.get(actor.endpoints.remote())              # like any worker (worker/actor.py)

Rank 0 (TPWorkerActor) is the worker the router sees: gRPC, scheduler, an LLMEngine whose
runner leads the other ranks' forwards (engine/dist/lockstep.py), and a GroupTransport
(worker/tp_transport.py) that runs every KV call on every rank. Ranks > 0 (RankActor in
worker/tp_group.py, serve_follower) each run a Follower loop over their shard and KV cache,
and a KV thread (worker/tp_kv.py KVRankServer) over their own transport.

Start-up (rank 0's constructor, so launch returns at once and the router's RayWorkerRef waits
on endpoints() as for a one-rank worker): rank 0 hosts the group's TCP store, starts the
followers, loads its shard and joins the group; every rank joins the KV channel; each
follower publishes its RankEndpoint in the store and rank 0 gathers them into the group's
PeerInfo (group_peer_info). Every wait is bounded by cfg.tp_timeout_s.

Failure: a rank that dies or hangs fails its whole worker. Rank 0's next step, keep-alive or
KV call to it fails (gloo raises at once on a closed socket, and at the deadline otherwise),
or its GPU makes no progress for the deadline (a CUDA graph's collective that the rank never
joins: engine/dist/watchdog.py); its monitor thread sees that (the engine loop's fatal
error, the Leader's keep-alive error, the GroupTransport's `broken`, the GPU watchdog's
stall), lets the open streams send their error, and ends the process.
A follower whose rank 0 is gone hears nothing on its channels and ends too. Open streams end
with an error the router retries or continues on another worker; the prefill side's leases
free their blocks at expiry (or on the router's Abort). The router's RayWorkerRef relaunches
the worker as generation n + 1: launch_tp_worker first removes generation n's placement
group, which kills whatever rank is left, so the new group starts clean (new store, new
incarnation, peers introduced again).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pdserve.engine.exec.heap import freeze_startup_heap
from pdserve.engine.exec.warmup import warm_up
from pdserve.worker.actor import DIE_DELAY_S, WorkerActor
from pdserve.worker.config import WorkerConfig
from pdserve.worker.rank_gpu import rank_actor_options, rank_device
from pdserve.worker.tp_follower import ENDPOINT_KEY, die, rank_transport
from pdserve.worker.tp_group import RankActor, group_name, remove_previous

log = logging.getLogger(__name__)

FOLLOWER_START_TIMEOUT_S = 300.0  # Ray starting the follower ranks' processes


class TPWorkerActor(WorkerActor):
    """Rank 0 of a TP worker: the Worker (gRPC, scheduler, engine with a Leader) plus the
    followers' start-up, the group's KV transport and the failure monitor."""

    def __init__(self, cfg: WorkerConfig, followers: list, pg_name: str) -> None:
        from pdserve.kernels.triton_mode import select_triton_mode
        from pdserve.kv_transfer.ucx_binding import bind_ucx

        select_triton_mode()
        self.device = rank_device(cfg.engine.device or "cpu")  # first: its GPU made current
        cfg = cfg.on_node()
        bind_ucx(cfg.host)
        logging.basicConfig(level=cfg.log_level.upper())
        self.cfg, self.followers, self.pg_name = cfg, followers, pg_name
        self._stopping = False
        try:
            self.w = self._start(cfg)
        except BaseException:
            for f in followers:  # none of them can join a group without rank 0
                ray.kill(f, no_restart=True)
            raise
        self.frozen_objects = freeze_startup_heap()  # serving: full GC pauses out of decode
        threading.Thread(target=self._monitor, name="tp-monitor", daemon=True).start()

    def _start(self, cfg: WorkerConfig):
        from pdserve.engine.dist.config import ParallelConfig
        from pdserve.engine.dist.group import TPGroup, open_store
        from pdserve.engine.dist.lockstep import Leader
        from pdserve.engine.llm import load_rank
        from pdserve.engine.llm_engine import LLMEngine
        from pdserve.worker.server import Worker
        from pdserve.worker.tp_kv import KVChannel, KVLeader

        tp, timeout = cfg.engine.tensor_parallel_size, cfg.tp_timeout_s
        host = ray.util.get_node_ip_address()
        pcfg = ParallelConfig.for_device(tp, 0, f"tcp://{host}:0", self.device, timeout)
        store = open_store(pcfg)
        # with graphs every rank joins the peer all-reduce (the followers decide from the
        # same cfg.engine: worker/tp_group.py serve_follower); each rank sees its peers'
        # GPUs (worker/rank_gpu.py)
        pcfg = dataclasses.replace(pcfg, init_address=f"tcp://{host}:{store.port}"
                                   ).with_graphs(cfg.engine.use_cuda_graphs)
        # the followers' processes are up first: the join deadline (tp_timeout_s) is for
        # joining, not for Ray starting a process (CUDA init on a GPU node takes seconds)
        ray.get([f.ping.remote() for f in self.followers], timeout=FOLLOWER_START_TIMEOUT_S)
        started = [f.serve_follower.remote(cfg, pcfg.init_address) for f in self.followers]
        # a GPU stall (a collective inside a graph that a peer never joins) ends the worker
        # through _monitor, as any other group failure does
        parts = load_rank(cfg.engine, join=lambda: TPGroup(pcfg, store,
                                                           on_gpu_stall=lambda why: None))
        self.group = parts.group
        self.leader = Leader(self.group)
        self.leader.start_keepalive()
        # with speculative, rank 0's shard of the MTP head: it leads the drafting passes
        # that the followers run over theirs (engine/llm.py RankParts.follower)
        engine = LLMEngine(parts.config, parts.net, parts.tokenizer, spec=parts.spec,
                           mtp_head=parts.head, mtp_head_id=parts.head_id, leader=self.leader)
        # as build_worker_engine does: a prefill worker ships the last hidden state (with
        # MTP the decode worker drafts from it; the MTP layer's KV travels in the blocks)
        engine.keep_hidden = cfg.role == "prefill"
        # the KV channel before the warm-up: each follower joins it right after its graph
        # captures and only then follows steps (worker/tp_follower.py FollowerRank.start), so
        # a warm-up forward sent first would wait in its all-reduce for a rank that waits here
        kv = KVLeader(KVChannel(self.group))
        if cfg.engine.warmup:  # every rank compiles now, not in a served step
            warm_up(engine)
        self.group.start_watchdog()  # graphs captured: a deadline on the GPU
        endpoints = self._gather_endpoints(store, tp, timeout)
        ray.get(started, timeout=timeout)  # a follower that failed to start says why here
        self.transport = None

        def transport(rt):
            from prometheus_client import CollectorRegistry

            from pdserve.kv_transfer.metrics import kv_metrics
            from pdserve.worker.tp_transport import GroupTransport

            # the worker's KV metrics count each group read once (GroupTransport)
            own = kv_metrics(CollectorRegistry()).bind(cfg.role, cfg.worker_id)
            local = rank_transport(cfg, parts.config, engine.runner.kv_cache, 0,
                                   engine.compat_extra(), faults=rt.faults, metrics=own)
            self.transport = GroupTransport(local, kv, [local.rank_endpoint()] + endpoints,
                                            metrics=rt.kv_metrics)
            return self.transport
        return Worker(cfg, engine, transport=transport).start()

    @staticmethod
    def _gather_endpoints(store, tp: int, timeout_s: float) -> list:
        import datetime

        from pdserve.engine.dist.group import GroupError
        from pdserve.kv_transfer.handshake import RankEndpoint

        keys = [ENDPOINT_KEY.format(rank=r) for r in range(1, tp)]
        try:
            store.wait(keys, datetime.timedelta(seconds=timeout_s))
        except RuntimeError as e:
            raise GroupError(f"tensor_parallel_size: the follower ranks did not publish their "
                             f"KV endpoints within {timeout_s} s: {e}") from e
        return [RankEndpoint.from_bytes(bytes(store.get(k))) for k in keys]

    def _monitor(self) -> None:
        """End the worker once its group cannot go on (see the module docstring)."""
        while not self._stopping:
            t = self.transport
            wd = self.group.watchdog
            why = (self.w.rt.loop.fatal or self.leader.error or (wd.stalled if wd else None)
                   or (t.broken or t.kv.leader.error if t is not None else None))
            if why is not None and not self._stopping:
                self.w.rt.draining = True  # Health says so at once
                time.sleep(DIE_DELAY_S)  # the streams got the loop's error; let them send it
                die(f"worker {self.cfg.worker_id} rank 0", why)
            time.sleep(0.05)

    def kv_head_digests(self, block_ids: list[int], num_tokens: int) -> dict[int, list[str]]:
        """Rank 0's KV heads (tests; each follower answers for its own, RankActor)."""
        first = self.transport.local.peer_info().tp_info.head_map[0][0]
        return self.w.rt.kv_head_digests(block_ids, num_tokens, first)

    def peer_all_reduce(self) -> bool:
        """Whether the group joined the peer all-reduce (engine/dist/peer_all_reduce.py:
        every rank or none) for its graphs' collectives (tests, benchmarks)."""
        return self.group.peer is not None

    def graph_replays(self) -> int:
        """Rank 0's decode steps replayed from its CUDA graphs (tests)."""
        graphs = self.w.rt.engine.runner.cuda_graphs
        return graphs.replays if graphs is not None else 0

    def follower_handles(self) -> list:
        return list(self.followers)  # RankActor handles, rank order

    def shutdown(self) -> None:
        """Stop serving, STOP the followers and end their actors, then (once this call has
        returned) remove the group's placement group. The placement group belongs to the
        job that launched it, so it goes with that job at the latest."""
        self._stopping = True
        self.w.stop()
        try:
            self.leader.stop()
        except Exception:  # noqa: BLE001 - a follower already gone: it ends anyway
            pass
        for f in self.followers:
            ray.kill(f, no_restart=True)
        pg = ray.util.get_current_placement_group()
        if pg is not None:
            threading.Timer(DIE_DELAY_S, remove_placement_group, (pg,)).start()


def launch_tp_worker(cfg: WorkerConfig, generation: int = 0, num_gpus: float = 0,
                     num_cpus: float = 1,
                     node_labels: dict[str, str] | None = None) -> ray.actor.ActorHandle:
    """Rank 0's actor of generation `generation` of the TP worker `cfg` (returned at once:
    its constructor starts and joins the group). An earlier generation's placement group is
    removed first, which kills every rank still in it. node_labels: every rank's bundle
    only on a node with these labels (launch_worker)."""
    from pdserve.engine.dist.rank import check_tp_args

    check_tp_args(cfg.engine)  # what a TP worker does not run yet, refused by field
    tp = cfg.engine.tensor_parallel_size
    remove_previous(cfg.worker_id, generation)
    bundle = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {})}
    name = group_name(cfg.worker_id, generation)
    selector = {"bundle_label_selector": [dict(node_labels)] * tp} if node_labels else {}
    pg = placement_group([dict(bundle) for _ in range(tp)], strategy="STRICT_PACK", name=name,
                         **selector)

    def place(r: int) -> dict:
        return dict(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0, max_task_retries=0,
                    **rank_actor_options(num_gpus),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        pg, placement_group_bundle_index=r))
    followers = [ray.remote(RankActor).options(name=f"{name}.rank{r}", max_concurrency=4,
                                               **place(r)).remote(
        cfg.worker_id, r, tp, cfg.tp_timeout_s, cfg.engine.device or "cpu")
        for r in range(1, tp)]
    actor_name = cfg.worker_id if generation == 0 else f"{cfg.worker_id}.r{generation}"
    return ray.remote(TPWorkerActor).options(name=actor_name, max_concurrency=4,
                                             **place(0)).remote(cfg, followers, name)

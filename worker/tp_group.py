"""A tensor-parallel worker: N rank actors in one Ray placement group, packed on one node.

    group = launch_tp_group("decode-0", tp=2, generation=0, num_gpus=1)
    group.call(None, "load_engine", engine_args)  # every rank: its shard; rank 0 the engine
    group.alive()                      # False once any rank died: relaunch the whole group

Placement: one bundle per rank, STRICT_PACK (all on one node: NCCL over NVLink, and a rank
lost means the node or the process, never a network split inside the worker). Rank 0 hosts
the group's TCP store and is the one the router talks to (a serving worker's rank 0 runs the
gRPC server and the scheduler: worker/tp_worker.py); ranks > 0 run the lockstep Follower.

Failure: rank actors run with max_restarts=0. One rank cannot rejoin a running group (its
peers' communicators are gone with it), so a dead rank fails the whole group: its peers'
next collective or keep-alive raises GroupError (engine/dist/group.py deadlines), and a rank
that hits one ends its process. The owner (router/worker_refs.py RayWorkerRef, which
relaunches a dead worker with backoff) sees rank 0 die, and launch_tp_group for the
next generation first removes the previous generation's placement group, which kills any
rank still alive, then starts a fresh group: new store, new incarnation, peers re-introduced.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pdserve.engine.exec.device_io import bind_thread
from pdserve.kernels.triton_mode import select_triton_mode
from pdserve.worker.rank_gpu import rank_actor_options, rank_device

log = logging.getLogger(__name__)


def group_name(worker_id: str, generation: int) -> str:
    return f"{worker_id}.tp.g{generation}"


def on_rank_device(method: Callable) -> Callable:
    """A RankActor call that runs the model, run with the rank's GPU current: Ray runs each
    call on a thread of its pool, and CUDA keeps the current device per thread (Triton
    launches on it; a rank sees every GPU of its node, worker/rank_gpu.py)."""
    @functools.wraps(method)
    def call(self: RankActor, *args: object, **kwargs: object) -> object:
        bind_thread(self.device)
        return method(self, *args, **kwargs)
    return call


class RankActor:
    """One rank of a TP worker (the Ray actor's body)."""

    def __init__(self, worker_id: str, rank: int, tp: int, timeout_s: float, device: str) -> None:
        select_triton_mode()  # an entry point, as worker/actor.py's WorkerActor
        self.worker_id, self.rank, self.tp = worker_id, rank, tp
        self.timeout_s, self.device = timeout_s, rank_device(device)
        self.store = None
        self.group = None
        self.leader = None
        self._model = None  # load: LeaderModel | Follower; load_engine: LLMEngine | Follower
        self._lock = threading.Lock()  # the leader's control channel: one sender at a time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None  # the keep-alive (rank 0) or follow loop

    def _cfg(self, address: str):
        from pdserve.engine.dist.config import ParallelConfig

        return ParallelConfig.for_device(self.tp, self.rank, address, self.device, self.timeout_s)

    def open_store(self) -> str:
        """Rank 0: host the group's store on a free port of this node -> its tcp:// address."""
        from pdserve.engine.dist.group import open_store

        host = ray.util.get_node_ip_address()
        self.store = open_store(self._cfg(f"tcp://{host}:0"))
        return f"tcp://{host}:{self.store.port}"

    def join(self, address: str) -> int:
        """Join the group (every rank at once; at most timeout_s)."""
        from pdserve.engine.dist.group import TPGroup

        self.group = TPGroup(self._cfg(address), self.store)
        return self.group.rank

    @on_rank_device
    def load(self, cfg: object, seed: int = 0) -> dict:
        """The rank's shard of a seeded random model `cfg` (ModelConfig), then rank 0 leads
        (keep-alives on a thread) and the others follow on a thread: the group's mechanics
        without an engine (tests/dist/test_tp_group_ray.py); load_engine serves."""
        import torch

        from pdserve.engine.dist.lockstep import Follower, Leader, LeaderModel
        from pdserve.engine.dist.parallel import TPContext
        from pdserve.engine.dist.shard import shard_model
        from pdserve.engine.exec.kv_cache import allocate_kv_cache
        from pdserve.engine.model.weights import random_model

        ctx = TPContext(self.group, cfg.vocab_size)
        local = shard_model(random_model(cfg, seed=seed, std=0.1), self.tp, self.rank, ctx=ctx)
        kv = allocate_kv_cache(local.config, 64, 4, torch.float32, "cpu")
        if self.rank == 0:
            self.leader = Leader(self.group)
            self._model = LeaderModel(self.leader, local, kv)
            target = self._keep_alive
        else:
            self._model = Follower(self.group, local, kv)
            target = self._follow
        self._start(target)
        return {"rank": self.rank, "num_heads": local.config.num_heads,
                "num_kv_heads": local.config.num_kv_heads}

    @on_rank_device
    def load_engine(self, args: object) -> dict:
        """Every rank loads the checkpoint of `args` (EngineArgs) and keeps its
        shard (engine/llm.py load_rank); rank 0 builds the engine (scheduler, sampler) with
        a Leader, the others follow on a thread until STOP or a GroupError."""
        from pdserve.engine.dist.lockstep import Leader
        from pdserve.engine.llm import load_rank
        from pdserve.engine.llm_engine import LLMEngine

        parts = load_rank(args, join=lambda: self.group)
        if self.rank == 0:  # with speculative, every rank drafts over its MTP head shard
            self.leader = Leader(self.group)
            self._model = LLMEngine(parts.config, parts.net, parts.tokenizer, spec=parts.spec,
                                    mtp_head=parts.head, mtp_head_id=parts.head_id,
                                    leader=self.leader)
            target = self._keep_alive
        else:
            self._model = parts.follower()
            target = self._follow
        self._start(target)
        return {"rank": self.rank, "num_heads": parts.net.config.num_heads,
                "num_kv_heads": parts.net.config.num_kv_heads}

    @on_rank_device
    def serve_follower(self, cfg: object, address: str) -> int:
        """A serving TP worker's follower (worker/tp_worker.py starts it): load, join the
        group at `address` (rank 0's store), run the lockstep loop and the KV thread over
        this rank's own transport (worker/tp_follower.py). Returns once both run."""
        from pdserve.kv_transfer.ucx_binding import bind_ucx
        from pdserve.worker.tp_follower import FollowerRank

        cfg = cfg.on_node()
        bind_ucx(cfg.host)  # before the transport creates its NIXL agent
        logging.basicConfig(level=cfg.log_level.upper())
        # graphs: the peer all-reduce, as rank 0 decides from the same cfg (tp_worker.py)
        self._model = FollowerRank.start(cfg, self._cfg(address).with_graphs(
            cfg.engine.use_cuda_graphs))
        return self.rank

    def kv_head_digests(self, block_ids: list[int], num_tokens: int) -> dict[int, list[str]]:
        """A serving follower's KV heads (tests compare them with the prefill ranks')."""
        return self._model.kv_head_digests(block_ids, num_tokens)

    def graph_replays(self) -> int:
        """A serving follower's decode steps replayed from its CUDA graphs (tests)."""
        graphs = self._model.follower.graphs
        return graphs.replays if graphs is not None else 0

    def pid(self) -> int:
        """This rank's process (tests stop it to stall the group)."""
        return os.getpid()

    @on_rank_device
    def generate_ids(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Rank 0 with load_engine: greedy completions of token-id prompts through the engine
        (tests; serving goes through the Worker's gRPC, docs/tensor_parallel.md)."""
        from pdserve.engine.core.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        engine = self._model
        rids = [engine.add_request(p, params)[0] for p in prompts]
        out: dict[str, list[int]] = {rid: [] for rid in rids}
        from pdserve.engine.dist.group import GroupError

        try:
            with self._lock:
                for o in engine.generate_until_done(deadline_s=self.timeout_s * 10):
                    out[o.request_id] += o.new_token_ids
        except GroupError as e:  # a follower died: this rank cannot go on either
            self._die(e)
        return [out[rid] for rid in rids]

    def _start(self, target) -> None:
        self._thread = threading.Thread(target=target, name=f"tp-rank{self.rank}", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        try:
            self._model.run()
        except Exception as e:  # noqa: BLE001 - any failure ends the rank, hence the group
            self._die(e)

    def _keep_alive(self) -> None:
        while not self._stop.wait(self.leader.keepalive_s / 2):
            try:
                self.leader.tick()  # the Leader serializes its sends
            except Exception as e:  # noqa: BLE001
                self._die(e)

    def _die(self, e: BaseException) -> None:
        """A rank that cannot go on in lockstep ends its process: Ray marks the actor dead,
        its peers fail at their next collective, and the owner relaunches the group."""
        log.error("worker %s rank %d leaves its group: %s", self.worker_id, self.rank, e)
        os._exit(1)

    @on_rank_device
    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        """Rank 0 after load: greedy decoding of `prompts` in lockstep (tests; a serving
        worker decodes through its engine instead)."""
        from pdserve.engine.dist.steps import greedy_batch

        with self._lock:
            return greedy_batch(self._model.step, prompts, new_tokens, block_size=4,
                                blocks_per_seq=64 // max(1, len(prompts)))

    def ping(self) -> int:
        return self.rank

    def stop(self) -> None:
        """Rank 0 broadcasts STOP; a follower waits (at most timeout_s) for its loop to take
        that STOP before closing its end of the group: closed first, rank 0's broadcast would
        meet a reset connection (the ranks are stopped concurrently)."""
        self._stop.set()
        if self.leader is not None:
            with self._lock:
                self.leader.stop()
        elif self._thread is not None:
            self._thread.join(timeout=self.timeout_s)
        if self.group is not None:
            self.group.close()


class TPGroupHandle:
    """The rank actors of one generation of a TP worker and their placement group."""

    def __init__(self, worker_id: str, generation: int, pg: PlacementGroup, ranks: list) -> None:
        self.worker_id, self.generation, self.pg, self.ranks = worker_id, generation, pg, ranks

    @property
    def leader(self):
        """Rank 0's actor: the one the router reaches (endpoints, gRPC)."""
        return self.ranks[0]

    def call(self, rank: int | None, method: str, *args: object, timeout_s: float = 120) -> object:
        """method(*args) on one rank, or on all (rank None: a list, in rank order)."""
        actors = self.ranks if rank is None else [self.ranks[rank]]
        refs = [getattr(a, method).remote(*args) for a in actors]
        out = ray.get(refs, timeout=timeout_s)
        return out if rank is None else out[0]

    def alive(self, timeout_s: float = 10) -> bool:
        """Whether every rank still answers (a dead one: the group must be relaunched)."""
        try:
            ray.get([a.ping.remote() for a in self.ranks], timeout=timeout_s)
            return True
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False

    def kill(self) -> None:
        """Remove the placement group: Ray kills every rank still in it."""
        remove_placement_group(self.pg)


def remove_previous(worker_id: str, generation: int) -> None:
    for g in range(generation):
        try:
            remove_placement_group(ray.util.get_placement_group(group_name(worker_id, g)))
        except ValueError:  # no such group (already removed)
            pass


def launch_tp_group(worker_id: str, tp: int, generation: int = 0, num_gpus: float = 0,
                    num_cpus: float = 1, timeout_s: float = 60.0,
                    device: str = "cpu", ready_timeout_s: float = 300.0) -> TPGroupHandle:
    """Place tp rank actors on one node (STRICT_PACK), start them and join their group;
    every wait has a deadline (ready_timeout_s for placement and start, timeout_s inside the
    group). An earlier generation of this worker is removed first."""
    remove_previous(worker_id, generation)
    bundle = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {})}
    pg = placement_group([dict(bundle) for _ in range(tp)], strategy="STRICT_PACK",
                         name=group_name(worker_id, generation))
    try:
        ray.get(pg.ready(), timeout=ready_timeout_s)
        cls = ray.remote(RankActor)
        ranks = [cls.options(
            name=f"{group_name(worker_id, generation)}.rank{r}", num_cpus=num_cpus,
            num_gpus=num_gpus, max_restarts=0, max_task_retries=0, max_concurrency=4,
            **rank_actor_options(num_gpus),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=r)).remote(worker_id, r, tp, timeout_s, device)
            for r in range(tp)]
        handle = TPGroupHandle(worker_id, generation, pg, ranks)
        address = ray.get(ranks[0].open_store.remote(), timeout=ready_timeout_s)
        deadline = time.monotonic() + ready_timeout_s
        # every rank's process up before any join starts its group deadline (timeout_s)
        ray.get([a.ping.remote() for a in ranks], timeout=ready_timeout_s)
        got = ray.get([a.join.remote(address) for a in ranks],
                      timeout=max(1.0, deadline - time.monotonic()))
        if got != list(range(tp)):
            raise RuntimeError(f"tensor_parallel_size: ranks joined as {got}")
        return handle
    except BaseException:
        remove_placement_group(pg)
        raise

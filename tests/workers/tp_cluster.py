"""Test helpers for tensor-parallel workers on the real local Ray instance: a tiny
transformers checkpoint, TP worker actors (worker/tp_worker.py) and their gRPC stubs, each
rank's KV head digests."""
from __future__ import annotations

import ray

from pdserve.proto import pdserve_pb2_grpc as pbg
from pdserve.proto.rpc import make_channel
from pdserve.worker.config import WorkerConfig
from pdserve.worker.tp_group import remove_previous
from pdserve.worker.tp_worker import launch_tp_worker

from tests.cluster_secret import SECRET
from tests.workers.cluster import Worker

# every worker of these tests: float32 on CPU, blocks of 4 tokens (prompts span several)
TEST_GENERATIONS = 4  # generations a test launches at most (stop removes their groups)
ENGINE = dict(device="cpu", dtype="float32", block_size=4, num_blocks=64, max_num_seqs=8)


def launch_tp(role: str, worker_id: str, model: str, tp: int, generation: int = 0,
              num_gpus: float = 0, **kw: object) -> tuple[ray.actor.ActorHandle, WorkerConfig]:
    """A worker of `tp` ranks (tp 1: the plain worker actor), launched: its actor(s) load the
    model while the caller goes on; connect() waits for it. num_gpus: per rank (Ray shows
    an actor only the GPUs it asked for)."""
    from pdserve.worker.actor import launch_worker

    cfg = WorkerConfig.of(role, worker_id, SECRET, metrics_port=0, model=model,
                          tensor_parallel_size=tp, **{**ENGINE, **kw})
    actor = launch_tp_worker(cfg, generation, num_gpus=num_gpus, num_cpus=0.1) if tp > 1 \
        else launch_worker(cfg, num_gpus=num_gpus, num_cpus=0)
    return actor, cfg


def connect(actor: ray.actor.ActorHandle, cfg: WorkerConfig, timeout_s: float = 300) -> Worker:
    """The launched worker once it answers: its gRPC stub."""
    ep = ray.get(actor.endpoints.remote(), timeout=timeout_s)
    ch = make_channel(ep["grpc_address"], cluster_secret=SECRET)
    return Worker(actor, cfg, ep["grpc_address"], pbg.WorkerStub(ch), ch)


def start_tp_worker(role: str, worker_id: str, model: str, tp: int, timeout_s: float = 300,
                    generation: int = 0, **kw: object) -> Worker:
    """A worker of `tp` ranks (tp 1: the plain worker actor), up and answering gRPC."""
    return connect(*launch_tp(role, worker_id, model, tp, generation, **kw), timeout_s)


def start_tp_workers(specs: list[tuple[str, str, int]], model: str, timeout_s: float = 300,
                     **kw: object) -> list[Worker]:
    """Workers (role, worker_id, tp), in `specs` order. The single-process TP-1 workers are
    launched first and load while the TP-2 workers start one at a time: a TP worker's rank 0
    waits at most tp_timeout_s for its followers to join, so no other TP worker's ranks load
    beside them. A failure kills every worker launched."""
    launched: dict[int, tuple[ray.actor.ActorHandle, WorkerConfig]] = {}
    workers: dict[int, Worker] = {}
    try:
        for i, (role, wid, tp) in enumerate(specs):
            if tp == 1:
                launched[i] = launch_tp(role, wid, model, tp, **kw)
        for i, (role, wid, tp) in enumerate(specs):
            if tp > 1:
                launched[i] = launch_tp(role, wid, model, tp, **kw)
                workers[i] = connect(*launched[i], timeout_s)
        for i, (actor, cfg) in launched.items():
            if i not in workers:
                workers[i] = connect(actor, cfg, timeout_s)
        return [workers[i] for i in range(len(specs))]
    except BaseException:
        for actor, _ in launched.values():
            ray.kill(actor, no_restart=True)
        raise


def head_digests(w: Worker, block_ids: list[int], num_tokens: int) -> dict[int, list[str]]:
    """{global KV head: sha256 per block} over every rank of `w` (rank 0 and, for a TP
    worker, each follower answering for its own heads)."""
    out: dict[int, list[str]] = {}
    ranks = [w.actor] + ray.get(w.actor.follower_handles.remote(), timeout=30)
    got = ray.get([a.kv_head_digests.remote(block_ids, num_tokens) for a in ranks], timeout=60)
    for d in got:
        for head, digests in d.items():
            # a replicated KV head lives on several ranks: every copy must agree
            assert out.setdefault(int(head), digests) == digests, f"KV head {head} copies differ"
    return out


def stop(*workers: Worker) -> None:
    """Stop each worker as the router does (router/worker_refs.py RayWorkerRef.shutdown): a
    TP worker's placement groups go too, or their reserved CPUs stay taken on the test
    process's small Ray instance (later files' groups then never placed)."""
    for w in workers:
        w.channel.close()
        try:
            ray.get(w.actor.shutdown.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - already dead: the kill below is what counts
            pass
        ray.kill(w.actor, no_restart=True)
        if w.cfg.engine.tensor_parallel_size > 1:
            remove_previous(w.cfg.worker_id, TEST_GENERATIONS)

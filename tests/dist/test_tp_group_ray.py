"""A TP worker's rank actors on a real local Ray instance (worker/tp_group.py): placed in
one STRICT_PACK placement group, joined in a gloo group, stepping in lockstep (greedy equals
the unsharded model); one rank killed fails the whole group (rank 0 notices at its next
keep-alive and ends), and the next generation of the group comes back and serves again."""
from __future__ import annotations

import time

import ray
import torch

from pdserve.engine.dist.steps import greedy_batch
from pdserve.engine.model.weights import random_model
from pdserve.worker.tp_group import launch_tp_group

from tests.dist import tp_ranks
from tests.workers.cluster import start_ray


def _reference(cfg, prompts: list[list[int]]) -> list[list[int]]:
    full = random_model(cfg, seed=0, std=0.1)
    kv = torch.zeros(64, cfg.num_layers, 2, 4, cfg.num_kv_heads, cfg.head_dim)

    @torch.inference_mode()
    def step(b, rows):
        ids, pos, meta = b.to_device(torch.device("cpu"))
        return full.compute_logits(full(ids, pos, meta, kv)[torch.tensor(rows)])
    return greedy_batch(step, prompts, 6, 4, 64 // len(prompts))


def _dead(actor) -> bool:
    try:
        ray.get(actor.ping.remote(), timeout=5)
        return False
    except ray.exceptions.RayActorError:
        return True
    except ray.exceptions.GetTimeoutError:
        return False


def test_rank_actors_step_together_and_a_dead_rank_restarts_the_group() -> None:
    start_ray()
    cfg = tp_ranks.tiny("qwen3", 4, 2)
    prompts = tp_ranks.prompts(cfg)
    want = _reference(cfg, prompts)
    group = launch_tp_group("tp-test", 2, 0, num_cpus=0.5, timeout_s=6)
    try:
        loaded = group.call(None, "load", cfg)
        assert [(x["num_heads"], x["num_kv_heads"]) for x in loaded] == [(2, 1), (2, 1)]
        assert group.call(0, "generate", prompts, 6) == want
        ray.kill(group.ranks[1], no_restart=True)
        deadline = time.monotonic() + 90
        while not _dead(group.leader):  # rank 0's keep-alive fails: it ends itself
            assert time.monotonic() < deadline, "rank 0 outlived its dead peer"
            time.sleep(0.5)
        assert not group.alive()
    finally:
        group.kill()
    again = launch_tp_group("tp-test", 2, 1, num_cpus=0.5, timeout_s=6)
    try:
        assert again.alive()
        again.call(None, "load", cfg)
        assert again.call(0, "generate", prompts, 6) == want
        again.call(None, "stop")
    finally:
        again.kill()

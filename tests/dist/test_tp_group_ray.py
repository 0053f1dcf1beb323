"""A TP worker's rank actors on a real local Ray instance (worker/tp_group.py): placed in
one STRICT_PACK placement group, joined in a gloo group, stepping in lockstep (greedy equals
the unsharded model); one rank killed fails the whole group (rank 0 notices at its next
keep-alive and ends), and the next generation of the group comes back and serves again."""
from __future__ import annotations

import time

import ray
import torch

from pdserve.engine.dist.steps import greedy_batch
from pdserve.engine.exec.kv_cache import allocate_kv_cache
from pdserve.engine.model.weights import random_model
from pdserve.worker.tp_group import launch_tp_group

from tests.dist import tp_ranks
from tests.workers.cluster import start_ray


def _reference(cfg, prompts: list[list[int]]) -> list[list[int]]:
    full = random_model(cfg, seed=0, std=0.1)
    kv = allocate_kv_cache(cfg, 64, 4, torch.float32, "cpu")

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
    group = launch_tp_group("tp-test", 2, 0, num_cpus=0.5, timeout_s=20)
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
    again = launch_tp_group("tp-test", 2, 1, num_cpus=0.5, timeout_s=20)
    try:
        assert again.alive()
        again.call(None, "load", cfg)
        assert again.call(0, "generate", prompts, 6) == want
        again.call(None, "stop")
    finally:
        again.kill()


def test_rank_actors_run_the_engine_and_come_back_after_a_rank_dies(tmp_path) -> None:
    """Phase 2: each rank actor loads a real checkpoint through the engine's loader and keeps
    its shard; rank 0's LLMEngine leads. Greedy equals the offline engine at TP 1; with rank 1
    killed mid-run rank 0 fails (its actor ends, no hang), and generation 1 serves again."""
    from pdserve.engine.core.engine_args import EngineArgs
    from pdserve.engine.core.sampling_params import SamplingParams
    from pdserve.engine.llm import LLM

    from tests.dist.tp_models import save_tiny

    start_ray()
    path = str(save_tiny("qwen3", tmp_path / "qwen3"))
    args = EngineArgs(model=path, device="cpu", dtype="float32", block_size=4, num_blocks=64)
    prompts = [[5, 6, 7, 8, 9], [11, 3, 50], [99, 1, 2, 3, 4, 5, 6, 7, 8]]
    with LLM(args) as llm:
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        want = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
    group = launch_tp_group("tp-engine", 2, 0, num_cpus=0.5, timeout_s=20)
    try:
        loaded = group.call(None, "load_engine", args)
        assert [(x["num_heads"], x["num_kv_heads"]) for x in loaded] == [(2, 1), (2, 1)]
        assert group.call(0, "generate_ids", prompts, 8) == want
        ray.kill(group.ranks[1], no_restart=True)
        deadline = time.monotonic() + 90
        while not _dead(group.leader):  # a step or a keep-alive fails: rank 0 ends itself
            assert time.monotonic() < deadline, "rank 0 outlived its dead peer"
            try:
                group.call(0, "generate_ids", prompts[:1], 2, timeout_s=60)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass
        assert not group.alive()
    finally:
        group.kill()
    again = launch_tp_group("tp-engine", 2, 1, num_cpus=0.5, timeout_s=20)
    try:
        again.call(None, "load_engine", args)
        assert again.call(0, "generate_ids", prompts, 8) == want
        again.call(None, "stop")
    finally:
        again.kill()

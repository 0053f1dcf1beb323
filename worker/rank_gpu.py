"""Which GPU a TP rank actor runs on, and the Ray options that let it see its peers' GPUs.

Ray gives an actor that asks for a GPU a CUDA_VISIBLE_DEVICES of that GPU alone, so every
rank of a TP worker would see its GPU as cuda:0 and none of its peers' GPUs: torch's
symmetric memory (the peer all-reduce inside decode graphs, engine/dist/peer_all_reduce.py)
refuses such ranks ("overlapping devices"), and a process cannot map memory of a GPU it does
not see. So TP rank actors start with Ray's switch that leaves CUDA_VISIBLE_DEVICES as the
node has it (RANK_RUNTIME_ENV), and each rank takes the GPU Ray assigned it, by index
(rank_device), before anything touches CUDA.
"""
from __future__ import annotations

import os

RANK_RUNTIME_ENV = {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}


def rank_actor_options(num_gpus: float) -> dict:
    """Ray options every TP rank actor takes: RANK_RUNTIME_ENV when it holds a GPU."""
    return {"runtime_env": RANK_RUNTIME_ENV} if num_gpus else {}


def cuda_index(gpu_id: str | int, visible: str | None) -> int:
    """The torch index of the GPU Ray calls gpu_id in a process whose CUDA_VISIBLE_DEVICES
    is `visible` (None or "": every GPU, by its number)."""
    names = [v.strip() for v in (visible or "").split(",") if v.strip()]
    if not names:
        return int(gpu_id)
    try:
        return names.index(str(gpu_id))
    except ValueError:
        raise RuntimeError(f"GPU {gpu_id!r} (Ray's assignment) is not in this process's "
                           f"CUDA_VISIBLE_DEVICES={visible!r}") from None


def rank_device(device: str) -> str:
    """This rank actor's device for the configured one: for "cuda", the GPU Ray assigned it,
    made current so that nothing of this process lands on another rank's GPU; otherwise
    `device` (CPU ranks share the host)."""
    if not device.startswith("cuda"):
        return device
    import ray

    from pdserve.engine.exec.device_io import bind_thread

    ids = ray.get_gpu_ids()
    if len(ids) != 1:
        raise RuntimeError(f"a TP rank actor needs exactly one GPU from Ray, got {ids!r}")
    device = f"cuda:{cuda_index(ids[0], os.environ.get('CUDA_VISIBLE_DEVICES'))}"
    bind_thread(device)
    return device

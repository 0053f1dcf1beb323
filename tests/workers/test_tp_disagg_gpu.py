"""Disaggregated serving with a tensor-parallel worker on GPUs (worker/tp_worker.py, a real
local Ray instance, real NIXL): a TP-2 prefill worker whose ranks hold their KV in VRAM on
two GPUs, each rank seeing both GPUs (worker/rank_gpu.py), feeds a TP-1 decode worker; then
a TP-1 prefill worker feeds a TP-2 decode worker on the GPUs. Greedy equals the colocated
run and the KV each decode rank pulled is bitwise the prefill ranks' head slices. The
TP-1 workers run on the host, since one TP-2 worker takes both GPUs of a two-GPU machine:
the pulls cross VRAM and DRAM in both directions. Needs 2 CUDA devices."""
from __future__ import annotations

import pytest
import ray
import torch

from tests.workers.cluster import start_ray
from tests.workers.test_tp_disagg import _offline_greedy, _serve_pair_like
from tests.workers.tp_cluster import start_tp_workers, stop

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

# num_gpus per rank; 16-token blocks on both sides, as the GPU serving tests use
GPU = dict(device="cuda", num_gpus=1, block_size=16)


@pytest.mark.parametrize("gpu_role", ["prefill", "decode"])
def test_pd_with_a_tp2_worker_on_gpus_equals_colocated(tmp_path, gpu_role) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    from tests.dist.tp_models import save_tiny

    model = str(save_tiny("qwen3", tmp_path / "qwen3"))
    want = _offline_greedy(model)
    start_ray()
    host_role = "decode" if gpu_role == "prefill" else "prefill"
    [host] = start_tp_workers([(host_role, f"host-{host_role}", 1)], model, lease_ttl_s=5.0,
                              block_size=16)
    workers = [host]
    try:
        graphs = dict(use_triton=True, use_cuda_graphs=True) if gpu_role == "decode" else {}
        [gpu] = start_tp_workers([(gpu_role, f"gpu-{gpu_role}", 2)], model, lease_ttl_s=5.0,
                                 tp_timeout_s=60.0, **GPU, **graphs)
        workers.append(gpu)
        p, d = (gpu, host) if gpu_role == "prefill" else (host, gpu)
        _serve_pair_like(p, d, want, f"gpu-{gpu_role}")
        if gpu_role == "decode":  # its ranks decoded from graphs, all-reduces peer to peer
            assert ray.get(gpu.actor.graph_replays.remote(), timeout=30) > 0
            assert ray.get(gpu.actor.peer_all_reduce.remote(), timeout=30)
    finally:
        stop(*workers)

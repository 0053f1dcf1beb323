"""worker/rank_gpu.py: a TP rank actor finds the GPU Ray assigned it among the GPUs it sees
(it starts with Ray's switch that keeps the node's CUDA_VISIBLE_DEVICES, so that its peers'
GPUs stay visible to the peer all-reduce). The GPU path runs in
tests/workers/test_tp_graphs_serving_gpu.py, which asserts that the group joined."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdserve.worker.rank_gpu import RANK_RUNTIME_ENV, cuda_index, rank_actor_options, rank_device


@pytest.mark.parametrize("gpu_id, visible, index", [
    ("3", None, 3), (2, "", 2),  # every GPU visible: Ray's id is the index
    ("6", "4,6,7", 1), ("4", " 4, 6 ", 0),  # a node started on a subset: position in it
    ("GPU-b2c1", "GPU-a9f0,GPU-b2c1", 1),  # UUIDs
])
def test_cuda_index(gpu_id, visible, index) -> None:
    assert cuda_index(gpu_id, visible) == index


def test_cuda_index_names_a_gpu_it_cannot_see() -> None:
    with pytest.raises(RuntimeError, match=r"GPU '5'.*CUDA_VISIBLE_DEVICES='0,1'"):
        cuda_index("5", "0,1")


def test_only_gpu_ranks_keep_the_nodes_visible_devices() -> None:
    assert rank_actor_options(0) == {}
    opts = rank_actor_options(1)
    assert opts["runtime_env"] is RANK_RUNTIME_ENV
    assert RANK_RUNTIME_ENV["env_vars"]["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] == "1"
    assert rank_device("cpu") == "cpu"  # CPU ranks share the host; Ray is not asked


RAY_PROBE = """
import json, os, ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from pdserve.worker.rank_gpu import cuda_index, rank_actor_options

ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False)

@ray.remote
class Rank:
    def where(self):
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return visible, cuda_index(ray.get_gpu_ids()[0], visible)

pg = ray.util.placement_group([{"CPU": 0.1, "GPU": 1}] * 2, strategy="STRICT_PACK")
ray.get(pg.ready(), timeout=60)
out = {}
for name, opts in (("rank", rank_actor_options(1)), ("plain", {})):
    actors = [Rank.options(num_cpus=0.1, num_gpus=1, **opts, scheduling_strategy=
                           PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r)
                           ).remote() for r in range(2)]
    out[name] = ray.get([a.where.remote() for a in actors], timeout=120)
    for a in actors:
        ray.kill(a)
print(json.dumps(out))
"""


def test_rank_actors_see_every_gpu_and_take_their_own() -> None:
    """A real local Ray instance on "GPUs 5 and 7" (none exist here: Ray assigns them and
    sets the variable all the same), in its own process: rank actors started with
    rank_actor_options keep the node's CUDA_VISIBLE_DEVICES and find distinct indices 0 and
    1; plain GPU actors see only their own GPU, each as index 0, which is what the peer
    all-reduce refused."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "5,7"}  # a node started on two of its GPUs
    run = subprocess.run([sys.executable, "-c", RAY_PROBE], capture_output=True, text=True,
                         timeout=240, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert sorted(map(tuple, out["rank"])) == [("5,7", 0), ("5,7", 1)]
    assert sorted(map(tuple, out["plain"])) == [("5", 0), ("7", 0)]

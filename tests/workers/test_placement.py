"""Multi-node placement on a real local Ray instance: a worker started with host "node"
binds and advertises its Ray node's address (gRPC, metrics; UCX on that interface), and a
pool's node labels (`pdserve serve --node-label`) keep its workers off nodes without them."""
from __future__ import annotations

import pytest
import ray

from pdserve.proto import pdserve_pb2 as pb
from pdserve.worker.actor import launch_worker
from pdserve.worker.config import NODE_HOST, WorkerConfig

from tests.workers.cluster import SECRET, start_ray, start_worker


def test_host_node_binds_the_nodes_address_on_a_labelled_node() -> None:
    start_ray()
    node_ip = ray.util.get_node_ip_address()
    node_id = ray.get_runtime_context().get_node_id()
    w = start_worker("decode", "placed-d", model="tiny-llama", block_size=4, num_blocks=16,
                     host=NODE_HOST, node_labels={"ray.io/node-id": node_id})
    try:
        ep = ray.get(w.actor.endpoints.remote(), timeout=30)
        assert ep["grpc_address"].rsplit(":", 1)[0] == node_ip != "127.0.0.1"
        assert ep["metrics_address"].rsplit(":", 1)[0] == node_ip
        assert w.stub.Health(pb.HealthRequest(), timeout=10).role == "decode"
    finally:
        ray.kill(w.actor, no_restart=True)


def test_a_worker_is_not_placed_on_a_node_without_its_pools_label() -> None:
    start_ray()
    cfg = WorkerConfig.of("prefill", "unplaced-p", SECRET, model="tiny-llama", metrics_port=0)
    actor = launch_worker(cfg, num_cpus=0, node_labels={"pdserve-role": "prefill"})
    try:  # the only node has no pdserve-role label: Ray keeps the actor pending
        with pytest.raises(ray.exceptions.GetTimeoutError):
            ray.get(actor.ping.remote(), timeout=5)
    finally:
        ray.kill(actor, no_restart=True)

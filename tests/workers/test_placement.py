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


def test_a_worker_that_fails_in_its_constructor_is_not_relaunched() -> None:
    """Its first launch failed in __init__ (a model its process cannot load): launching it
    again would fail the same way, so the pool's start ends with the worker's own error
    instead of relaunching it until --startup-timeout."""
    import asyncio

    from pdserve.router.worker_refs import RayWorkerRef, WorkerStartFailed

    start_ray()
    cfg = WorkerConfig.of("decode", "broken-d", SECRET, model="/nonexistent/model",
                          metrics_port=0)
    launches = []

    def launch(generation: int = 0):
        launches.append(generation)
        return launch_worker(cfg, num_cpus=0, generation=generation)
    ref = RayWorkerRef(launch(), "broken-d", "decode", launch=launch)
    with pytest.raises(WorkerStartFailed, match="broken-d failed to start: .*/nonexistent/model"):
        asyncio.run(asyncio.wait_for(ref.endpoints(), 120))
    assert launches == [0]  # not relaunched
    ray.kill(ref.actor, no_restart=True)


@ray.remote(num_cpus=0)
class _ShutsDown:
    """Stands for a TP worker's rank 0 (its shutdown returns before its placement group goes,
    on a timer: worker/tp_worker.py)."""

    def shutdown(self) -> None:
        return None


def test_shutting_a_worker_down_removes_its_placement_group() -> None:
    """RayWorkerRef.shutdown kills the actor, which cuts the actor's own removal timer
    short; the ref removes the worker's placement group itself, so its GPUs come free."""
    import asyncio
    import functools

    from ray.util.placement_group import placement_group, placement_group_table

    from pdserve.router.worker_refs import RayWorkerRef
    from pdserve.worker.tp_group import group_name, remove_previous

    from tests.workers.cluster import wait_until

    start_ray()
    pg = placement_group([{"CPU": 0.01}], name=group_name("pg-d", 0))
    ray.get(pg.ready(), timeout=60)
    ref = RayWorkerRef(_ShutsDown.remote(), "pg-d", "decode",
                       release=functools.partial(remove_previous, "pg-d"))  # as launch.py
    asyncio.run(asyncio.wait_for(ref.shutdown(), 60))
    wait_until(lambda: placement_group_table(pg)["state"] == "REMOVED", 30,
               "the worker's placement group to be removed")


@pytest.mark.parametrize("field, value", [("log_level", "loud"), ("lease_ttl_s", 0.0),
                                          ("kv_transport", "carrier-pigeon"),
                                          ("role", "router")])
def test_worker_config_names_a_bad_field(field, value) -> None:
    with pytest.raises(ValueError, match=f"^{field}: "):
        WorkerConfig.of("decode" if field != "role" else value, "w", SECRET,
                        **({} if field == "role" else {field: value}))

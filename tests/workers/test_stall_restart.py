"""A Ray worker actor whose engine loop stays stuck (faults.stall_loop_s: the loop stops with a
request in it, as on a hung GPU; its process and gRPC server live on) is marked down by the
router's pool past stall_timeout_s and, past twice that, killed and launched again by its
RayWorkerRef: a new incarnation that serves. (The requests on a stalled worker moving to
others: tests/router/test_stall_inproc.py.)"""
from __future__ import annotations

import asyncio

import grpc
import pytest
import ray

from pdserve.kv_transfer.faults import FaultConfig
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pbg
from pdserve.proto.rpc import make_aio_channel
from pdserve.router.pool import WorkerPool
from pdserve.router.worker_refs import RayWorkerRef
from pdserve.worker.actor import launch_worker
from pdserve.worker.config import WorkerConfig

from tests.cluster_secret import SECRET
from tests.workers.cluster import start_ray


async def _until(cond, timeout_s: float, what: str) -> None:
    end = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        if asyncio.get_running_loop().time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


async def _stall_then_restart(ref: RayWorkerRef, launches: list[int]) -> None:
    pool = WorkerPool([ref], cluster_secret=SECRET, poll_interval_s=0.2, stall_timeout_s=2.0)
    await pool.start(deadline_s=120)
    w = pool.workers["stuck-d"]
    first = w.incarnation
    async with make_aio_channel(w.endpoints["grpc_address"], SECRET) as ch:
        req = pb.DecodeRequest(request_id="r1", prompt_token_ids=list(range(5, 20)),
                               params=pb.SamplingParams(max_tokens=64, temperature=0),
                               timeout_s=100)
        stream = pbg.WorkerStub(ch).Decode(req, timeout=110)  # its loop stops with r1 in it
        try:
            await _until(lambda: w.stall.stalled, 60, "the pool to mark it stalled")
            assert not w.up and launches == [0]
            await _until(lambda: len(launches) == 2, 60, "the pool to restart it")
            with pytest.raises(grpc.aio.AioRpcError):  # the killed process's stream ends
                async for _ in stream:
                    pass
            await _until(lambda: w.up and w.incarnation != first, 120,
                         "the relaunched worker to come up")
            assert not w.stall.stalled and ref.restarts == 1
        finally:
            stream.cancel()
            await pool.close()


def test_a_worker_stuck_in_one_step_is_marked_down_then_restarted() -> None:
    start_ray()
    cfg = WorkerConfig.of("decode", "stuck-d", SECRET, model="tiny-qwen3", block_size=4,
                          num_blocks=64, metrics_port=0, faults=FaultConfig(stall_loop_s=600))
    launches: list[int] = []

    def launch(generation: int = 0):
        launches.append(generation)
        return launch_worker(cfg, num_cpus=0, generation=generation)
    ref = RayWorkerRef(launch(), "stuck-d", "decode", launch=launch)
    try:
        asyncio.run(_stall_then_restart(ref, launches))
    finally:
        ray.kill(ref.actor, no_restart=True)

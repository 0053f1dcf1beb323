"""A prefill worker whose engine loop is busy (one long step on a slow machine) still answers
at the request's deadline, with DEADLINE_EXCEEDED rather than an unknown error, and frees the
request once the loop is back; its Health says "busy" and for how long: an in-process Worker
on the tiny Qwen3 preset."""
from __future__ import annotations

import threading
import time

import grpc
import pytest

from pdserve.engine.llm import build_engine
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pbg
from pdserve.proto.rpc import make_channel
from pdserve.worker.config import WorkerConfig
from pdserve.worker.server import Worker

from tests.cluster_secret import SECRET


def test_a_busy_loop_gives_deadline_exceeded_at_the_deadline_and_frees_the_request() -> None:
    engine = build_engine("tiny-qwen3", device="cpu", block_size=4, num_blocks=64)
    w = Worker(WorkerConfig(role="prefill", worker_id="slow-p", cluster_secret=SECRET,
                            metrics_port=-1, kv_transport="inproc"), engine=engine).start()
    ch = make_channel(w.address, cluster_secret=SECRET)
    release = threading.Event()
    try:
        w.rt.loop.submit(lambda e: release.wait(30))  # the loop is stuck in a "long step"
        req = pb.PrefillRequest(request_id="late", prompt_token_ids=[5, 6, 7, 8, 9],
                                params=pb.SamplingParams(max_tokens=4), timeout_s=0.5)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            pbg.WorkerStub(ch).Prefill(req, timeout=20)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value.details()
        assert time.monotonic() - t0 < 5  # at its deadline, not when the loop came back
        # Health answers after its short wait, from the worker's last snapshot: busy, and
        # for how long
        w.rt.health_timeout_s = 0.3
        h = pbg.WorkerStub(ch).Health(pb.HealthRequest(), timeout=20)
        assert h.status == "busy" and h.worker_id == "slow-p" and h.incarnation
        assert h.loop_busy_s >= time.monotonic() - t0 - 0.2
        # the snapshot taken before the loop got stuck (at start): real totals, not zeros
        assert h.num_total_blocks == h.num_free_blocks == 64
        release.set()
        # the loop runs the queued add_request, then the abort queued behind it
        assert w.rt.loop.call(lambda e: not e.has_unfinished(), timeout_s=20)
        assert w.rt.loop.call(lambda e: e.scheduler.block_manager.num_free_blocks,
                              timeout_s=20) == engine.scheduler.block_manager.num_blocks
        assert w.rt.leases.pinned_blocks == 0
    finally:
        release.set()
        ch.close()
        w.stop()

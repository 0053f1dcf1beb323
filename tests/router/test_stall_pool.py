"""The pool's view of a stuck worker (router/stall.py), against fake workers over real gRPC:
"busy" under stall_timeout_s changes nothing (a slow step is not a fault, and does not
reopen a worker that failed), past it the worker is down and the calls on it are cancelled,
past twice that its ref is asked once to restart it; a Health that no thread answers while
the process lives counts as stuck too; "ok" brings it back. (The real path: real workers
behind a real router in test_stall_inproc.py, a Ray actor restarted in
tests/workers/test_stall_restart.py.)"""
from __future__ import annotations

import asyncio

import grpc

from pdserve.proto import pdserve_pb2 as pb
from pdserve.router.pool import WorkerPool
from pdserve.router.stall import cancel_on_stall, stalled_cancel

from tests.cluster_secret import SECRET
from tests.router.fake_worker import FakeRef, FakeWorker


def _run(ref: FakeRef, body, stall_timeout_s: float = 5.0, rpc_timeout_s: float = 5.0) -> None:
    async def main() -> None:
        # polled by hand (the background poll runs once at start, then waits an hour)
        pool = WorkerPool([ref], cluster_secret=SECRET, poll_interval_s=3600,
                          rpc_timeout_s=rpc_timeout_s, stall_timeout_s=stall_timeout_s)
        await pool.start(deadline_s=30)
        await asyncio.sleep(0.3)  # the background poll's one round, before the test's own
        try:
            await body(pool, pool.workers[ref.worker_id])
        finally:
            await pool.close()
    try:
        asyncio.run(main())
    finally:
        ref.w.stop()


def test_busy_under_the_timeout_changes_nothing_past_it_the_worker_is_down() -> None:
    fw = FakeWorker("busy-d", "decode").start()
    ref = FakeRef(fw)

    async def body(pool: WorkerPool, w) -> None:
        fw.health_status, fw.loop_busy_s = "busy", 4.0
        assert not await pool.poll(w) and w.up and not w.stall.stalled  # slow, not hung
        for _ in range(3):  # a worker whose requests failed: down
            pool.report_failure(w, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert not w.up
        await pool.poll(w)
        assert not w.up  # a busy answer does not bring it back
        fw.health_status, fw.loop_busy_s = "ok", 0.0
        assert await pool.poll(w) and w.up  # "ok" does
        # a stream on it, watched; then the loop stays in one step past the timeout
        fw.token_delay_s = 0.5
        call = w.stub.Decode(pb.DecodeRequest(request_id="s1", prompt_token_ids=[5, 6, 7],
                                              params=pb.SamplingParams(max_tokens=50)),
                             timeout=60)
        watch = cancel_on_stall(w.stall, call, w.worker_id)
        fw.health_status, fw.loop_busy_s = "busy", 6.0
        assert not await pool.poll(w)
        assert w.stall.stalled and not w.up and w.stall.stuck_s == 6.0
        try:
            async for _ in call:
                pass
            raise AssertionError("the stream on a stalled worker was not cancelled")
        except asyncio.CancelledError:
            assert stalled_cancel(watch)
        fw.token_delay_s = 0.0
        fw.loop_busy_s = 9.0  # stuck on, under twice the timeout: not restarted yet
        await pool.poll(w)
        assert ref.restarts == 0
        fw.loop_busy_s = 10.0
        await pool.poll(w)
        await pool.poll(w)
        assert ref.restarts == 1  # asked once per stall
        fw.health_status, fw.loop_busy_s = "ok", 0.0
        assert await pool.poll(w) and w.up and not w.stall.stalled and w.stall.stuck_s == 0
    _run(ref, body)


def test_an_unanswered_health_while_the_process_lives_is_a_stall() -> None:
    fw = FakeWorker("threadless-d", "decode").start()
    ref = FakeRef(fw, alive=True)  # Ray says its process lives

    async def body(pool: WorkerPool, w) -> None:
        fw.health_delay_s = 0.4  # every server thread taken: Health times out
        assert not await pool.poll(w)
        assert w.up and not w.stall.stalled  # busy, not dead, for now
        await asyncio.sleep(1.0)
        assert not await pool.poll(w)
        assert w.stall.stalled and not w.up and w.stall.stuck_s >= 1.0
        fw.health_delay_s = 0.0
        assert await pool.poll(w) and w.up and not w.stall.stalled
    _run(ref, body, stall_timeout_s=1.0, rpc_timeout_s=0.2)


def test_a_dead_worker_is_down_but_not_stuck() -> None:
    fw = FakeWorker("dead-d", "decode").start()
    ref = FakeRef(fw)  # alive() unknown

    async def body(pool: WorkerPool, w) -> None:
        fw.health_status, fw.loop_busy_s = "busy", 3.0
        await pool.poll(w)
        assert w.stall.stuck_s == 3.0
        fw.stop()
        for _ in range(3):  # UNAVAILABLE opens the breaker at once; a timeout after three
            assert not await pool.poll(w)
            assert w.stall.stuck_s == 0 and not w.stall.stalled  # not stuck: dead
        assert not w.up
    _run(ref, body)

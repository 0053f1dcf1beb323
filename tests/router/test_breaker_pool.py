"""The pool's breaker per worker (router/pool.py) against fake workers over real gRPC: soft
failures of requests open it even with good Health answers between them (only a request
served there ends their run), a good probe lets requests try the worker again and one more
failure takes it out with twice the backoff, and a failed probe doubles the backoff once.
(The unit: tests/router/test_policies.py; the real path: tests/router/test_e2e_failover.py.)"""
from __future__ import annotations

import time

import grpc

from pdserve.router.pool import WorkerPool

from tests.router.fake_worker import FakeRef, FakeWorker
from tests.router.test_stall_pool import _run

INTERNAL = grpc.StatusCode.INTERNAL


def test_requests_failing_behind_an_ok_health_take_the_worker_out() -> None:
    fw = FakeWorker("flaky-d", "decode").start()

    async def body(pool: WorkerPool, w) -> None:
        for _ in range(2):  # a polled worker's requests fail: a run of 3 opens it
            pool.report_failure(w, INTERNAL)
            assert await pool.poll(w) and w.up  # its Health still answers "ok"
        pool.report_failure(w, INTERNAL)
        assert not w.up
        backoff = w.breaker.backoff_s
        assert await pool.poll(w) and w.up  # a good probe: requests may try it again
        pool.report_failure(w, INTERNAL)  # one failure on trial takes it out again
        assert not w.up and w.breaker.backoff_s == 2 * backoff
        assert await pool.poll(w) and w.up
        pool.report_served(w)  # a request served there: the run starts over
        pool.report_failure(w, INTERNAL)
        pool.report_failure(w, INTERNAL)
        assert w.up and w.breaker.backoff_s == w.breaker.base_s
    _run(FakeRef(fw), body)


def test_a_failed_probe_backs_off_once() -> None:
    fw = FakeWorker("gone-d", "decode").start()

    async def body(pool: WorkerPool, w) -> None:
        fw.stop()
        assert not await pool.poll(w) and not w.up  # UNAVAILABLE: down at once
        backoff = w.breaker.backoff_s
        w.breaker.retry_at = time.monotonic()  # its probe is due
        await pool._poll_one(w)  # the background poll's step for one worker
        assert not w.up and w.breaker.backoff_s == 2 * backoff
    _run(FakeRef(fw), body)

"""LeaseTable: pin / release / expire / generation checks, idempotency, threads, faults."""
from __future__ import annotations

import threading

import pytest
from prometheus_client import CollectorRegistry

from pdserve.kv_transfer.faults import FaultConfig, FaultInjector
from pdserve.kv_transfer.lease import LeaseError, LeaseTable
from pdserve.kv_transfer.metrics import kv_metrics


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_pin_then_release_returns_blocks_once():
    clock = Clock()
    table = LeaseTable(clock=clock)
    lease = table.pin("r1", [4, 5, 9], ttl_s=10)
    assert lease.deadline == 110.0 and lease.block_ids == (4, 5, 9)
    assert table.check("r1", lease.generation) and table.pinned_blocks == 3
    assert table.release("r1", lease.generation) == [4, 5, 9]
    assert not table.check("r1", lease.generation) and table.pinned_blocks == 0
    # a retried release of the same generation: still valid, nothing more to free
    assert table.release("r1", lease.generation) == []
    assert table.release("r1") is None  # no generation, no lease: unknown
    assert table.release("nope", 1) is None


def test_expired_lease_is_stale_for_release_and_check():
    clock = Clock()
    table = LeaseTable(clock=clock)
    lease = table.pin("r1", [1, 2], ttl_s=5)
    clock.now = 104.9
    assert table.expire() == []
    clock.now = 105.0
    gone = table.expire()
    assert [g.request_id for g in gone] == ["r1"] and gone[0].block_ids == (1, 2)
    assert table.expire() == []  # each lease expires once
    assert table.release("r1", lease.generation) is None  # decode must treat its read as stale
    assert not table.check("r1", lease.generation)
    assert table.expired_total == 1 and table.pinned_blocks == 0


def test_alive_until_swept_even_past_deadline():
    """Blocks are freed only from expire()'s result, so before the sweep the read was valid."""
    clock = Clock()
    table = LeaseTable(clock=clock)
    lease = table.pin("r1", [1], ttl_s=1)
    clock.now = 200.0
    assert table.check("r1", lease.generation)
    assert table.release("r1", lease.generation) == [1]
    assert table.expire() == []


def test_generation_guards_against_repinned_request():
    table = LeaseTable(clock=Clock())
    old = table.pin("r1", [1], ttl_s=5)
    assert table.release("r1", old.generation) == [1]
    new = table.pin("r1", [7, 8], ttl_s=5)
    assert new.generation != old.generation
    assert table.release("r1", old.generation) == []  # old one was released before: valid
    assert table.check("r1", new.generation) and not table.check("r1", old.generation)
    assert table.release("r1", new.generation + 100) is None  # unknown generation: stale
    assert table.get("r1") == new  # and the wrong generation did not drop the new lease


def test_pin_validation_names_field():
    table = LeaseTable(clock=Clock())
    table.pin("r1", [1], ttl_s=1)
    with pytest.raises(LeaseError, match="request_id"):
        table.pin("r1", [2], ttl_s=1)
    with pytest.raises(LeaseError, match="ttl_s"):
        table.pin("r2", [2], ttl_s=0)
    with pytest.raises(LeaseError, match="ttl_s"):
        table.pin("r2", [2], ttl_s=float("nan"))
    with pytest.raises(LeaseError, match="block_ids"):
        table.pin("r2", [-1], ttl_s=1)
    with pytest.raises(LeaseError, match="request_id"):
        table.pin("", [1], ttl_s=1)


def test_release_without_generation_drops_current_lease():
    table = LeaseTable(clock=Clock())
    table.pin("r1", [3], ttl_s=1)
    assert table.release("r1") == [3] and len(table) == 0


def test_an_abort_makes_a_later_readers_release_stale():
    """P's abort (release without generation) frees the blocks under any read in flight: the
    reader's release that follows must say stale, not 'already released' ([])."""
    table = LeaseTable(clock=Clock())
    lease = table.pin("r1", [3, 4], ttl_s=10)
    assert table.release("r1") == [3, 4]
    assert table.release("r1", lease.generation) is None


def test_dropped_release_leaves_lease_to_expire():
    clock = Clock()
    faults = FaultInjector(FaultConfig(drop_release_prob=1.0))
    registry = CollectorRegistry()
    table = LeaseTable(clock=clock, faults=faults,
                       metrics=kv_metrics(registry).bind("prefill", "p0"))
    lease = table.pin("r1", [1, 2, 3], ttl_s=2)
    assert table.release("r1", lease.generation) is None  # swallowed
    assert faults.dropped_releases == 1 and table.check("r1", lease.generation)
    labels = {"role": "prefill", "worker": "p0"}
    assert registry.get_sample_value("pdserve:kv_blocks_pinned", labels) == 3
    clock.now += 2
    assert table.expire() == [lease]
    assert registry.get_sample_value("pdserve:kv_lease_expired_total", labels) == 1
    assert registry.get_sample_value("pdserve:nixl_num_kv_expired_reqs_total", labels) == 1
    assert registry.get_sample_value("pdserve:kv_blocks_pinned", labels) == 0


def test_next_deadline():
    clock = Clock()
    table = LeaseTable(clock=clock)
    assert table.next_deadline() is None
    table.pin("a", [1], ttl_s=9)
    table.pin("b", [2], ttl_s=3)
    assert table.next_deadline() == 103.0


def test_threads_pin_release_expire_conserve_blocks():
    """8 threads pin/release while another expires: every block is freed exactly once."""
    clock = Clock()
    table = LeaseTable(clock=clock)
    freed: list[int] = []
    freed_lock = threading.Lock()
    n_threads, per_thread = 8, 300

    def worker(t: int) -> None:
        for i in range(per_thread):
            block = t * per_thread + i
            lease = table.pin(f"r{block}", [block], ttl_s=1 if i % 3 == 0 else 1000)
            got = table.release(f"r{block}", lease.generation) if i % 2 else None
            if got:
                with freed_lock:
                    freed.extend(got)

    def sweeper(stop: threading.Event) -> None:
        while not stop.is_set():
            for lease in table.expire(now=clock() + 10):
                with freed_lock:
                    freed.extend(lease.block_ids)

    stop = threading.Event()
    sweep = threading.Thread(target=sweeper, args=(stop,))
    sweep.start()
    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    stop.set()
    sweep.join(timeout=60)
    assert not any(th.is_alive() for th in threads + [sweep])
    for lease in table.expire(now=clock() + 10_000):
        freed.extend(lease.block_ids)
    assert sorted(freed) == list(range(n_threads * per_thread))
    assert len(table) == 0 and table.pinned_blocks == 0

"""engine/dist/watchdog.py on fake events (the GPU tests run it on real ones:
tests/dist/test_tp_stall_gpu.py): completed marks are dropped and their events reused; the
oldest pending mark past the deadline is a stall, reported once, naming what it followed;
on a real two-rank group the leader and the follower mark every step message."""
from __future__ import annotations

import threading
import time

import pytest

from pdserve.engine.dist.watchdog import GpuWatchdog


class FakeEvent:
    """A CUDA event whose completion the test decides."""

    made = 0

    def __init__(self) -> None:
        FakeEvent.made += 1
        self.done = False
        self.records = 0

    def record(self, stream: object = None) -> None:
        self.done = False
        self.records += 1

    def query(self) -> bool:
        return self.done


def watchdog(timeout_s: float = 5.0, on_stall=lambda why: None, **kw) -> GpuWatchdog:
    events: list[FakeEvent] = []

    def new_event() -> FakeEvent:
        events.append(FakeEvent())
        return events[-1]
    wd = GpuWatchdog(None, timeout_s, "rank 1", on_stall=on_stall, new_event=new_event, **kw)
    wd.events = events  # type: ignore[attr-defined]
    return wd


def test_marks_before_start_are_skipped() -> None:
    wd = watchdog()
    wd.mark("step message 0 (FORWARD)")  # e.g. during the graph captures
    assert wd.events == [] and wd.check() is None


def test_completed_marks_are_dropped_and_their_events_reused() -> None:
    wd = watchdog(poll_s=3600)
    wd.start()
    try:
        wd.mark("step message 0 (FORWARD)")
        wd.mark("step message 1 (FORWARD)")
        for e in wd.events:
            e.done = True
        assert wd.check(now=1e12) is None  # completed: no age counts, however late
        wd.mark("step message 2 (FORWARD)")
        assert len(wd.events) == 2 and sum(e.records for e in wd.events) == 3
    finally:
        wd.close()


def test_a_pending_mark_past_the_deadline_is_a_stall_naming_it() -> None:
    wd = watchdog(timeout_s=5.0, poll_s=3600)
    wd.start()
    try:
        wd.mark("step message 7 (FORWARD)")
        wd.events[0].done = True
        wd.mark("step message 8 (KEEPALIVE)")  # the GPU never gets past this one
        wd.mark("step message 9 (KEEPALIVE)")
        at = time.monotonic()
        assert wd.check(now=at + 4.0) is None  # within the deadline
        why = wd.check(now=at + 6.0)
        assert why is not None and "rank 1" in why and "step message 8 (KEEPALIVE)" in why
        assert "5 s" in why
    finally:
        wd.close()


def test_the_thread_reports_a_stall_once_and_marks_stop() -> None:
    seen: list[str] = []
    called = threading.Event()

    def on_stall(why: str) -> None:
        seen.append(why)
        called.set()
    wd = watchdog(timeout_s=0.2, on_stall=on_stall, poll_s=0.02)
    wd.start()
    try:
        wd.mark("step message 3 (FORWARD)")  # never completes
        assert called.wait(30), "the watchdog never reported the stalled mark"
        assert wd.stalled == seen[0] and "step message 3 (FORWARD)" in seen[0]
        wd.mark("step message 4 (FORWARD)")  # after a stall: nothing more is recorded
        assert len(wd.events) == 1
    finally:
        wd.close()
    assert len(seen) == 1


def test_a_bad_deadline_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="^timeout_s"):
        watchdog(timeout_s=0)


def _marks(group) -> dict:
    """Rank 0 sends two keep-alives and STOP; rank 1 follows. Both groups carry a watchdog
    on fake events (gloo groups have none of their own), so its marks can be counted."""
    from pdserve.engine.dist import protocol as proto
    from pdserve.engine.dist.lockstep import Follower, Leader

    made: list[FakeEvent] = []

    def new_event() -> FakeEvent:
        made.append(FakeEvent())
        return made[-1]
    group.watchdog = GpuWatchdog(None, 60.0, f"rank {group.rank}", new_event=new_event,
                                 poll_s=3600)
    group.watchdog.start()
    if group.rank == 0:
        leader = Leader(group)
        leader.send(proto.Kind.KEEPALIVE, {})
        leader.send(proto.Kind.KEEPALIVE, {})
        leader.stop()
    else:
        import torch

        Follower(group, None, torch.zeros(1)).run()  # type: ignore[arg-type]
    oldest = group.watchdog.check(now=time.monotonic() + 3600)
    group.watchdog.close()
    return {"marks": len(made), "oldest": oldest}


def test_leader_marks_before_each_message_and_a_follower_on_each_receipt() -> None:
    """On a real two-rank gloo group: every step message is marked on both sides (the
    leader before it sends, keep-alives and STOP included; a follower as it receives), so
    the watchdog covers the GPU work queued before each one."""
    from tests.dist.tp_harness import run_ranks

    res = run_ranks(_marks, 2, timeout_s=20.0, deadline_s=120)
    for rank in (0, 1):
        assert res[rank]["marks"] == 3, res
        assert "step message 0 (KEEPALIVE)" in res[rank]["oldest"], res

"""Workers that hang instead of dying: a kernel that never returns, a collective waiting for
a rank that is gone. The process and its gRPC server live on, so neither Ray nor a failed
RPC shows it, and the requests on it would wait for their deadlines (ANCHORS #1).

A worker is stuck when its Health says its engine loop has been inside one step for
loop_busy_s (worker/runtime.py health), or when its Health goes unanswered while its process
still answers Ray (every server thread held). The pool's health poll (router/pool.py) marks
a worker stuck for stall_timeout_s as stalled: down, and every call on it cancelled by its
watch (cancel_on_stall), so router/dispatch.py retries it elsewhere or continues the stream
on another decode worker. Stuck for twice that, the worker's ref restarts it (a Ray actor:
killed and launched again, a new incarnation). A worker that answers "ok" again is back.
"""
from __future__ import annotations

import asyncio
import time

import grpc


class StallState:
    """One worker's stall state, as the pool's health polls see it (one incarnation)."""

    def __init__(self) -> None:
        self.stuck_s = 0.0  # how long it has been stuck, as last seen (0: it answered "ok")
        self.unanswered_since: float | None = None  # first of a run of unanswered Health calls
        self.restarted = False  # this stall already asked the ref to restart the worker
        self.event = asyncio.Event()  # set while stalled: the calls' watches wait on it

    @property
    def stalled(self) -> bool:
        return self.event.is_set()

    def answered(self, loop_busy_s: float) -> None:
        """Health answered: its loop has been away loop_busy_s (0 when it came round)."""
        self.unanswered_since, self.stuck_s = None, loop_busy_s

    def unanswered(self, process_lives: bool) -> None:
        """Health failed: stuck for as long as that lasts while the process lives; a dead
        process is not stuck (it is relaunched)."""
        if not process_lives:
            self.unanswered_since, self.stuck_s = None, 0.0
            return
        now = time.monotonic()
        self.unanswered_since = self.unanswered_since or now
        self.stuck_s = now - self.unanswered_since

    def mark(self) -> bool:
        """Stalled now; True the first time (for the log)."""
        first = not self.event.is_set()
        self.event.set()
        return first

    def clear(self) -> None:
        """It came round (or is a new incarnation): not stalled, nothing stuck."""
        self.stuck_s, self.unanswered_since, self.restarted = 0.0, None, False
        if self.event.is_set():
            self.event = asyncio.Event()


def cancel_on_stall(stall: StallState, call: grpc.aio.Call, name: str) -> asyncio.Task:
    """A task that cancels `call`, an RPC on the worker whose state is `stall`, once that
    worker is marked stalled. Its awaiter then gets CancelledError (stalled_cancel tells it
    from its own cancellation). Cancel the task when the call ends."""
    async def watch() -> bool:
        await stall.event.wait()
        call.cancel()
        return True
    return asyncio.create_task(watch(), name=f"stall-watch-{name}")


def stalled_cancel(watch: asyncio.Task) -> bool:
    """In an `except CancelledError` around a call watched by cancel_on_stall: True when the
    watch cancelled the call (its worker stalled), False when this task itself is cancelled."""
    task = asyncio.current_task()
    return watch.done() and not watch.cancelled() and not (task and task.cancelling())

"""A deadline on the GPU's own progress at TP > 1: the collectives a CUDA graph replays.

torch's NCCL watchdog bounds each eager collective by the communicator's timeout (and ends
the process when one outlives it), but it tracks only collectives launched outside a graph
capture. A decode graph replayed while a peer rank is dead, stopped or out of step waits in
its all-reduce forever, and so does the host thread that reads the step's tokens. So every
rank of a CUDA group marks its stream at each step message (the leader before it sends one,
keep-alives included; a follower when it receives one): an event recorded there completes
once all the work queued before it has. One still pending timeout_s after its mark means the
GPU has made no progress for that long, and the watchdog does what torch's does for an eager
collective: it says why and ends the process (on_stall), and the group is restarted whole
(worker/tp_worker.py; the offline engine's followers end when rank 0's sockets close).

    wd = GpuWatchdog(torch.device("cuda:1"), timeout_s=60, what="rank 1")
    wd.start()              # once the graphs are captured (TPGroup.start_watchdog):
                            # marks before it are no-ops
    wd.mark("FORWARD 17")   # at each step message
    wd.close()

Marks taken while this thread captures a graph are skipped (an event recorded there would
be captured into the graph).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch

log = logging.getLogger(__name__)

MAX_PENDING = 1024  # marks whose events are not yet complete; older ones are dropped


class Marker(Protocol):
    """What the watchdog needs of a CUDA event (tests pass a fake)."""

    def record(self, stream: torch.cuda.Stream | None = None) -> None: ...

    def query(self) -> bool: ...


def end_process(message: str) -> None:
    """Log why and end this process at once (no atexit, no destructor waiting on a stuck
    stream): Ray marks the actor dead, or the offline engine's peers see closed sockets."""
    log.critical("%s", message)
    logging.shutdown()
    os._exit(1)


class GpuWatchdog:
    """Marks on the current CUDA stream, checked by a daemon thread every poll_s."""

    def __init__(self, device: torch.device | None, timeout_s: float, what: str,
                 on_stall: Callable[[str], None] = end_process,
                 new_event: Callable[[], Marker] | None = None,
                 poll_s: float | None = None) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s!r}")
        self.device, self.timeout_s, self.what = device, timeout_s, what
        self.on_stall = on_stall
        self._new_event = new_event or torch.cuda.Event
        self.poll_s = poll_s if poll_s is not None else min(1.0, timeout_s / 8)
        self._pending: deque[tuple[Marker, float, str]] = deque()
        self._free: list[Marker] = []  # completed events, recorded again by the next marks
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.stalled: str | None = None  # the message, once a stall was seen

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="gpu-watchdog",
                                            daemon=True)
            self._thread.start()

    def mark(self, label: str) -> None:
        """Record an event after the work queued so far on the device's current stream (of
        the calling thread: the engine's and the keep-alive's are both the default one)."""
        if self._thread is None or self.stalled is not None:
            return
        stream = None
        if self.device is not None:  # None: fake events (tests)
            if torch.cuda.is_current_stream_capturing():
                return
            stream = torch.cuda.current_stream(self.device)
        with self._lock:
            event = self._free.pop() if self._free else self._new_event()
            event.record(stream)
            self._pending.append((event, time.monotonic(), label))
            if len(self._pending) > MAX_PENDING:
                self._pending.popleft()

    def check(self, now: float | None = None) -> str | None:
        """Drop the completed marks (in stream order, so from the oldest); the stall message
        when the oldest pending one is older than timeout_s, else None."""
        now = time.monotonic() if now is None else now
        with self._lock:
            while self._pending and self._pending[0][0].query():
                self._free.append(self._pending.popleft()[0])
            if not self._pending:
                return None
            _, at, label = self._pending[0]
        if now - at < self.timeout_s:
            return None
        return (f"{self.what}: the GPU made no progress for {now - at:.1f} s since {label} "
                f"(the deadline is the group's timeout, {self.timeout_s:g} s): a peer rank is "
                f"dead, stopped or out of step inside a collective")

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            message = self.check()
            if message is not None:
                self.stalled = message
                self.on_stall(message)
                return

    def close(self) -> None:
        self._stop.set()
        t, self._thread = self._thread, None
        if t is not None and t is not threading.current_thread():
            t.join(timeout=self.poll_s + 1.0)

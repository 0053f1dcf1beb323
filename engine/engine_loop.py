"""EngineLoop: one thread owns the engine; other threads talk to it through commands.

Workers serve many gRPC streams on a thread pool. Rather than lock the engine, every
mutation (add, abort, release, kv arrived) is a command run on the loop thread between
steps, and every request's outputs land on its own queue.Queue. A caller waits on that
queue with a deadline, so no wait is unbounded.

    loop.call(fn)          run fn(engine) on the loop thread, return its result (deadline)
    loop.subscribe(rid)    -> queue reserved for rid's outputs (the id is taken)
    loop.admit(rid, q, fn) fn(engine) on the loop thread (the command that adds rid); rid's
                           outputs reach q from then on: never an earlier request's under
                           the same id that was still stepping when q was subscribed
    loop.abort_and_wake(rid, q)  a stream ended early: its handler wakes at once (a pending
                           admit is cancelled), the abort runs when the loop comes round,
                           so a stuck loop never holds a cancelled RPC's thread
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from typing import Any, TypeVar

from pdserve.engine.core.outputs import RequestOutput
from pdserve.engine.core.sampling_params import DuplicateRequestError
from pdserve.engine.exec.device_io import bind_thread
from pdserve.engine.llm_engine import LLMEngine

T = TypeVar("T")


# Housekeeping period (lease expiry, gauges). An idle loop sleeps this long on the command
# queue: every command (a new request, arrived KV, an abort, stop) wakes it at once, so a
# shorter wait only burns CPU beside the other workers of a node.
TICK_S = 0.05


class EngineLoopError(RuntimeError):
    pass


class EngineLoop:
    def __init__(self, engine: LLMEngine, idle_wait_s: float = TICK_S,
                 on_tick: Callable[[LLMEngine], None] | None = None,
                 on_step: Callable[[list[RequestOutput]], None] | None = None) -> None:
        self.engine = engine
        self._commands: queue.Queue[tuple[Callable[[LLMEngine], Any], Future]] = queue.Queue()
        self._subs: dict[str, queue.Queue] = {}  # reserved ids (subscribe)
        self._live: dict[str, queue.Queue] = {}  # of those, the admitted ones (admit)
        # admit commands not yet run, by id: (the stream's queue, the command's future)
        self._admitting: dict[str, tuple[queue.Queue, Future]] = {}
        # streams woken by abort_and_wake, by id: an admit for one of them is refused
        self._woken: dict[str, queue.Queue] = {}
        self._subs_lock = threading.Lock()
        self._idle_wait_s = idle_wait_s
        self._on_tick = on_tick  # periodic housekeeping on the loop thread (lease expiry)
        # sees each step's outputs on the loop thread before they are published (metrics)
        self._on_step = on_step
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.fatal: BaseException | None = None
        self.died = threading.Event()  # set once fatal is: a host process may end itself
        # monotonic time the loop last came round (an idle loop does every idle_wait_s):
        # read from other threads, so a loop stuck in one step (a hung device) shows
        self._beat = time.monotonic()

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._commands.put((lambda e: None, Future()))  # wake it
        self._thread.join(timeout_s)

    # -- called from other threads -------------------------------------------------------

    def busy_s(self) -> float:
        """Seconds since the loop last came round: how long its current step or command
        has run (about 0 for a loop that steps or idles normally)."""
        return max(0.0, time.monotonic() - self._beat)

    def call(self, fn: Callable[[LLMEngine], T], timeout_s: float = 30.0) -> T:
        if self.fatal is not None:
            raise EngineLoopError("engine loop died") from self.fatal
        fut: Future = Future()
        self._commands.put((fn, fut))
        return fut.result(timeout=timeout_s)

    def submit(self, fn: Callable[[LLMEngine], Any]) -> Future:
        """Queue fn(engine) without waiting (e.g. from a gRPC cancel callback)."""
        fut: Future = Future()
        self._commands.put((fn, fut))
        return fut

    def subscribe(self, request_id: str) -> queue.Queue:
        """The queue of request_id's outputs. DuplicateRequestError while another stream is
        subscribed under the id: taking its queue would leave that stream waiting forever."""
        q: queue.Queue = queue.Queue()
        with self._subs_lock:
            if request_id in self._subs:
                raise DuplicateRequestError(request_id)
            self._subs[request_id] = q
        return q

    def unsubscribe(self, request_id: str, q: queue.Queue | None = None) -> None:
        """Drop request_id's subscription (only if it is still `q`, when given)."""
        with self._subs_lock:
            if q is None or self._subs.get(request_id) is q:
                self._subs.pop(request_id, None)
                self._live.pop(request_id, None)
            if q is None or self._woken.get(request_id) is q:
                self._woken.pop(request_id, None)

    def admit(self, request_id: str, q: queue.Queue, fn: Callable[[LLMEngine], T],
              timeout_s: float = 30.0) -> T:
        """call(fn) for the command that adds request_id, with its outputs going to `q` (its
        subscription) from that command on. A stream that ended early lets go of its id
        before the loop has aborted its request: a step in between still publishes that
        request's outputs, which must not reach the next stream under the id. They are
        published before this command runs (one thread), so they never reach `q`.
        concurrent.futures.CancelledError: abort_and_wake(request_id, q) came first (the
        RPC ended before the command ran, e.g. behind a long step); fn never runs."""
        def run(engine: LLMEngine) -> T:
            with self._subs_lock:
                if self._subs.get(request_id) is q:
                    self._live[request_id] = q
            return fn(engine)
        if self.fatal is not None:
            raise EngineLoopError("engine loop died") from self.fatal
        with self._subs_lock:
            if self._woken.get(request_id) is q:  # its RPC already ended
                raise CancelledError(f"{request_id}: the stream ended before its admission")
            fut = self.submit(run)
            self._admitting[request_id] = (q, fut)  # until it returns: cancel() fails once run
        try:
            return fut.result(timeout=timeout_s)
        finally:
            with self._subs_lock:
                if self._admitting.get(request_id, (None, None))[1] is fut:
                    del self._admitting[request_id]

    def abort_and_wake(self, request_id: str, q: queue.Queue | None) -> Future:
        """The stream whose RPC ended early (its queue `q`, when given) is woken now: a
        finished "abort" output on `q`, and its admit command cancelled if the loop has not
        run it yet, so its handler returns and lets go of the id at once, even while the
        loop is stuck in a long step. The abort itself is queued for the loop. A step
        before it may still publish the request's outputs: they reach `q` (read by nobody)
        or nothing, never a next stream under the id, whose admit runs after this abort (it
        is queued before the handler wakes). An admit already running is not cancelled: the
        abort follows it."""
        done = self.submit(lambda engine: engine.abort_request(request_id))
        if q is not None:
            with self._subs_lock:
                if self._subs.get(request_id) is q:  # its handler still holds the id
                    self._woken[request_id] = q
                pending = self._admitting.get(request_id)
                if pending is not None and pending[0] is q:
                    pending[1].cancel()  # False once the loop runs it
            q.put(RequestOutput(request_id, [], "", True, "abort"))
        return done

    def publish(self, request_id: str, item: RequestOutput | BaseException) -> None:
        """item to request_id's stream, once admitted (admit)."""
        with self._subs_lock:
            q = self._live.get(request_id)
        if q is not None:
            q.put(item)

    # -- the loop thread -----------------------------------------------------------------
    def _drain_commands(self, block: bool) -> None:
        """Run queued commands; when idle, wait up to idle_wait_s for the first one."""
        try:
            item = self._commands.get(timeout=self._idle_wait_s) if block \
                else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, fut = item
            # running from here: a cancel() from another thread now fails (it would make
            # set_result raise on this thread); a command cancelled before is skipped
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except BaseException as e:  # the caller gets the error, the loop goes on
                    fut.set_exception(e)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        last_tick, idle = 0.0, True
        try:
            bind_thread(self.engine.config.device)  # the engine's GPU, not cuda:0 (a TP rank)
            while not self._stop.is_set():
                self._beat = time.monotonic()
                self._drain_commands(block=idle)
                now = time.monotonic()
                if self._on_tick is not None and now - last_tick >= TICK_S:
                    self._on_tick(self.engine)
                    last_tick = now
                # idle also when only requests waiting for remote KV remain: nothing to step
                outputs: list[RequestOutput] = []
                idle = True
                if self.engine.has_unfinished():
                    outputs = self.engine.step()
                    idle = self.engine.idle
                if outputs and self._on_step is not None:
                    self._on_step(outputs)
                for out in outputs:
                    self.publish(out.request_id, out)
        except BaseException as e:  # a broken engine must not leave streams waiting
            self.fatal = e
            with self._subs_lock:
                subs = list(self._subs.values())
            for q in subs:
                q.put(EngineLoopError(f"engine loop died: {e!r}"))
            self._fail_queued(e)
            self.died.set()
            raise

    def _fail_queued(self, e: BaseException) -> None:
        """Commands queued when the loop died get its error now, not at their timeout."""
        while True:
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if not fut.done():
                fut.set_exception(EngineLoopError(f"engine loop died: {e!r}"))

"""EngineLoop (engine/engine_loop.py) around a real engine on the tiny Qwen3 preset: the loop
thread runs commands and steps, publishes each request's outputs to its subscriber, a
failing command reaches only its caller, and a dying engine ends every open stream (a fake
engine whose step raises), refuses later calls and wakes the worker's watcher, which ends
the worker process (worker/actor.py watch_engine_loop)."""
from __future__ import annotations

import queue
import threading
import time
import types

import pytest

from pdserve.engine.core.outputs import RequestOutput
from pdserve.engine.core.sampling_params import DuplicateRequestError, SamplingParams
from pdserve.engine.engine_loop import EngineLoop, EngineLoopError
from pdserve.engine.llm import build_engine
from pdserve.worker.actor import watch_engine_loop

TINY = dict(device="cpu", block_size=4, num_blocks=64)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _drain(q: queue.Queue, deadline_s: float = 60) -> list[int]:
    """Tokens published to `q` until the request finishes (each get has a deadline)."""
    tokens: list[int] = []
    while True:
        item = q.get(timeout=deadline_s)
        if isinstance(item, BaseException):
            raise item
        assert isinstance(item, RequestOutput)
        tokens += item.new_token_ids
        if item.finished:
            return tokens


@pytest.fixture(scope="module")
def engine():
    return build_engine("tiny-qwen3", **TINY)


def test_requests_added_by_command_stream_what_the_engine_generates(engine) -> None:
    prompts = [[5, 6, 7, 8, 9], [11, 3, 50]]
    for i, prompt in enumerate(prompts):  # the same engine stepped on this thread first
        engine.add_request(prompt, GREEDY, request_id=f"direct-{i}")
    outs = engine.generate_until_done(deadline_s=120)
    want = [sum((o.new_token_ids for o in outs if o.request_id == f"direct-{i}"), [])
            for i in range(len(prompts))]
    assert all(len(w) == GREEDY.max_tokens for w in want)
    loop = EngineLoop(engine).start()
    try:
        subs = [loop.subscribe(f"r{i}") for i in range(len(prompts))]
        for i, prompt in enumerate(prompts):  # the idle loop wakes on each command
            loop.admit(f"r{i}", subs[i],
                       lambda e, i=i, p=prompt: e.add_request(p, GREEDY, request_id=f"r{i}"))
        # a second subscriber under a live id would take r0's outputs: refused, r0 unharmed
        with pytest.raises(DuplicateRequestError, match="request_id: 'r0' is already in use"):
            loop.subscribe("r0")
        assert [_drain(q) for q in subs] == want
        assert not loop.call(lambda e: e.has_unfinished())
        # a stream whose RPC ended early: aborted on the loop, then its handler woken
        long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        q = loop.subscribe("gone")
        loop.admit("gone", q, lambda e: e.add_request(prompts[0], long, request_id="gone"))
        loop.abort_and_wake("gone", q).result(timeout=60)
        assert len(_drain(q)) < long.max_tokens  # ended by the abort, not by max_tokens
        assert not loop.call(lambda e: e.has_unfinished())
        loop.unsubscribe("gone", queue.Queue())  # not its queue: the subscription stays
        with pytest.raises(DuplicateRequestError):
            loop.subscribe("gone")
        loop.unsubscribe("gone", q)
        loop.subscribe("gone")  # the id is free again
        loop.unsubscribe("gone")
        # a stream that let go of its id while its request still steps: the next stream
        # under the id gets none of that request's outputs, only its own request's
        old = loop.subscribe("again")
        loop.admit("again", old, lambda e: e.add_request(prompts[1], long, request_id="again"))
        loop.unsubscribe("again", old)  # before the loop aborted it
        new = loop.subscribe("again")
        deadline = time.monotonic() + 60  # the old request steps on, publishing its outputs
        while len(loop.call(lambda e: e.scheduler.get_request("again").output_token_ids)) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        loop.abort_and_wake("again", None).result(timeout=60)
        loop.admit("again", new, lambda e: e.add_request(prompts[0], GREEDY, request_id="again"))
        assert _drain(new) == want[0]
    finally:
        loop.stop()


def test_a_failing_command_reaches_its_caller_and_the_loop_goes_on(engine) -> None:
    loop = EngineLoop(engine).start()
    try:
        with pytest.raises(KeyError, match="no such thing"):
            loop.call(lambda e: {}["no such thing"])
        assert loop.call(lambda e: 41 + 1) == 42
        assert loop.fatal is None
    finally:
        loop.stop()


def test_a_dying_engine_ends_open_streams_and_refuses_calls(engine) -> None:
    class Broken:
        """An engine whose step raises: what a device fault looks like to the loop."""
        idle = True
        config = types.SimpleNamespace(device="cpu")  # the loop binds its thread to it

        def has_unfinished(self) -> bool:
            return True

        def step(self) -> list[RequestOutput]:
            raise RuntimeError("device lost")

    loop = EngineLoop(Broken())  # type: ignore[arg-type]
    q = loop.subscribe("open-stream")
    # a worker process watches its loop and ends when it dies (here: records why); one being
    # shut down does not
    rt = types.SimpleNamespace(loop=loop)
    deaths: list[BaseException] = []
    watcher = threading.Thread(target=watch_engine_loop, args=(rt, deaths.append, lambda: False),
                               daemon=True)
    quiet = threading.Thread(target=watch_engine_loop, args=(rt, deaths.append, lambda: True),
                             daemon=True)
    watcher.start()
    quiet.start()
    loop.start()
    item = q.get(timeout=30)
    assert isinstance(item, EngineLoopError) and "device lost" in str(item)
    watcher.join(30)
    quiet.join(30)
    assert len(deaths) == 1 and "device lost" in str(deaths[0])
    loop.stop(timeout_s=5)
    with pytest.raises(EngineLoopError, match="died"):
        loop.call(lambda e: None, timeout_s=5)



def test_a_stream_ended_behind_a_long_step_lets_go_at_once_and_is_never_admitted(engine) -> None:
    """abort_and_wake while the loop is inside a long step: the handler waiting on its admit
    gets CancelledError at once (not at the step's end), its request is never added; one
    whose stream ended before its admit was even queued is refused; and a cancel that
    comes while the loop already runs the command fails instead of killing the loop."""
    from concurrent.futures import CancelledError

    loop = EngineLoop(engine).start()
    release = threading.Event()
    try:
        loop.submit(lambda e: release.wait(60))  # "a long step"
        q = loop.subscribe("late")
        got: list[BaseException] = []
        handler = threading.Thread(target=lambda: got.append(pytest.raises(
            CancelledError, loop.admit, "late", q,
            lambda e: e.add_request([5, 6, 7], GREEDY, request_id="late")).value))
        handler.start()
        deadline = time.monotonic() + 30
        while "late" not in loop._admitting:  # the admit is queued behind the step
            assert time.monotonic() < deadline
            time.sleep(0.01)
        loop.abort_and_wake("late", q)
        handler.join(30)
        assert got and not release.is_set()  # woken while the loop is still stuck
        assert q.get(timeout=5).finish_reason == "abort"
        with pytest.raises(CancelledError):  # the same stream cannot be admitted any more
            loop.admit("late", q, lambda e: e.add_request([5, 6, 7], GREEDY, request_id="late"))
        loop.unsubscribe("late", q)
        release.set()
        assert not loop.call(lambda e: e.has_unfinished(), timeout_s=30)  # never added
        # a cancel while the command runs: refused, the command's result still arrives
        running, hold = threading.Event(), threading.Event()
        fut = loop.submit(lambda e: (running.set(), hold.wait(30), 7)[2])
        assert running.wait(30) and not fut.cancel()
        hold.set()
        assert fut.result(timeout=30) == 7 and loop.fatal is None
        assert loop.call(lambda e: 1 + 1) == 2
    finally:
        release.set()
        loop.stop()

"""Decode streams that fell behind send what is queued as one message, in order."""
from __future__ import annotations

import queue

from pdserve.decode_worker.service import _coalesce
from pdserve.engine.core.outputs import RequestOutput


def _out(ids: list[int], text: str, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", ids, text, finished, "length" if finished else None,
                         [(-0.5, [])] * len(ids), num_prompt_tokens=3,
                         num_output_tokens=ids[-1])


def test_queued_outputs_merge_in_order_up_to_the_finish() -> None:
    q: queue.Queue = queue.Queue()
    for item in (_out([2], "b"), _out([3], "c", finished=True), _out([9], "x")):
        q.put(item)
    merged, pending = _coalesce(_out([1], "a"), q)
    assert merged.new_token_ids == [1, 2, 3] and merged.new_text == "abc"
    assert merged.finished and merged.finish_reason == "length"
    assert len(merged.new_logprobs) == 3 and merged.num_output_tokens == 3
    assert pending is None and q.qsize() == 1  # nothing after the finish is taken


def test_an_error_behind_the_outputs_is_returned_not_merged() -> None:
    q: queue.Queue = queue.Queue()
    q.put(_out([2], "b"))
    err = RuntimeError("engine loop died")
    q.put(err)
    merged, pending = _coalesce(_out([1], "a"), q)
    assert merged.new_token_ids == [1, 2] and pending is err


def test_nothing_queued_returns_the_output_itself() -> None:
    first = _out([1], "a")
    merged, pending = _coalesce(first, queue.Queue())
    assert merged is first and pending is None


def test_the_first_outputs_prompt_logprobs_survive_the_merge() -> None:
    """A colocated request's prompt logprobs ride on its first output only."""
    first = _out([1], "a")
    first.prompt_logprobs = [(7, -1.5, [], 3)]
    q: queue.Queue = queue.Queue()
    q.put(_out([2], "b"))
    merged, _ = _coalesce(first, q)
    assert merged.prompt_logprobs == [(7, -1.5, [], 3)] and merged.new_token_ids == [1, 2]

"""router/deltas.py coalesced: what queued while the router was busy goes out as fewer, larger
deltas, each completion's text, tokens and logprobs in order and its finish last."""
from __future__ import annotations

from pdserve.router.deltas import Delta, coalesced

DONE = object()


def d(index: int, text: str, finish: str | None = None, **kw) -> Delta:
    tok = sum(map(ord, text))
    return Delta(index, text, [tok], [(tok, -0.5, [])], finish, **kw)


def test_adjacent_deltas_of_one_completion_fold_into_the_first():
    err = RuntimeError("x")
    items = [d(0, "a", prompt_logprobs=[]), d(0, "b"), d(0, "c", "stop", stop_reason="."),
             d(0, "late"), DONE, d(1, "x"), d(2, "y"), d(2, "z", "length", completion_tokens=9),
             err]
    out = coalesced(items)
    assert [type(o).__name__ if not isinstance(o, Delta) else (o.index, o.text) for o in out] \
        == [(0, "abc"), (0, "late"), "object", (1, "x"), (2, "yz"), "RuntimeError"]
    first = out[0]
    assert first.token_ids == [97, 98, 99] and [t for t, _, _ in first.logprobs] == [97, 98, 99]
    assert (first.finish_reason, first.stop_reason, first.prompt_logprobs) == ("stop", ".", [])
    assert out[4].completion_tokens == 9 and out[4].finish_reason == "length"
    assert out[-1] is err


def test_a_finished_delta_takes_nothing_after_it_and_single_items_pass_unchanged():
    one = d(0, "a", "stop")
    assert coalesced([one]) == [one] and coalesced([]) == []
    later = d(0, "b")
    assert coalesced([one, later]) == [one, later] and one.text == "a"

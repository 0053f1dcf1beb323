"""TPGroup on real gloo ranks: all_agree is every rank's vote, the same answer on every rank
(the peer all-reduce is taken by all ranks or none); on CPU no peer all-reduce is joined
and an all-reduce sums in place; a rank that joins later than timeout_s still forms the
group (join_timeout_s), and once formed a collective waits timeout_s, not the join's."""
from __future__ import annotations

import time

import torch

from pdserve.engine.dist.group import TPGroup

from tests.dist.tp_harness import run_ranks


def _votes(group: TPGroup, no_from: int) -> dict:
    x = torch.full((2, 3), float(group.rank + 1))
    summed = group.all_reduce(x)
    return {"all_yes": group.all_agree(True), "one_no": group.all_agree(group.rank != no_from),
            "peer": group.peer is not None, "in_place": summed is x,
            "sum": summed.tolist()}


def test_all_agree_is_every_ranks_vote_and_gloo_sums_in_place() -> None:
    results = run_ranks(_votes, 3, 2, timeout_s=20)
    for rank in range(3):
        res = results[rank]
        assert not (isinstance(res, tuple) and res[0] == "error"), res
        assert res == {"all_yes": True, "one_no": False, "peer": False, "in_place": True,
                       "sum": [[6.0] * 3] * 2}, (rank, res)


def _late_peer(group: TPGroup, away_s: float) -> dict:
    """Once joined: the last rank stays away for away_s before a vote (the control group,
    which formed under the join deadline) and an all-reduce (the device group)."""
    if group.rank == group.size - 1:
        time.sleep(away_s)
    out = {}
    for name, op in (("voted", lambda: group.all_agree(True)),
                     ("reduced", lambda: group.all_reduce(torch.ones(4)))):
        try:
            op()
            out[name] = True
        except Exception:  # noqa: BLE001 - gloo's timeout, or the group's error after it
            out[name] = False
    return out


def test_a_late_rank_joins_and_then_collectives_keep_the_short_timeout() -> None:
    """timeout_s 2: the last rank joins 5 s after the others (it was still loading) and the
    group forms; then it stays away 8 s before a vote, and rank 0's vote fails on the 2 s
    timeout instead of waiting the join's."""
    results = run_ranks(_late_peer, 2, 8.0, timeout_s=2.0, late_s=5.0, deadline_s=120)
    assert not (isinstance(results[0], tuple) and results[0][0] == "error"), results
    assert results[0]["voted"] is False, results

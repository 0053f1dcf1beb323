"""TPGroup on real gloo ranks: all_agree is every rank's vote, the same answer on every rank
(the peer all-reduce is taken by all ranks or none); on CPU no peer all-reduce is joined
and an all-reduce sums in place."""
from __future__ import annotations

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

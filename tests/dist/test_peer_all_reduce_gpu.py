"""The one-shot peer all-reduce that CUDA graph captures use at TP > 1
(engine/dist/peer_all_reduce.py), on two GPUs through the real TPGroup: inside one captured
graph of several all-reduces, each with its own data, every sum is right on both ranks,
replay after replay with new inputs (a buffer reused before a peer finished reading it would
show here); outside a capture the all-reduce stays NCCL's (in place); what the kernel cannot
take (a dtype without a buffer, fp16 among them; a size past the buffer) is left to NCCL.
Each graph mixes sizes (one row; the test's rows; more chunks than the kernel has programs)
and chains the calls by PDL, as a decode graph does. Needs 2 CUDA devices."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine.dist.group import TPGroup

from tests.dist.tp_harness import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

CALLS = 9  # all-reduces per graph (a decode step has 2 per layer)
BIG = 1500  # rows: 1500 x 96 elements is more chunks than push_all_reduce.GROUP


def _fill(xs: list[torch.Tensor], rank: int, replay: int) -> None:
    """x_i = (rank + 1) * c_i + pattern: small integers, exact in bf16."""
    for i, x in enumerate(xs):
        pattern = torch.arange(x.numel(), device=x.device).remainder(7).view_as(x)
        x.copy_((rank + 1) * (i + 1 + 10 * replay) + pattern)


def _expected(x: torch.Tensor, i: int, replay: int, size: int) -> torch.Tensor:
    pattern = torch.arange(x.numel(), device=x.device).remainder(7).view_as(x)
    ranks_sum = size * (size + 1) // 2
    return (ranks_sum * (i + 1 + 10 * replay) + size * pattern).to(x.dtype)


def _graph_sums(group: TPGroup, rows: int, dtype: torch.dtype) -> dict:
    dev = torch.device(group.cfg.device)
    xs = [torch.empty((rows, 1, BIG)[i % 3], 96, dtype=dtype, device=dev)
          for i in range(CALLS)]
    _fill(xs, group.rank, 0)
    eager = group.all_reduce(xs[0])
    torch.cuda.synchronize(dev)
    out = {"peer": group.peer is not None, "eager_in_place": eager is xs[0],
           "eager_right": bool((eager == _expected(xs[0], 0, 0, group.size)).all())}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sums = [group.all_reduce(x, pdl=i > 0) for i, x in enumerate(xs)]
    wrong = []
    for replay in range(1, 4):
        _fill(xs, group.rank, replay)
        graph.replay()
        torch.cuda.synchronize(dev)
        wrong += [(replay, i) for i, (x, s) in enumerate(zip(xs, sums))
                  if not (s == _expected(x, i, replay, group.size)).all()]
    out["wrong"] = wrong
    out["captured_not_in_place"] = all(s is not x for s, x in zip(sums, xs))
    del graph
    return out


def _fits(group: TPGroup) -> dict:
    dev = torch.device(group.cfg.device)
    peer = group.peer
    if peer is None:
        return {"peer": None}
    n = peer.buffers[torch.bfloat16].slot

    def fits(numel: int, dtype: torch.dtype) -> bool:
        return peer.fits(torch.empty(numel, dtype=dtype, device=dev))
    return {"bf16_fits": fits(n, torch.bfloat16), "too_big": fits(n + 1, torch.bfloat16),
            "float64": fits(4, torch.float64), "float16": fits(8, torch.float16),
            "odd_size": fits(3, torch.bfloat16)}


def _eager(group: TPGroup) -> dict:
    """A decode step's collectives outside its graph (eager_peer): the logits' all-gather as
    a sum of zero-padded pieces, and rank 0's token ids as float32 (ids_from_rank0)."""
    from pdserve.engine.dist import parallel

    dev = torch.device(group.cfg.device)
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(group.rank)
                         ).to(dev, torch.bfloat16)
    parts = [torch.randn(3, 1000, generator=torch.Generator().manual_seed(r)).to(dev, torch.bfloat16)
             for r in range(group.size)]
    gathered = group.all_gather(logits, dim=-1, eager_peer=True)
    tp = parallel.TPContext(group, vocab_size=(1 << 24))
    ids = torch.tensor([0, 7, (1 << 24) - 1, 151935], device=dev) if group.rank == 0 \
        else torch.zeros(4, dtype=torch.int64, device=dev)
    shared = parallel.ids_from_rank0(ids, tp)
    torch.cuda.synchronize(dev)
    return {"gathered": bool(torch.equal(gathered, torch.cat(parts, dim=-1))),
            "ids": shared.tolist(), "ids_dtype": str(shared.dtype)}


def _check(results: dict) -> list[dict]:
    errors = [v for v in results.values() if isinstance(v, tuple) and v[0] == "error"]
    assert not errors, errors
    return [results[r] for r in sorted(results)]


@pytest.mark.parametrize("rows,dtype", [(1, torch.bfloat16), (37, torch.bfloat16),
                                        (256, torch.bfloat16), (5, torch.float32)])
def test_graph_all_reduces_sum_right_on_every_replay(rows: int, dtype: torch.dtype) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    for res in _check(run_ranks(_graph_sums, 2, rows, dtype, timeout_s=60, cuda=True)):
        assert res["peer"], "the group joined no peer all-reduce (see the rank's warning)"
        assert res["eager_in_place"] and res["eager_right"], res
        assert res["wrong"] == [] and res["captured_not_in_place"], res


def test_what_has_no_buffer_is_left_to_nccl() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    for res in _check(run_ranks(_fits, 2, timeout_s=60, cuda=True)):
        assert res == {"bf16_fits": True, "too_big": False, "float64": False,
                       "float16": False, "odd_size": True}


def test_a_decode_steps_eager_collectives_take_the_peer_kernel_exactly() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    for res in _check(run_ranks(_eager, 2, timeout_s=60, cuda=True)):
        assert res == {"gathered": True, "ids": [0, 7, (1 << 24) - 1, 151935],
                       "ids_dtype": "torch.int64"}

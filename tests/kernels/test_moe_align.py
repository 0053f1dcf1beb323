"""kernels.moe_align: (token, slot) pairs grouped by expert, padded to block_m, in static shapes."""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels.moe_align import align_capacity
from pdserve.kernels.ops import moe_align


def _ids(T: int, top_k: int, E: int, experts: int | None = None, seed: int = 0) -> torch.Tensor:
    """[T, top_k] distinct experts per token, drawn from the first `experts` (default all E)."""
    gen = torch.Generator().manual_seed(seed * 1009 + T * 31 + E)
    pool = experts or E
    return torch.stack([torch.randperm(pool, generator=gen)[:top_k] for _ in range(T)]).int()


def _check_alignment(ids: torch.Tensor, E: int, block_m: int, sorted_ids: torch.Tensor,
                     expert_ids: torch.Tensor, num_padded: torch.Tensor) -> None:
    """Each expert's pairs in pair order, padded with N to a multiple of block_m; each block
    of rows names its expert; blocks past num_padded are -1."""
    flat = ids.flatten().long().cpu()
    N = flat.numel()
    s, e, used = sorted_ids.cpu(), expert_ids.cpu(), int(num_padded)
    counts = torch.bincount(flat, minlength=E)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert (s[used:] == N).all() and (e[used // block_m:] == -1).all()
    expect_rows, expect_blocks = [], []
    for x in range(E):
        pairs = (flat == x).nonzero().flatten().tolist()
        pad = -len(pairs) % block_m
        expect_rows += pairs + [N] * pad
        expect_blocks += [x] * ((len(pairs) + pad) // block_m)
    assert s[:used].tolist() == expect_rows
    assert e[:used // block_m].tolist() == expect_blocks


@pytest.mark.parametrize("T,top_k,E,block_m", [(1, 1, 6, 16), (1, 8, 60, 16), (3, 2, 12, 4),
                                               (17, 8, 60, 16), (300, 8, 60, 32),
                                               (300, 2, 12, 64), (5, 3, 1000, 1), (8, 8, 9, 32),
                                               (9, 7, 7, 2), (13, 5, 33, 8)])
def test_groups_and_pads_by_expert(T, top_k, E, block_m, device):
    ids = _ids(T, top_k, E).to(device)
    out = moe_align(ids, E, block_m)
    _check_alignment(ids, E, block_m, *out)


@pytest.mark.parametrize("T", [1, 3, 17, 300])
def test_shapes_depend_on_the_token_count_only(T, device):
    """CUDA graphs: the same T gives the same shapes whatever the routing (all experts used,
    or two); ROWS = ceil((N + min(E, N) * (block_m - 1)) / block_m) * block_m."""
    E, top_k, block_m = 60, 2, 16
    N = T * top_k
    rows = -(-(N + min(E, N) * (block_m - 1)) // block_m) * block_m
    assert align_capacity(N, E, block_m) == (rows, rows // block_m)
    for experts in (None, 2):
        ids = _ids(T, top_k, E, experts=experts).to(device)
        sorted_ids, expert_ids, num_padded = moe_align(ids, E, block_m)
        assert sorted_ids.shape == (rows,) and expert_ids.shape == (rows // block_m,)
        assert num_padded.shape == (1,)
        assert sorted_ids.dtype == expert_ids.dtype == num_padded.dtype == torch.int32
        _check_alignment(ids, E, block_m, sorted_ids, expert_ids, num_padded)


def test_experts_without_tokens_get_no_blocks_and_zero_buffer(device):
    """A skewed routing (experts 3 and 7 of 12) gives blocks of those two only; int64 ids;
    the optional buffer is zeroed by extra programs of the same launch."""
    ids = torch.tensor([[3, 7], [7, 3], [3, 7]], dtype=torch.int64, device=device)
    zero = torch.full((9000,), 5, dtype=torch.int32, device=device)
    sorted_ids, expert_ids, num_padded = moe_align(ids, 12, 4, zero=zero)
    assert sorted_ids.tolist()[:8] == [0, 3, 4, 6, 1, 2, 5, 6]
    assert expert_ids.tolist() == [3, 7] + [-1] * (len(expert_ids) - 2)
    assert int(num_padded) == 8 and not zero.any()
    _check_alignment(ids, 12, 4, sorted_ids, expert_ids, num_padded)


@pytest.mark.parametrize("T,top_k,block_m", [(3, 4, 4), (40, 2, 16)])
def test_ids_outside_the_experts_are_left_out(T, top_k, block_m, device):
    """A caller error, but a harmless one: pairs with ids < 0 or >= E get no row, the rest
    align as if those pairs were not there (both the few-pairs path, N <= 64, and the E-wide
    one)."""
    E = 10
    ids = _ids(T, top_k, E, seed=5)
    ids[0, 0], ids[-1, -1] = -1, E
    sorted_ids, expert_ids, num_padded = moe_align(ids.to(device), E, block_m)
    flat = ids.flatten().tolist()
    rows, blocks = [], []
    for x in range(E):
        pairs = [p for p, v in enumerate(flat) if v == x]
        pad = -len(pairs) % block_m
        rows += pairs + [len(flat)] * pad
        blocks += [x] * ((len(pairs) + pad) // block_m)
    assert int(num_padded) == len(rows)
    assert sorted_ids.tolist()[:len(rows)] == rows
    assert expert_ids.tolist()[:len(blocks)] == blocks
    assert set(expert_ids.tolist()[len(blocks):]) <= {-1}


def test_no_tokens(device):
    ids = torch.zeros(0, 2, dtype=torch.int32, device=device)
    sorted_ids, expert_ids, num_padded = moe_align(ids, 6, 16)
    assert sorted_ids.shape == expert_ids.shape == (0,) and int(num_padded) == 0


def test_bad_arguments_name_the_field(device):
    ids = _ids(3, 2, 6).to(device)
    with pytest.raises(ValueError, match="topk_ids: expected 2 dims"):
        moe_align(ids.flatten(), 6, 16)
    with pytest.raises(TypeError, match="topk_ids: dtype"):
        moe_align(ids.float(), 6, 16)
    with pytest.raises(ValueError, match="topk_ids: must be contiguous"):
        moe_align(ids.t(), 6, 16)
    with pytest.raises(ValueError, match="num_experts: 0"):
        moe_align(ids, 0, 16)
    with pytest.raises(ValueError, match="block_m: 24"):
        moe_align(ids, 6, 24)
    with pytest.raises(TypeError, match="zero: dtype"):
        moe_align(ids, 6, 16, zero=torch.zeros(4, device=device))

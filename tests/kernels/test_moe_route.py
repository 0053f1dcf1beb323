"""kernels.moe_route (the MoE router in one kernel) against kernels.reference.moe_route_ref."""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels.moe_route import RouteConfig, moe_route_align, route_aligns
from pdserve.kernels.ops import moe_align, moe_route
from pdserve.kernels.reference import moe_route_ref


def _router(T: int, E: int, H: int, dtype: torch.dtype, device, seed: int = 0,
            stride_pad: int = 0):
    gen = torch.Generator().manual_seed(seed * 7919 + T * 131 + E)
    x = torch.randn(T, H + stride_pad, generator=gen)[:, :H].to(device, dtype)
    w = (torch.randn(E, H, generator=gen) / H ** 0.5).to(device, dtype)
    # both signs: some biased scores fall below 0, where the other groups' -inf mask matters
    bias = (1.2 * torch.rand(E, generator=gen) - 0.8).to(device)
    return x, w, bias


def _check(got, want, top_k: int, T: int) -> None:
    (wts, ids), (ref_w, ref_ids) = got, want
    assert wts.shape == ids.shape == (T, top_k)
    assert wts.dtype == torch.float32 and ids.dtype == torch.int32
    assert wts.is_contiguous() and ids.is_contiguous()
    assert torch.equal(ids, ref_ids)  # random data: no ties, the same experts in the same order
    torch.testing.assert_close(wts, ref_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,E,top_k,renormalize", [(1, 6, 1, True), (3, 12, 2, False),
                                                   (17, 60, 8, True), (300, 60, 8, False)])
def test_softmax_matches_reference(dtype, T, E, top_k, renormalize, device):
    x, w, _ = _router(T, E, 40, dtype, device, stride_pad=3)
    got = moe_route(x, w, top_k, "softmax", renormalize=renormalize)
    _check(got, moe_route_ref(x, w, top_k, "softmax", renormalize=renormalize), top_k, T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,E,n_group,topk_group,top_k,renormalize",
                         [(1, 12, 4, 2, 2, True), (3, 6, 3, 2, 1, True), (17, 60, 6, 3, 8, True),
                          (300, 60, 5, 2, 8, False), (4, 12, 1, 1, 8, True)])
def test_sigmoid_grouped_matches_reference(dtype, T, E, n_group, topk_group, top_k,
                                           renormalize, device):
    """GLM-4.5 / DeepSeek-V3 routing: correction bias, group-limited top-k, scaling."""
    x, w, bias = _router(T, E, 32, dtype, device)
    args = (top_k, "sigmoid", bias, n_group, topk_group, renormalize, 2.5)
    _check(moe_route(x, w, *args), moe_route_ref(x, w, *args), top_k, T)


def test_router_weight_in_another_dtype(device):
    """A bf16 model with an fp32 router (GLM-4.5 keeps the gate in fp32)."""
    x, w, bias = _router(5, 12, 48, torch.bfloat16, device)
    w = w.float() + 0.01 * torch.randn(w.shape, generator=torch.Generator().manual_seed(1)).to(device)
    args = (4, "sigmoid", bias, 4, 2, True, 1.5)
    _check(moe_route(x, w, *args), moe_route_ref(x, w, *args), 4, 5)


@pytest.mark.parametrize("cfg", [RouteConfig(16, 16, 16, tensor_cores=True),
                                 RouteConfig(2, 8, 32), RouteConfig(1, 16, 64, num_warps=2),
                                 RouteConfig(1, 1, 32, num_warps=2)])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_expert_slices_with_arrival_counters(cfg, scoring, device):
    """Slices of experts per program (the GPU's tiles): the last slice of each row block to
    arrive selects over all E; back-to-back launches reuse (and reset) the shared counters;
    the GEMV on the tensor cores or the CUDA cores, 1 to 16 rows per program, down to one
    expert per program (the H200's batch-1 tile)."""
    big = cfg.tensor_cores  # the interpreter runs one program at a time: fewer for the rest
    for T, E in ((3, 60), (40 if big else 5, 33), (3, 60), (20 if big else 2, 256)):
        x, w, bias = _router(T, E, 32, torch.float32, device)
        kw = {"correction_bias": bias, "n_group": 4 if E % 4 == 0 else 1, "topk_group": 2} \
            if scoring == "sigmoid" else {}
        got = moe_route(x, w, 6, scoring, config=cfg, **kw)
        _check(got, moe_route_ref(x, w, 6, scoring, **kw), 6, T)


@pytest.mark.parametrize("cfg", [None, RouteConfig(4, 8, 32), RouteConfig(4, 1, 16, num_warps=2)])
@pytest.mark.parametrize("T,E,top_k,block_m", [(1, 60, 8, 16), (2, 33, 5, 4), (3, 7, 7, 1),
                                               (4, 128, 8, 16)])
def test_route_align_equals_route_then_align(cfg, T, E, top_k, block_m, device):
    """moe_route_align (decode sizes: the router's last program aligns the pairs and zeroes
    the buffer) returns what moe_route + moe_align return, with all experts in one program
    or in slices (the last-arriving program aligns); odd expert counts, several block_m."""
    x, w, bias = _router(T, E, 40, torch.float32, device, stride_pad=3)
    zero = torch.full((1000,), 7, dtype=torch.int32, device=device)
    args = (top_k, "sigmoid", bias, 1, 1, True, 2.5)
    assert route_aligns(T, E, 40, top_k, cfg)
    wts, ids, *aligned = moe_route_align(x, w, top_k, block_m, *args[1:], zero=zero, config=cfg)
    want_w, want_ids = moe_route(x, w, *args, config=cfg)
    assert torch.equal(ids, want_ids) and torch.equal(wts, want_w)
    for got, want in zip(aligned, moe_align(want_ids, E, block_m)):
        assert torch.equal(got, want)
    assert not zero.any()


def test_route_align_only_for_one_row_block(device):
    x, w, _ = _router(5, 12, 32, torch.float32, device)
    assert not route_aligns(5, 12, 32, 2, RouteConfig(4, 4, 16))
    assert not route_aligns(9, 12, 32, 8, RouteConfig(16, 16, 16))  # 72 pairs: too many
    with pytest.raises(ValueError, match="x: 5 tokens"):
        moe_route_align(x, w, 2, 16, config=RouteConfig(4, 4, 16))
    with pytest.raises(ValueError, match="block_m: 24"):
        moe_route_align(x, w, 2, 24)
    with pytest.raises(TypeError, match="zero: dtype"):
        moe_route_align(x, w, 2, 16, zero=torch.zeros(4, device=device))


def test_masked_groups_never_win_and_ties_take_the_lowest_index(device):
    """A kept expert whose biased score is negative still beats every expert of a masked
    group (-inf, as transformers 5 masks them; a 0.0 mask would pick expert 2 here)."""
    E, H = 4, 16
    x = torch.zeros(1, H, device=device)
    x[0, 0] = 1.0
    w = torch.zeros(E, H, device=device)
    w[:, 0] = torch.tensor([2.0, -1.0, 0.5, 0.5])  # s = 0.881, 0.269, 0.622, 0.622
    bias = torch.tensor([0.0, -0.6, -0.4, -0.4], device=device)  # group 0: 0.881 - 0.331 = 0.55
    wts, ids = moe_route(x, w, 2, "sigmoid", bias, n_group=2, topk_group=1)
    ref_w, ref_ids = moe_route_ref(x, w, 2, "sigmoid", bias, n_group=2, topk_group=1)
    assert ids.tolist() == ref_ids.tolist() == [[0, 1]]
    torch.testing.assert_close(wts, ref_w)
    # equal router rows tie exactly: the lower index first, whatever the scoring
    w2 = torch.randn(6, H, generator=torch.Generator().manual_seed(3)).to(device)
    w2[4] = w2[1] = w2[1] + 5.0 * x[0]
    for scoring in ("softmax", "sigmoid"):
        assert moe_route(x, w2, 3, scoring)[1][0, :2].tolist() == [1, 4]


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_nan_rows_still_pick_valid_experts(scoring, device):
    """A NaN row: every choice counts as -inf, so the lowest ids win (valid experts); its
    weights stay NaN. The other rows are unaffected. All-zero logits tie: lowest ids first."""
    x, w, _ = _router(3, 12, 32, torch.float32, device)
    x[1] = float("nan")
    wts, ids = moe_route(x, w, 3, scoring, renormalize=False)
    assert ids[1].tolist() == [0, 1, 2] and wts[1].isnan().all()
    ref_w, ref_ids = moe_route_ref(x[[0, 2]], w, 3, scoring, renormalize=False)
    assert torch.equal(ids[[0, 2]], ref_ids)
    torch.testing.assert_close(wts[[0, 2]], ref_w, rtol=1e-5, atol=1e-6)
    zero = torch.zeros(1, 16, device=device)
    w0 = torch.zeros(4, 16, device=device)
    w0[2, 0] = -1.0  # products -0.0 and 0.0
    assert moe_route(zero, w0, 4, scoring)[1][0].tolist() == [0, 1, 2, 3]


def test_no_tokens(device):
    x, w, _ = _router(0, 6, 32, torch.float32, device)
    wts, ids = moe_route(x, w, 2)
    assert wts.shape == ids.shape == (0, 2)


def test_bad_arguments_name_the_field(device):
    x, w, bias = _router(2, 12, 32, torch.float32, device)
    cases = [((torch.randn(2, 3, 32, device=device), w, 2), {}, ValueError, "x: expected 2 dims"),
             ((x, w[:, :16], 2), {}, ValueError, "router_weight: expected shape"),
             ((x, w, 0), {}, ValueError, "top_k: 0"),
             ((x, w, 13), {}, ValueError, "top_k: 13"),
             ((x, w, 2, "relu"), {}, ValueError, "scoring"),
             ((x, w, 2), {"correction_bias": bias}, ValueError, "correction_bias: only"),
             ((x, w, 2, "sigmoid", bias[:5]), {}, ValueError, "correction_bias: expected shape"),
             ((x, w, 2, "sigmoid"), {"n_group": 5}, ValueError, "n_group: 5"),
             ((x, w, 2), {"n_group": 4}, ValueError, "n_group: group-limited"),
             ((x, w, 2, "sigmoid"), {"n_group": 12}, ValueError, "n_group: groups of 1"),
             ((x, w, 8, "sigmoid"), {"n_group": 4, "topk_group": 2}, ValueError, "topk_group"),
             ((x, w, 2, "sigmoid"), {"n_group": 4, "topk_group": 5}, ValueError, "topk_group"),
             ((x, w, 2), {"config": RouteConfig(16, 8, 16, tensor_cores=True)}, ValueError,
              "config: block_t"),
             ((x, w, 2), {"config": RouteConfig(2, 4, 8)}, ValueError, "config: block_t"),
             ((x, w, 2), {"config": RouteConfig(2, 32, 16)}, ValueError, "config: block_t"),
             ((x.int(), w, 2), {}, TypeError, "x: dtype"),
             ((x, w.double(), 2), {}, TypeError, "router_weight: dtype"),
             ((torch.randn(32, 2, device=device).t(), w, 2), {}, ValueError,
              "x: last dim must be contiguous")]
    for args, kw, exc, match in cases:
        with pytest.raises(exc, match=match):
            moe_route(*args, **kw)

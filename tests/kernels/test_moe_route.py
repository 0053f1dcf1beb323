"""kernels.moe_route (the MoE router in one kernel) against kernels.reference.moe_route_ref."""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels.moe_route import RouteConfig
from pdserve.kernels.ops import moe_route
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
                                 RouteConfig(2, 8, 32), RouteConfig(1, 16, 64, num_warps=2)])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_expert_slices_with_arrival_counters(cfg, scoring, device):
    """Slices of experts per program (the GPU's tiles): the last slice of each row block to
    arrive selects over all E; back-to-back launches reuse (and reset) the shared counters;
    the GEMV on the tensor cores or the CUDA cores, 1 to 16 rows per program."""
    big = cfg.tensor_cores  # the interpreter runs one program at a time: fewer for the rest
    for T, E in ((3, 60), (40 if big else 5, 33), (3, 60), (20 if big else 2, 256)):
        x, w, bias = _router(T, E, 32, torch.float32, device)
        kw = {"correction_bias": bias, "n_group": 4 if E % 4 == 0 else 1, "topk_group": 2} \
            if scoring == "sigmoid" else {}
        got = moe_route(x, w, 6, scoring, config=cfg, **kw)
        _check(got, moe_route_ref(x, w, 6, scoring, **kw), 6, T)


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

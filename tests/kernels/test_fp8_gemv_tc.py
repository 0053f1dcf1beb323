"""The tensor-core FP8 GEMV (kernels/fp8_gemv_tc.py): its launch plan, its argument checks,
its reference's function (w8a8 per 128 columns, the prologues, the residual, the zeroed
buffers) against the w8a16 GEMV's reference, and on a Hopper GPU the kernel against the
reference at odd and real sizes."""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels.fp8_gemv_tc import fp8_gemv_tc, tc_available, tc_plan
from pdserve.kernels.reference import fp8_dequant_ref, fp8_gemv_tc_ref, gemv_ref

from tests.kernels.test_fp8_gemv import fp8_weight


@pytest.mark.parametrize("N,K", [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288),
                                 (200, 384), (64, 128)])
def test_plan_spreads_the_tiles(N, K):
    plan = tc_plan(N, K, 132)
    tiles = K // 128
    assert tiles % plan.split == 0 and plan.grid % plan.split == 0
    assert (tiles // plan.split) % plan.group == 0
    blocks, groups = -(-N // 64), plan.grid // plan.split
    busiest = -(-blocks // groups) * (tiles // plan.split)
    if blocks * plan.split >= plan.grid:  # enough work for every CTA: ~even
        assert blocks * tiles / (plan.grid * busiest) >= 0.95


def test_light_prefill_leaves_two_tiles_of_the_ring_for_after_the_wait():
    assert tc_plan(4096, 4096, 132).prefill is None  # a whole ring
    light = tc_plan(4096, 4096, 132, light_prefill=True)
    assert light.prefill == light.stages - 2 > 0


def _inputs(N: int, K: int, prologue: str, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed + N + K)
    w8, scales = fp8_weight(N, K, (128, 128), device, seed)
    k_in = 2 * K if prologue == "silu" else K
    x = (torch.randn(1, k_in, generator=gen) * 2).to(device, torch.bfloat16)
    nw = (torch.rand(K, generator=gen) + 0.5).to(device, torch.bfloat16)
    add = torch.randn(1, N, generator=gen).to(device, torch.float32)
    return w8, scales.float(), x, nw, add


@pytest.mark.parametrize("prologue", ["none", "norm", "silu"])
def test_reference_is_the_w8a16_gemv_within_activation_rounding(prologue, device):
    N, K = 96, 256
    w8, scales, x, nw, add = _inputs(N, K, prologue, device)
    out = torch.zeros(1, N, device=device)
    res = torch.full((1, K), 7.0, device=device) if prologue == "norm" else None
    junk = torch.ones(33, device=device)
    fp8_gemv_tc(x, w8, scales, prologue, nw, 1e-6, out=out, add=add, res_out=res,
                zero=(junk,))
    w = fp8_dequant_ref(w8, scales, (128, 128))
    want = gemv_ref(x.float(), w, prologue, None, nw.float() if prologue == "norm" else None,
                    1e-6, add=add)
    want = want[0] if prologue == "norm" else want
    err = float((out - want).norm() / want.norm())
    assert 1e-4 < err < 0.05  # the activation's e4m3 rounding, no more
    assert not junk.any()
    if res is not None:
        torch.testing.assert_close(res, x.float())


def test_out_accumulates_and_zeroes_only_what_it_is_given(device):
    N, K = 64, 128
    w8, scales, x, _, _ = _inputs(N, K, "none", device)
    once = fp8_gemv_tc_ref(x, w8, scales, out=torch.zeros(1, N, device=device))
    out = torch.zeros(1, N, device=device)
    keep = torch.ones(5, device=device)
    fp8_gemv_tc(x, w8, scales, out=out)
    fp8_gemv_tc(x, w8, scales, out=out)
    # GPU: the tensor cores' fp8 accumulation within a 128-column group (see below)
    torch.testing.assert_close(out, 2 * once, rtol=1e-3, atol=2e-3 * once.abs().max().item())
    assert keep.all()


@pytest.mark.parametrize("bad,field", [
    ({"prologue": "gelu"}, "prologue"),
    ({"x": "short"}, "x"),
    ({"out": "bf16"}, "out"),
    ({"zero": "aliases_out"}, "zero[0]"),
    ({"res_out": "without_norm"}, "res_out"),
])
def test_bad_arguments_name_the_field(bad, field, device):
    N, K = 64, 256
    w8, scales, x, nw, _ = _inputs(N, K, "none", device)
    out = torch.zeros(1, N, device=device)
    kw = {"prologue": "none", "norm_weight": nw, "out": out, "zero": ()}
    if bad.get("prologue"):
        kw["prologue"] = bad["prologue"]
    if bad.get("x"):
        x = x[:, :100]
    if bad.get("out"):
        kw["out"] = out.to(torch.bfloat16)
    if bad.get("zero"):
        kw["zero"] = (out,)
    if bad.get("res_out"):
        kw["res_out"] = torch.zeros(1, K, device=device)
    with pytest.raises((ValueError, TypeError), match=field.replace("[", r"\[").replace("]", r"\]")):
        fp8_gemv_tc(x, w8, scales, **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not tc_available(0),
                    reason="needs a compute capability 9.0 GPU")
@pytest.mark.parametrize("N,K,prologue,light", [
    (200, 384, "none", False), (200, 384, "norm", False), (136, 256, "silu", False),
    (6144, 4096, "norm", False), (4096, 4096, "none", False), (4096, 4096, "none", True),
    (200, 384, "none", True), (24576, 4096, "norm", False), (4096, 12288, "silu", False)])
def test_kernel_is_the_reference(N, K, prologue, light):
    dev = torch.device("cuda")
    w8, scales, x, nw, add = _inputs(N, K, prologue, dev)
    res = torch.zeros(1, K, device=dev) if prologue == "norm" else None
    want = fp8_gemv_tc_ref(x, w8, scales, prologue, nw, 1e-6, out=torch.zeros(1, N, device=dev),
                           add=add)
    out = torch.zeros(1, N, device=dev)
    zs = (torch.ones(5000, device=dev), torch.ones(77, device=dev))
    fp8_gemv_tc(x, w8, scales, prologue, nw, 1e-6, out=out, add=add, res_out=res, zero=zs,
                light_prefill=light)
    torch.cuda.synchronize()
    # the same quantized activation: only summation order and the tensor cores' fp8
    # accumulation within a 128-column group differ
    torch.testing.assert_close(out, want, rtol=1e-3, atol=2e-3 * want.abs().max().item())
    assert not zs[0].any() and not zs[1].any()
    if res is not None:
        torch.testing.assert_close(res, x.float())

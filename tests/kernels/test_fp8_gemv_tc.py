"""The tensor-core FP8 GEMV (kernels/fp8_gemv_tc.py): its launch plan, its argument checks,
its reference's function (w8a8 per 128 columns, the prologues, the residual, the zeroed
buffers) against the w8a16 GEMV's reference, and on a Hopper GPU the kernel against the
reference at odd and real sizes."""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels.decode_attention import SplitPartials, active_splits
from pdserve.kernels.fp8_gemv_tc import fp8_gemv_tc, tc_available, tc_fits, tc_plan
from pdserve.kernels.reference import (
    fp8_dequant_ref,
    fp8_gemv_tc_ref,
    gemv_ref,
    merge_partials_ref,
)

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


@pytest.mark.parametrize("N,K", [(1024, 5120), (5120, 5120), (51200, 5120), (5120, 25600),
                                 (5120, 8192), (6144, 4096), (200, 384)])
def test_plan_leaves_a_power_of_two_tiles_a_cta(N, K):
    """A 5120 hidden size (Qwen3-14B / 32B) has 40 tiles a row: no split both divides 264
    CTAs and leaves a power of 2 a CTA, which the kernel's per-CTA vectors need (it failed
    to compile there). The grid shrinks to a multiple of the split instead."""
    for prefer in (4, 8):
        plan = tc_plan(N, K, 132, prefer_tiles=prefer)
        kts = K // 128 // plan.split
        assert K // 128 % plan.split == 0 and kts & (kts - 1) == 0
        assert plan.grid % plan.split == 0 and 264 - plan.split < plan.grid <= 264


def test_a_k_without_a_power_of_two_split_is_refused():
    """269 tiles (odd, prime): one a CTA would take 269 CTAs, more than 2 an SM."""
    w8 = torch.zeros(64, 269 * 128, dtype=torch.float8_e4m3fn)
    assert not tc_fits(w8, (128, 128))
    assert tc_fits(torch.zeros(64, 86 * 128, dtype=torch.float8_e4m3fn), (128, 128))
    with pytest.raises(ValueError, match="K: 34432"):
        tc_plan(64, 269 * 128, 132)


def test_the_merge_prologue_takes_half_the_heads_a_cta():
    """Qwen3-8B's o_proj: 4 or 8 K splits spread its tiles equally well; the "merge"
    prologue's preference takes 8 (4 heads' splits to merge a CTA), the others' 4."""
    assert tc_plan(4096, 4096, 132, light_prefill=True).split == 4
    assert tc_plan(4096, 4096, 132, light_prefill=True, prefer_tiles=4).split == 8


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


def _partials(hq: int, d: int, splits: int, seq_len: int, device, seed: int = 0,
              block_n: int = 64) -> SplitPartials:
    """A decode attention's unmerged splits of one sequence; the splits past active_splits
    hold NaN, which a reader that loads them would carry into its output."""
    gen = torch.Generator().manual_seed(seed + hq * d + splits)
    o = torch.randn(1, hq, splits, d, generator=gen) * 3
    lse = torch.randn(1, hq, splits, generator=gen) * 4
    n = active_splits(seq_len, block_n, splits)
    o[:, :, n:], lse[:, :, n:] = float("nan"), float("nan")
    return SplitPartials(o.to(device), lse.to(device),
                         torch.tensor([seq_len], dtype=torch.int32, device=device), block_n)


def test_merge_prologue_is_the_merged_activations_product(device):
    """"merge": the splits merged (reference.merge_partials_ref), then the "none" product."""
    N, K = 96, 256
    w8, scales, _, _, add = _inputs(N, K, "none", device)
    p = _partials(2, 128, 8, 200, device)  # 4 of 8 splits hold keys
    got = fp8_gemv_tc(p, w8, scales, "merge", out=torch.zeros(1, N, device=device), add=add)
    x = merge_partials_ref(p.o, p.lse, p.seq_lens, p.block_n).reshape(1, K)
    want = fp8_gemv_tc_ref(x, w8, scales, out=torch.zeros(1, N, device=device), add=add)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-3, atol=2e-3 * want.abs().max().item())


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
    ({"prologue": "merge"}, "x"),  # a tensor where the splits belong
    ({"partials": 64}, "x.o"),  # head_dim 64: a 128-column group would span two heads
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
    if bad.get("partials"):
        x, kw["prologue"] = _partials(K // 64, 64, 4, 100, device), "merge"
    with pytest.raises((ValueError, TypeError), match=field.replace("[", r"\[").replace("]", r"\]")):
        fp8_gemv_tc(x, w8, scales, **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not tc_available(0),
                    reason="needs a compute capability 9.0 GPU")
@pytest.mark.parametrize("N,K,prologue,light", [
    (200, 384, "none", False), (200, 384, "norm", False), (136, 256, "silu", False),
    (6144, 4096, "norm", False), (4096, 4096, "none", False), (4096, 4096, "none", True),
    (200, 384, "none", True), (24576, 4096, "norm", False), (4096, 12288, "silu", False),
    # a 5120 hidden size: 260-CTA grids (5 / 10 splits), 25 splits of 8 tiles for silu
    (1000, 5120, "norm", False), (5120, 25600, "silu", False), (7168, 5120, "norm", False)])
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not tc_available(0),
                    reason="needs a compute capability 9.0 GPU")
@pytest.mark.parametrize("N,hq,d,splits,seq_len", [
    (4096, 32, 128, 16, 640),  # Qwen3-8B's o_proj at 640 tokens: 10 of 16 splits hold keys
    (4096, 32, 128, 32, 2000),  # 32 of 32
    (4096, 16, 256, 16, 640),  # a 128-column group is half a head
    (5120, 40, 128, 16, 640),  # a 5120 hidden size: o_proj's K in 20 splits of 2 groups
    (200, 3, 128, 1, 5),  # one split; 3 groups: odd group counts per CTA
    (136, 2, 128, 8, 0),  # no keys (a padded row): the activation is zero
])
def test_merge_kernel_is_the_reference(N, hq, d, splits, seq_len):
    """The "merge" prologue never reads a split past active_splits (those hold NaN)."""
    dev = torch.device("cuda")
    K = hq * d
    w8, scales, _, _, add = _inputs(N, K, "none", dev)
    p = _partials(hq, d, splits, seq_len, dev)
    want = fp8_gemv_tc_ref(p, w8, scales, "merge", out=torch.zeros(1, N, device=dev), add=add)
    out = torch.zeros(1, N, device=dev)
    fp8_gemv_tc(p, w8, scales, "merge", out=out, add=add, light_prefill=True)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want, rtol=1e-3, atol=2e-3 * want.abs().max().item())

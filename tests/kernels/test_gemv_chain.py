"""kernels/gemv_chain.py (o_proj -> gate_up -> down as one work-queue kernel) against
kernels.reference.gemv_chain_ref: odd sizes, 16-bit and FP8 weights in every scale layout,
counters left at zero for the next launch (a second call answers the same), bad input."""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels._triton import chain_counters
from pdserve.kernels.fp8_scales import FP8_DTYPE
from pdserve.kernels.gemv_chain import ChainConfig, ChainWeight, gemv_chain
from pdserve.kernels.ops import gemv
from pdserve.kernels.reference import fp8_dequant_ref, gemv_chain_ref

D, KO, I = 72, 80, 100  # hidden, attention width, intermediate: no power of two


def _t(shape, dtype, device, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale).to(device, dtype)


def _weight(N: int, K: int, dtype, device, seed: int, block):
    """(ChainWeight, the float weight it stands for)."""
    if block is None:
        w = _t((N, K), dtype, device, seed, K ** -0.5)
        return ChainWeight(w), w
    gen = torch.Generator().manual_seed(seed)
    w8 = (torch.randn(N, K, generator=gen) * 64).clamp(-448, 448).to(FP8_DTYPE)
    s = (torch.rand((-(-N // block[0]), -(-K // block[1])), generator=gen) + 0.5) / (64 * K ** 0.5)
    w8, s = w8.to(device), s.to(device)
    return ChainWeight(w8, s, block), fp8_dequant_ref(w8, s, block).to(dtype)


def _case(dtype, device, blocks):
    wo, fo = _weight(D, KO, dtype, device, 1, blocks[0])
    wg, fg = _weight(2 * I, D, dtype, device, 2, blocks[1])
    wd, fd = _weight(D, I, dtype, device, 3, blocks[2])
    attn = _t((1, KO), dtype, device, 4)
    res = _t((1, D), dtype, device, 5)
    nw = torch.linspace(0.5, 1.5, D).to(device, dtype)
    return (attn, res, nw, 1e-5, wo, wg, wd), (attn, res, nw, 1e-5, fo, fg, fd)


BLOCKS = {"bf16": (None, None, None),
          "square": ((32, 64), (32, 64), (32, 64)),
          "merged_rows": ((32, 64), (1, 64), (16, 32)),  # gate_up as merged sources' rows
          "channel_tensor": ((1, KO), (2 * I, D), (1, I))}


def _unfused(attn, res, nw, eps, wo, wg, wd):
    """The same three projections as kernels.gemv launches (tested on their own)."""
    h = gemv(attn, wo.weight, add=res, scales=wo.scales, block=wo.block)
    gu, _ = gemv(h, wg.weight, "norm", norm_weight=nw, eps=eps, scales=wg.scales, block=wg.block)
    return gemv(gu, wd.weight, "silu", add=h, scales=wd.scales, block=wd.block), h


@pytest.mark.parametrize("layout", sorted(BLOCKS))
def test_matches_reference_fp32(layout, device, close):
    args, ref = _case(torch.float32, device, BLOCKS[layout])
    y, h = gemv_chain(*args, slot=0)
    y_ref, h_ref = gemv_chain_ref(*ref)
    assert y.shape == (1, D) and h.shape == (1, D) and y.dtype == torch.float32
    close(h, h_ref, torch.float32)
    close(y, y_ref, torch.float32)


@pytest.mark.parametrize("layout", sorted(BLOCKS))
def test_bf16_matches_unfused_kernels(layout, device, close):
    """bf16 rounds h and gu as stored; against the fp32 reference the three roundings add
    up (0.09 at |y| ~ 5), so the check is against the unfused GEMVs, which round the same."""
    args, _ = _case(torch.bfloat16, device, BLOCKS[layout])
    y, h = gemv_chain(*args, slot=0)
    y_ref, h_ref = _unfused(*args)
    assert y.dtype == torch.bfloat16
    close(h, h_ref, torch.bfloat16)
    close(y, y_ref, torch.bfloat16)


def test_counters_reset_and_repeat(device):
    args, _ = _case(torch.bfloat16, device, BLOCKS["square"])
    first = gemv_chain(*args, slot=3)
    assert not chain_counters(device, 3).any(), "the last program must zero the counters"
    second = gemv_chain(*args, slot=3)
    torch.testing.assert_close(first, second, rtol=0, atol=0)


def test_small_tiles_many_items(device, close):
    """Tiles far smaller than the stages: many items per stage and program."""
    args, ref = _case(torch.float32, device, BLOCKS["square"])
    cfg = ChainConfig(o=(2, 32), gate_up=(4, 64), down=(2, 32))
    y, h = gemv_chain(*args, slot=1, config=cfg)
    y_ref, h_ref = gemv_chain_ref(*ref)
    close(h, h_ref, torch.float32)
    close(y, y_ref, torch.float32)


def test_bad_input_names_the_field(device):
    args, _ = _case(torch.bfloat16, device, BLOCKS["bf16"])
    attn, res, nw, eps, wo, wg, wd = args
    with pytest.raises(ValueError, match="attn"):
        gemv_chain(attn.repeat(2, 1), res, nw, eps, wo, wg, wd, slot=0)
    with pytest.raises(ValueError, match="gate_up_proj.weight"):
        gemv_chain(attn, res, nw, eps, wo, ChainWeight(wg.weight[:-2]), wd, slot=0)
    with pytest.raises(ValueError, match="residual"):
        gemv_chain(attn, res[:, :-1], nw, eps, wo, wg, wd, slot=0)
    with pytest.raises(ValueError, match="eps"):
        gemv_chain(attn, res, nw, 0.0, wo, wg, wd, slot=0)
    fp32 = ChainWeight(wd.weight.float())
    with pytest.raises((ValueError, TypeError), match="down_proj"):
        gemv_chain(attn, res, nw, eps, wo, wg, fp32, slot=0)
    with pytest.raises(ValueError, match="slot"):
        gemv_chain(attn, res, nw, eps, wo, wg, wd, slot=-1)

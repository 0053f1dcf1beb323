"""The MoE block's post-attention RMSNorm folded into the router (kernels.moe_route / fused_moe
norm=(weight, eps)): the router takes the un-normed rows h, scores rmsnorm(h) * weight (fp32,
unrounded) and stores those rows in h.dtype for the expert GEMVs, as the norm kernel did. All
must equal the torch reference on odd sizes: expert counts not a power of two, top-k 1 / 2 / 8,
H not a multiple of any K step. Then the engine seam: MoEBlock.forward_normed and a tiny
Qwen3-MoE decoder at batch 1 against the torch path."""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels.fused_moe import fused_moe
from pdserve.kernels.moe_route import RouteConfig, moe_route
from pdserve.kernels.reference import (
    add_rmsnorm_ref,
    fp8_dequant_ref,
    moe_experts_ref,
    moe_route_ref,
)

from tests.kernels.test_moe_gemv import FP8_BLOCKS, FP8_TILES, fp8_experts

H, I = 50, 36  # H: not a multiple of the 16 / 32 / 64 K steps below
EPS = 1e-5


def _rows(T: int, E: int, dtype, device, seed: int = 0):
    """h [T, H] (strided rows, scaled off 1 so the norm matters), norm weight [H], router
    [E, H] fp32, w13 [E, 2I, H], w2 [E, H, I]."""
    gen = torch.Generator().manual_seed(seed * 7919 + T * 131 + E)
    h = (3.0 * torch.randn(T, H + 5, generator=gen))[:, :H].to(device, dtype)
    nw = (1 + 0.3 * torch.randn(H, generator=gen)).to(device, dtype)
    router = (torch.randn(E, H, generator=gen) / H ** 0.5).to(device)
    w13 = (torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5).to(device, dtype)
    w2 = (torch.randn(E, H, I, generator=gen) / I ** 0.5).to(device, dtype)
    return h, nw, router, w13, w2


def _normed(h: torch.Tensor, nw: torch.Tensor) -> torch.Tensor:
    """rmsnorm(h) * weight in fp32 (the kernels never round it to h.dtype)."""
    hf = h.float()
    return hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS) * nw.float()


ROUTE_TILES = [None, RouteConfig(1, 1, 16, num_warps=2), RouteConfig(2, 8, 32),
               RouteConfig(16, 16, 64, tensor_cores=True)]


@pytest.mark.parametrize("cfg", ROUTE_TILES)
@pytest.mark.parametrize("T,E,top_k,scoring", [(1, 7, 1, "softmax"), (1, 60, 8, "sigmoid"),
                                               (3, 13, 2, "softmax"), (2, 33, 8, "softmax")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_norm_prologue(cfg, T, E, top_k, scoring, dtype, device):
    """One slice of all experts, one expert per program (split path, arrival counters),
    several rows per program, the tensor cores; each K step (16 / 32 / 64) cut by H = 50."""
    h, nw, router, _, _ = _rows(T, E, dtype, device)
    kw = {"correction_bias": torch.linspace(-0.3, 0.2, E).to(device)} \
        if scoring == "sigmoid" else {}
    wts, ids, xn = moe_route(h, router, top_k, scoring, config=cfg, norm=(nw, EPS), pdl=True,
                             **kw)
    ref_w, ref_ids = moe_route_ref(_normed(h, nw), router, top_k, scoring, **kw)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(wts, ref_w, rtol=1e-5, atol=1e-6)
    # the normed rows for the experts, rounded as the rmsnorm kernel rounds them (at most an
    # ulp apart: the kernels sum h^2 in different orders)
    assert xn.shape == h.shape and xn.dtype == dtype and xn.is_contiguous()
    torch.testing.assert_close(xn.float(), add_rmsnorm_ref(h, None, nw, EPS)[0].float(),
                               rtol=1e-5 if dtype == torch.float32 else 8e-3, atol=1e-5)


@pytest.mark.parametrize("tile", sorted(FP8_TILES))
@pytest.mark.parametrize("layout", ["square", "per_row"])
def test_fused_moe_norm_fp8_experts(tile, layout, device, close):
    """FP8 experts behind the normalising router (K scales per lane or per row)."""
    E, top_k = 7, 3
    w13, w2, fp8 = fp8_experts(E, FP8_BLOCKS[layout], device)
    h, nw, router, _, _ = _rows(1, E, torch.bfloat16, device, seed=2)
    a = _normed(h, nw)
    wts, ids = moe_route_ref(a, router, top_k)
    got = fused_moe(h, router, w13, w2, top_k, config=FP8_TILES[tile], fp8=fp8, norm=(nw, EPS))
    d13 = fp8_dequant_ref(w13, fp8.w13_scale, fp8.blocks[0]).to(torch.bfloat16)
    d2 = fp8_dequant_ref(w2, fp8.w2_scale, fp8.blocks[1]).to(torch.bfloat16)
    close(got, moe_experts_ref(a.to(torch.bfloat16), d13, d2, wts, ids), torch.bfloat16)


@pytest.mark.parametrize("T,E,top_k,dtype", [(1, 7, 1, torch.float32), (1, 60, 8, torch.bfloat16),
                                             (2, 33, 2, torch.float32), (5, 9, 2, torch.float32),
                                             (0, 7, 2, torch.float32)])
def test_fused_moe_norm_every_path(T, E, top_k, dtype, device, close):
    """The GEMV path (batch 1; 2 tokens over 33 experts) normalises in the router, which
    stores the normed rows for gate_up; the grouped GEMMs (5 tokens over 9 experts) run the
    norm kernel first; no tokens: empty."""
    h, nw, router, w13, w2 = _rows(T, E, dtype, device, seed=3)
    got = fused_moe(h, router, w13, w2, top_k, norm=(nw, EPS), pdl=True)
    assert got.shape == (T, H) and got.dtype == dtype
    if T == 0:
        return
    a = _normed(h, nw)
    wts, ids = moe_route_ref(a, router, top_k)
    close(got, moe_experts_ref(a.to(dtype), w13, w2, wts, ids), dtype)


def test_bad_norm_is_refused_by_name(device):
    h, nw, router, w13, w2 = _rows(1, 7, torch.float32, device)
    cases = [((nw[:10], EPS), ValueError, "norm weight: expected shape"),
             ((nw.int(), EPS), TypeError, "norm weight: dtype"),
             ((nw, 0.0), ValueError, "norm: eps"),
             (nw, TypeError, "norm: expected")]
    for norm, exc, match in cases:
        with pytest.raises(exc, match=match):
            moe_route(h, router, 2, norm=norm)
        with pytest.raises(exc, match=match):
            fused_moe(torch.cat([h] * 5), router, w13, w2, 2, norm=norm)


def test_moe_block_forward_normed(device):
    """MoEBlock.forward_normed(h, norm) on the fused path (the router normalises: no norm
    kernel) equals the torch path's block(norm(h)); GLM's shared expert keeps norm(h)."""
    from pdserve.engine.model.presets import get_preset
    from pdserve.engine.model.weights import random_model

    for preset, layer in (("tiny-qwen3-moe", 0), ("tiny-glm4-moe", 1)):
        model = random_model(get_preset(preset), torch.float32, device, seed=4)
        block, norm = model.layers[layer].mlp, model.layers[layer].post_attention_layernorm
        with torch.no_grad():
            norm.weight.copy_(1 + 0.3 * torch.randn(norm.weight.shape).to(device))
            h = 3.0 * torch.randn(1, block.gate.weight.shape[1]).to(device)
            want = block(norm(h))
            model.use_fused_ops()
            got = block.forward_normed(h, norm, pdl=True)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_qwen3_moe_batch1_decode_matches_torch_path():
    """A tiny Qwen3-MoE through the decoder: prefill, then batch-1 decode steps on the GEMV
    path (DecoderLayer._forward_gemv -> forward_normed: no norm kernel before the router);
    logits equal the torch path's to fp32 rounding."""
    from tests.engine.test_triton_path import Driver, _assert_close, _pair

    ref, fast = _pair("tiny-qwen3-moe", torch.float32)
    runs, seq, table = [Driver(ref), Driver(fast)], [5, 17, 300, 41, 9, 77], [3, 0, 6]
    for step in range(3):
        new = seq if step == 0 else seq[-1:]
        want = runs[0].step([(new, len(seq) - len(new), table)])
        _assert_close(runs[1].step([(new, len(seq) - len(new), table)]), want, torch.float32)
        seq = seq + [int(want[-1].argmax())]

"""The fused MoE with FP8 expert weights (float8_e4m3fn w13 / w2 + per-expert block scales)
against moe_route_ref + moe_experts_ref on the dequantized weights: odd sizes (H and I not
multiples of the blocks), square blocks, gate_up's per-row blocks (up not on a block
boundary), per channel; decode (one launch of route + align) and prefill batches, top-1."""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels.fused_moe import Fp8Experts
from pdserve.kernels.moe_gemm import MoeConfig
from pdserve.kernels.ops import fused_experts, fused_moe
from pdserve.kernels.reference import fp8_dequant_ref, moe_experts_ref, moe_route_ref

from tests.kernels.test_fp8_gemv import fp8_weight

H, I = 48, 40


def fp8_experts(E: int, blocks, device, seed: int = 0):
    """Stacked W8 w13 [E, 2I, H], w2 [E, H, I] and their scales."""
    parts = [[fp8_weight(n, k, b, device, seed + 10 * e) for e in range(E)]
             for (n, k), b in (((2 * I, H), blocks[0]), ((H, I), blocks[1]))]
    (w13, s13), (w2, s2) = [(torch.stack([w for w, _ in p]), torch.stack([s for _, s in p]))
                            for p in parts]
    return w13, w2, Fp8Experts(s13.contiguous(), s2.contiguous(), blocks)


BLOCKS = {"square": ((16, 32), (16, 16)), "per_row": ((1, 16), (16, 32)),
          "channel": ((1, H), (1, I))}


@pytest.mark.parametrize("layout", sorted(BLOCKS))
@pytest.mark.parametrize("T,E,top_k,dtype", [(1, 8, 2, torch.bfloat16), (3, 6, 1, torch.float32),
                                             (40, 8, 3, torch.float32)])
def test_fp8_fused_moe_matches_reference(layout, T, E, top_k, dtype, device, close):
    w13, w2, fp8 = fp8_experts(E, BLOCKS[layout], device)
    gen = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=gen).to(device, dtype)
    router = (torch.randn(E, H, generator=gen) / H ** 0.5).to(device)
    out = fused_moe(x, router, w13, w2, top_k, fp8=fp8)
    assert out.shape == (T, H) and out.dtype == dtype
    weights, ids = moe_route_ref(x, router, top_k)
    d13, d2 = (fp8_dequant_ref(w, s, b).to(dtype) for w, s, b in
               ((w13, fp8.w13_scale, fp8.blocks[0]), (w2, fp8.w2_scale, fp8.blocks[1])))
    close(out, moe_experts_ref(x, d13, d2, weights, ids), dtype)


def test_k_step_is_cut_to_the_block(device, close):
    """A config whose K steps (64) are wider than the K blocks (16): cut to 16."""
    w13, w2, fp8 = fp8_experts(4, BLOCKS["square"], device)
    x = torch.randn(20, H, generator=torch.Generator().manual_seed(1)).to(device)
    ids = torch.randint(0, 4, (20, 2), generator=torch.Generator().manual_seed(2)).to(device)
    wts = torch.rand(20, 2, generator=torch.Generator().manual_seed(3)).to(device)
    out = fused_experts(x, w13, w2, wts, ids, config=MoeConfig(16, 32, 64, 16, 64), fp8=fp8)
    d13 = fp8_dequant_ref(w13, fp8.w13_scale, fp8.blocks[0])
    d2 = fp8_dequant_ref(w2, fp8.w2_scale, fp8.blocks[1])
    close(out, moe_experts_ref(x, d13, d2, wts, ids), torch.float32)


def test_fp8_weights_without_scales_are_refused(device):
    w13, w2, fp8 = fp8_experts(2, BLOCKS["square"], device)
    x = torch.randn(2, H).to(device)
    router = torch.randn(2, H).to(device)
    with pytest.raises(TypeError, match="w13: dtype"):
        fused_moe(x, router, w13, w2, 1)
    with pytest.raises(ValueError, match="w2_scale: expected shape"):
        fused_moe(x, router, w13, w2, 1, fp8=Fp8Experts(fp8.w13_scale, fp8.w13_scale, fp8.blocks))

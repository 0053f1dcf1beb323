"""The FP8 GEMM (kernels/fp8_gemm.py): per-token-group activation quantization against
quant_act_ref, and the block-scaled GEMM against fp8_gemm_ref on the kernel's own quantized
activations (so the check is the GEMM's, not the quantizer's rounding); end to end against the
float product within the activations' e4m3 rounding. Odd sizes, every scale layout."""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels.fp8_gemm import Fp8GemmConfig, act_group, fp8_gemm, quant_act
from pdserve.kernels.reference import fp8_dequant_ref, fp8_gemm_ref, quant_act_ref

from tests.kernels.test_fp8_gemv import BLOCKS, fp8_weight


def fp8_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """The dtype's tolerance, but never tighter than 1e-2 relative / 1e-3 of the largest
    value: Hopper's fp8 MMA accumulates each K step at reduced precision (DeepSeek-V3
    measured ~14 bits), which the kernel promotes to fp32 once per step (measured on an
    H200: 9e-4 absolute on outputs of size ~0.1 where an fp32 dot would agree to 1e-6)."""
    rtol, atol = {torch.float32: (1e-2, 1e-3), torch.bfloat16: (2e-2, 2e-2)}[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol,
                               atol=atol * max(1.0, expected.abs().max().item()))


@pytest.mark.parametrize("M,K,group", [(1, 100, 32), (7, 300, 128), (33, 64, 16)])
def test_quant_act(M, K, group, device):
    gen = torch.Generator().manual_seed(M + K)
    x = (torch.randn(M, K + 5, generator=gen) * torch.logspace(-2, 2, K + 5))[:, :K].to(device)
    x[0, :group] = 0.0  # an all-zero group
    x8, s = quant_act(x, group)
    r8, rs = quant_act_ref(x, group)
    torch.testing.assert_close(s, rs, rtol=1e-6, atol=0)
    # the same e4m3 values up to one step (3 mantissa bits) where x / scale lies near a
    # rounding boundary (Triton's interpreter and torch round fp32 -> e4m3 differently)
    a, b = x8.float(), r8.float()
    assert ((a - b).abs() <= torch.maximum(a.abs(), b.abs()) / 8 + 2 ** -9).all()
    assert (a != b).float().mean() < 0.05
    back = fp8_dequant_ref(x8, s, (1, group))
    assert ((back - x.float()).abs() <= s.repeat_interleave(group, 1)[:, :K] * 16 + 1e-30).all()
    x8c, sc = quant_act(x, group, column_major=True, pad_rows=4)
    assert x8c.shape[0] == -(-M // 4) * 4 and sc.stride() == (1, x8c.shape[0])
    torch.testing.assert_close(sc[:M], s, rtol=0, atol=0)


@pytest.mark.parametrize("layout", sorted(BLOCKS) + ["block128"])
@pytest.mark.parametrize("M,N,K", [(5, 70, 200), (40, 33, 130)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_matches_reference(layout, M, N, K, dtype, device):
    block = (128, 128) if layout == "block128" else BLOCKS[layout](N, K)
    w8, s = fp8_weight(N, K, block, device)
    gen = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=gen).to(device, dtype)
    bias = torch.randn(N, generator=gen).to(device, dtype)
    y = fp8_gemm(x, w8, s, block, bias=bias, backend="triton")
    assert y.shape == (M, N) and y.dtype == dtype
    group = act_group(block, K)
    x8, sx = quant_act(x, group)
    fp8_close(y, fp8_gemm_ref(x8, sx, group, w8, s, block, dtype, bias), dtype)
    # end to end: activation rounding of e4m3 (2^-4 relative per element) averages out
    exact = x.float() @ fp8_dequant_ref(w8, s, block).t() + bias.float()
    assert ((y.float() - exact).norm() / exact.norm()).item() < 0.05


@pytest.mark.parametrize("cfg", [Fp8GemmConfig(16, 16, group_m=2), Fp8GemmConfig(32, 64),
                                 Fp8GemmConfig(64, 32, group_m=1)])
def test_gemm_tiles(cfg, device):
    M, N, K, block = 50, 90, 160, (32, 32)
    w8, s = fp8_weight(N, K, block, device)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(3)).to(device)
    x8, sx = quant_act(x, 32)
    fp8_close(fp8_gemm(x, w8, s, block, config=cfg, backend="triton"),
              fp8_gemm_ref(x8, sx, 32, w8, s, block, torch.float32), torch.float32)


@pytest.mark.gpu
def test_scaled_mm_agrees_with_triton(device):
    """On an H100/H200: torch._scaled_mm's blockwise recipe and the Triton kernel compute the
    same function (fp32 accumulation order differs)."""
    from pdserve.kernels.fp8_gemm import scaled_mm_fits

    N, K = 512, 1024
    w8, s = fp8_weight(N, K, (128, 128), device)
    for M in (5, 64, 300):
        x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
        if not scaled_mm_fits(x, w8, (128, 128)):
            pytest.skip("torch._scaled_mm's blockwise recipe needs compute capability 9.0")
        a = fp8_gemm(x, w8, s, (128, 128), backend="scaled_mm")
        b = fp8_gemm(x, w8, s, (128, 128), backend="triton")
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(512, 128), (512, 256), (1024, 640), (1024, 10944),
                                 (512, 1024)])
def test_auto_backend_is_the_reference_at_any_k_block_count(N, K, device):
    """torch._scaled_mm's recipe was wrong where K's 128-column blocks are not a multiple of
    4 (GLM-4.5-Air's down_proj, K 10944: relative error 0.37): the automatic choice takes
    the Triton kernel there, and the product is the reference's."""
    from pdserve.kernels.fp8_gemm import scaled_mm_fits

    if device.type != "cuda":
        pytest.skip("torch._scaled_mm runs on CUDA only")
    w8, s = fp8_weight(N, K, (128, 128), device)
    x = torch.randn(40, K, device=device, dtype=torch.bfloat16)
    assert scaled_mm_fits(x, w8, (128, 128)) == (
        -(-K // 128) % 4 == 0 and torch.cuda.get_device_capability(device) == (9, 0))
    want = x.float() @ fp8_dequant_ref(w8, s.float(), (128, 128)).t()
    got = fp8_gemm(x, w8, s, (128, 128)).float()
    assert float((got - want).norm() / want.norm()) < 0.05  # e4m3 activations: ~0.026

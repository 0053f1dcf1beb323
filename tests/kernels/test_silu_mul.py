"""silu_and_mul against the torch reference (and the engine's layer)."""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels.ops import silu_and_mul
from pdserve.kernels.reference import silu_and_mul_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,I", [(1, 96), (3, 1000), (37, 1100)])
def test_matches_reference(dtype, T, I, device, close):
    gen = torch.Generator().manual_seed(T + I)
    x = (3 * torch.randn(T, 2 * I, generator=gen)).to(device, dtype)  # tails of silu too
    out = silu_and_mul(x)
    assert out.shape == (T, I) and out.dtype == dtype and out.is_contiguous()
    close(out, silu_and_mul_ref(x), dtype)


def test_strided_rows_match_engine_layer(device, close):
    from pdserve.engine.model.layers import silu_and_mul as engine_silu_and_mul

    big = torch.randn(9, 2 * 300 + 40, device=device)
    x = big[:, 20:620]  # row stride 640, columns contiguous
    close(silu_and_mul(x), engine_silu_and_mul(x), torch.float32)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # interpreter: exp(1e4) = inf
def test_extreme_gates_stay_finite(device):
    x = torch.tensor([[-1e4, 1e4, 0.0, 2.0, 3.0, 5.0]], device=device)
    out = silu_and_mul(x)
    torch.testing.assert_close(out, torch.tensor([[0.0, 3e4, 0.0]], device=device))


def test_bad_arguments_name_the_field(device):
    with pytest.raises(ValueError, match="x: last dim 7 must be even"):
        silu_and_mul(torch.randn(2, 7, device=device))
    with pytest.raises(ValueError, match="x: expected 2 dims"):
        silu_and_mul(torch.randn(2, 3, 8, device=device))
    with pytest.raises(TypeError, match="x: expected a torch.Tensor"):
        silu_and_mul([[1.0, 2.0]])

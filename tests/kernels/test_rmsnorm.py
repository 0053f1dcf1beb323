"""fused_add_rmsnorm against the torch reference (and the engine's RMSNorm)."""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels.ops import fused_add_rmsnorm
from pdserve.kernels.reference import add_rmsnorm_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,H", [(1, 96), (3, 576), (37, 1000)])
def test_matches_reference(dtype, T, H, device, close):
    gen = torch.Generator().manual_seed(T * H)
    x = torch.randn(T, H, generator=gen).to(device, dtype)
    res = torch.randn(T, H, generator=gen).to(device, dtype)
    w = (torch.rand(H, generator=gen) + 0.5).to(device, dtype)
    normed, new_res = fused_add_rmsnorm(x, res, w, 1e-6)
    ref_normed, ref_res = add_rmsnorm_ref(x, res, w, 1e-6)
    assert normed.dtype == new_res.dtype == dtype and normed.shape == (T, H)
    close(new_res, ref_res, dtype)
    close(normed, ref_normed, dtype)


def test_no_residual_returns_x_as_residual(device, close):
    x = torch.randn(5, 96, device=device)
    w = torch.rand(96, device=device)
    normed, new_res = fused_add_rmsnorm(x, None, w, 1e-5)
    assert new_res is x
    close(normed, add_rmsnorm_ref(x, None, w, 1e-5)[0], torch.float32)


def test_strided_rows_and_fp32_weight_with_bf16_input(device, close):
    """Rows of a wider buffer (row stride > H); the weight may stay fp32."""
    big = torch.randn(7, 3 * 128, device=device, dtype=torch.bfloat16)
    x, res = big[:, :128], big[:, 256:]
    w = torch.rand(128, device=device)
    normed, new_res = fused_add_rmsnorm(x, res, w, 1e-6)
    ref_normed, ref_res = add_rmsnorm_ref(x, res, w, 1e-6)
    close(new_res, ref_res, torch.bfloat16)
    close(normed, ref_normed, torch.bfloat16)
    assert torch.equal(big[:, :128], x)  # inputs untouched


def test_matches_engine_rmsnorm(device, close):
    from pdserve.engine.model.layers import RMSNorm

    norm = RMSNorm(200, 1e-6).to(device)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(200) + 0.5)
    x, res = torch.randn(4, 200, device=device), torch.randn(4, 200, device=device)
    want_normed, want_res = norm(x, res)
    normed, new_res = fused_add_rmsnorm(x, res, norm.weight.detach(), norm.eps)
    close(new_res, want_res, torch.float32)
    close(normed, want_normed.detach(), torch.float32)


def test_bad_arguments_name_the_field(device):
    x = torch.randn(4, 64, device=device)
    w = torch.ones(64, device=device)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rmsnorm(x, torch.randn(4, 63, device=device), w, 1e-6)
    with pytest.raises(ValueError, match="weight"):
        fused_add_rmsnorm(x, None, torch.ones(65, device=device), 1e-6)
    with pytest.raises(TypeError, match="residual"):
        fused_add_rmsnorm(x, x.half(), w, 1e-6)
    with pytest.raises(ValueError, match="x: last dim must be contiguous"):
        fused_add_rmsnorm(torch.randn(64, 4, device=device).t(), None, w, 1e-6)
    with pytest.raises(ValueError, match="eps"):
        fused_add_rmsnorm(x, None, w, 0.0)
    with pytest.raises(TypeError, match="x: dtype"):
        fused_add_rmsnorm(x.int(), None, w, 1e-6)


def test_out_halves_of_a_concatenation(device, close):
    """out= a strided half of [T, 2H] (the MTP layer's [enorm(e) | hnorm(h)]): each call fills
    its half and leaves the other untouched; a wrong out shape or dtype names the field."""
    T, H = 3, 577
    e, h = torch.randn(T, H, device=device), torch.randn(T, H, device=device)
    we, wh = torch.rand(H, device=device) + 0.5, torch.rand(H, device=device) + 0.5
    x = torch.full((T, 2 * H), 7.0, device=device)
    fused_add_rmsnorm(e, None, we, 1e-6, out=x[:, :H])
    assert torch.all(x[:, H:] == 7.0)
    fused_add_rmsnorm(h, None, wh, 1e-6, out=x[:, H:])
    want = torch.cat([add_rmsnorm_ref(e, None, we, 1e-6)[0], add_rmsnorm_ref(h, None, wh, 1e-6)[0]],
                     dim=-1)
    close(x, want, torch.float32)
    with pytest.raises(ValueError, match="out"):
        fused_add_rmsnorm(e, None, we, 1e-6, out=x[:, :H - 1])
    with pytest.raises(TypeError, match="out"):
        fused_add_rmsnorm(e, None, we, 1e-6, out=x.half()[:, :H])


@pytest.mark.parametrize("with_residual", [False, True])
def test_rows_gather_then_normalise(with_residual, device, close):
    """rows= picks rows (repeated, out of order) in the same kernel: both outputs equal the
    reference on x[rows] (and residual[rows]); no rows gives empty outputs."""
    T, H = 7, 333
    x = torch.randn(T, H, device=device)
    res = torch.randn(T, H, device=device) if with_residual else None
    w = torch.rand(H, device=device) + 0.5
    rows = torch.tensor([6, 0, 3, 3], device=device)
    normed, new_res = fused_add_rmsnorm(x, res, w, 1e-6, rows=rows)
    want, want_res = add_rmsnorm_ref(x[rows], None if res is None else res[rows], w, 1e-6)
    close(normed, want, torch.float32)
    close(new_res, want_res, torch.float32)
    empty, _ = fused_add_rmsnorm(x, res, w, 1e-6, rows=rows[:0])
    assert empty.shape == (0, H)
    with pytest.raises(TypeError, match="rows"):
        fused_add_rmsnorm(x, res, w, 1e-6, rows=rows.int())

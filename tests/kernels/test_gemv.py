"""gemv (decode-sized matmul with a fused prologue) against kernels.reference.gemv_ref."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pdserve.kernels.gemv import GemvConfig
from pdserve.kernels.ops import gemv
from pdserve.kernels.reference import gemv_ref


def _data(T: int, N: int, K: int, dtype: torch.dtype, device, k_in: int | None = None,
          stride_pad: int = 0):
    gen = torch.Generator().manual_seed(T * 7919 + N * 31 + K)
    k_in = k_in or K
    # rows of a wider buffer: the row stride is k_in + stride_pad (non-contiguous x)
    x = torch.randn(T, k_in + stride_pad, generator=gen)[:, :k_in].to(device, dtype)
    w = (torch.randn(N, K, generator=gen) / K ** 0.5).to(device, dtype)
    return x, w, gen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,N,K", [(1, 37, 96), (2, 100, 200), (3, 13, 300), (4, 64, 129),
                                   (7, 45, 77), (16, 33, 130)])
def test_plain_matches_reference(dtype, T, N, K, device, close):
    x, w, _ = _data(T, N, K, dtype, device, stride_pad=5)
    y = gemv(x, w)
    assert y.shape == (T, N) and y.dtype == dtype and y.is_contiguous()
    close(y, gemv_ref(x, w), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,N,K", [(1, 50, 96), (3, 70, 576), (4, 9, 130), (11, 40, 200)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_norm_prologue_matches_reference(dtype, T, N, K, with_residual, device, close):
    x, w, gen = _data(T, N, K, dtype, device, stride_pad=3)
    res = torch.randn(T, K, generator=gen).to(device, dtype) if with_residual else None
    nw = (torch.rand(K, generator=gen) + 0.5).to(device, dtype)
    y, h = gemv(x, w, "norm", residual=res, norm_weight=nw, eps=1e-5)
    y_ref, h_ref = gemv_ref(x, w, "norm", residual=res, norm_weight=nw, eps=1e-5)
    close(h, h_ref, dtype)
    close(y, y_ref, dtype)
    if not with_residual:
        assert h is x  # the residual stream is x itself, as fused_add_rmsnorm returns it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,N,K", [(1, 33, 64), (2, 17, 250), (4, 40, 96), (9, 21, 100)])
def test_silu_prologue_matches_reference(dtype, T, N, K, device, close):
    x, w, _ = _data(T, N, K, dtype, device, k_in=2 * K, stride_pad=7)
    close(gemv(x, w, "silu"), gemv_ref(x, w, "silu"), dtype)


@pytest.mark.parametrize("T,cfg", [(1, GemvConfig(2, 32)), (1, GemvConfig(8, 64, num_warps=2)),
                                   (1, GemvConfig(16, 128, num_warps=8, num_stages=2)),
                                   (2, GemvConfig(4, 64)), (3, GemvConfig(2, 128, num_warps=8)),
                                   (4, GemvConfig(8, 32)),
                                   (3, GemvConfig(16, 32, tensor_cores=True)),
                                   (3, GemvConfig(32, 64, num_stages=3, tensor_cores=True)),
                                   (5, GemvConfig(64, 16, num_warps=8, tensor_cores=True)),
                                   (3, GemvConfig(16, 32, tensor_cores=True, split_k=3)),
                                   (2, GemvConfig(32, 16, tensor_cores=True, split_k=2)),
                                   (4, GemvConfig(16, 32, tensor_cores=True, split_k=8))])
def test_every_tile_shape_covers_ragged_edges(T, cfg, device, close):
    """N and K not multiples of the tile: masked tails in both dims, on the CUDA-core kernel
    (1..4 rows, prologue fused) and the tensor-core one (prologue as its own kernel), K split
    over 2-8 programs (8 > the 5 K steps: some splits have nothing to add)."""
    x, w, gen = _data(T, 45, 157, torch.float32, device)
    res = torch.randn(T, 157, generator=gen).to(device)
    nw = torch.rand(157, generator=gen).to(device)
    y, h = gemv(x, w, "norm", residual=res, norm_weight=nw, config=cfg)
    y_ref, h_ref = gemv_ref(x, w, "norm", residual=res, norm_weight=nw)
    close(y, y_ref, torch.float32)
    close(h, h_ref, torch.float32)


def test_bad_arguments_name_the_field(device):
    x = torch.randn(2, 64, device=device)
    w = torch.randn(8, 64, device=device)
    with pytest.raises(ValueError, match="x: 17 rows"):
        gemv(torch.randn(17, 64, device=device), w)
    with pytest.raises(ValueError, match="config: the tensor-core kernel"):
        gemv(x, w, config=GemvConfig(8, 64, tensor_cores=True))
    with pytest.raises(ValueError, match="config: the CUDA-core kernel takes 1..4 rows"):
        gemv(torch.randn(5, 64, device=device), w, config=GemvConfig(8, 64))
    with pytest.raises(ValueError, match="prologue"):
        gemv(x, w, "gelu")
    with pytest.raises(ValueError, match="x: last dim 64"):
        gemv(x, w, "silu")
    with pytest.raises(ValueError, match="norm_weight"):
        gemv(x, w, "norm")
    with pytest.raises(TypeError, match="weight: dtype"):
        gemv(x, w.double())
    with pytest.raises(ValueError, match="residual"):
        gemv(x, w, residual=x)
    with pytest.raises(ValueError, match="x: last dim must be contiguous"):
        gemv(torch.randn(64, 2, device=device).t(), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prologue", ["none", "silu"])
def test_residual_add_epilogue(dtype, prologue, device, close):
    """add [T, N] (the residual stream) is summed before the output is rounded."""
    K = 70
    x, w, gen = _data(2, 33, K, dtype, device, k_in=2 * K if prologue == "silu" else K)
    add = torch.randn(2, 33, generator=gen).to(device, dtype)
    close(gemv(x, w, prologue, add=add), gemv_ref(x, w, prologue, add=add), dtype)
    with pytest.raises(ValueError, match="add: expected shape"):
        gemv(x, w, prologue, add=add[:, :5])


@pytest.mark.parametrize("prologue", ["none", "norm", "silu"])
@pytest.mark.parametrize("T", [2, 3, 4])
def test_cuda_core_rows_equal_tensor_core_rows(prologue, T, device, close):
    """MTP verify shapes (2..4 rows) give the same result on both kernels, each checked
    against the reference, with the residual add epilogue where the model uses it."""
    K, N = 96, 52
    x, w, gen = _data(T, N, K, torch.bfloat16, device, k_in=2 * K if prologue == "silu" else K,
                      stride_pad=3)
    kw: dict = {}
    if prologue == "norm":
        kw = {"residual": torch.randn(T, K, generator=gen).to(device, torch.bfloat16),
              "norm_weight": (torch.rand(K, generator=gen) + 0.5).to(device, torch.bfloat16)}
    else:
        kw = {"add": torch.randn(T, N, generator=gen).to(device, torch.bfloat16)}
    ref = gemv_ref(x, w, prologue, **kw)
    for cfg in (GemvConfig(4, 32), GemvConfig(16, 32, tensor_cores=True)):
        out = gemv(x, w, prologue, config=cfg, **kw)
        for got, want in zip(out if prologue == "norm" else (out,),
                             ref if prologue == "norm" else (ref,)):
            close(got, want, torch.bfloat16)


@pytest.mark.parametrize("prologue", ["none", "norm", "silu"])
@pytest.mark.parametrize("cfg", [GemvConfig(8, 64), GemvConfig(4, 32, num_warps=8),
                                 GemvConfig(16, 256), GemvConfig(2, 16, num_warps=1),
                                 GemvConfig(8, 32, num_stages=3), GemvConfig(8, 64, preload=True),
                                 GemvConfig(4, 256, preload=True),
                                 GemvConfig(8, 32, num_stages=3, preload=True)])
def test_one_row_kernel_equals_rows_kernel(prologue, cfg, device, close):
    """Batch 1 runs kernels/gemv_row.py's kernel (one_row=True, the default) whatever the
    tile: K steps wider than K, narrower than a thread's 8 columns, ragged N and K, the K
    loop pipelined through shared memory (num_stages 3), the first tile loaded before the PDL
    wait (preload: the step peeled off the loop; with a 256-wide step it is the only one),
    both residual fusions; the 1..4-row kernel (one_row=False) gives the same, each against
    the reference."""
    K, N = 203, 37
    x, w, gen = _data(1, N, K, torch.bfloat16, device, k_in=2 * K if prologue == "silu" else K,
                      stride_pad=5)
    kw: dict = {"add": torch.randn(1, N, generator=gen).to(device, torch.bfloat16)}
    if prologue == "norm":
        kw = {"residual": torch.randn(1, K, generator=gen).to(device, torch.bfloat16),
              "norm_weight": (torch.rand(K, generator=gen) + 0.5).to(device, torch.bfloat16)}
    ref = gemv_ref(x, w, prologue, **kw)
    for one_row in (True, False):
        out = gemv(x, w, prologue, config=replace(cfg, one_row=one_row), **kw)
        for got, want in zip(out if prologue == "norm" else (out,),
                             ref if prologue == "norm" else (ref,)):
            close(got, want, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k_repeated_launches_with_residual_add(dtype, device, close):
    """Split-K partials are summed by the last program of each output tile, which resets the
    tile's arrival counter: back-to-back launches (different shapes, same counters) each
    equal the reference, with the residual-add epilogue applied once."""
    for T, N, K, split in ((2, 70, 300, 4), (4, 33, 96, 2), (2, 70, 300, 4), (16, 48, 64, 3)):
        x, w, gen = _data(T, N, K, dtype, device, stride_pad=2)
        add = torch.randn(T, N, generator=gen).to(device, dtype)
        cfg = GemvConfig(16, 32, tensor_cores=True, split_k=split)
        close(gemv(x, w, add=add, config=cfg), gemv_ref(x, w, add=add), dtype)
    with pytest.raises(ValueError, match="split_k in 1..16"):
        gemv(x, w, config=GemvConfig(16, 32, tensor_cores=True, split_k=17))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,K", [(17000, 1100), (600, 9000)])
def test_default_tiles_fit_every_dtype(dtype, N, K, device, close):
    """The tiles pick_config chooses at 2 rows launch for fp32 too (on a GPU, 4 stages of
    64 x 256 fp32 tiles would exceed shared memory), wide (64 columns) and split-K shapes."""
    x, w, _ = _data(2, N, K, dtype, device)
    close(gemv(x, w), gemv_ref(x, w), dtype)


@pytest.mark.parametrize("T,cfg", [(1, GemvConfig(4, 64, l2_prefetch=1.0)),
                                   (1, GemvConfig(8, 32, l2_prefetch=0.3)),
                                   (2, GemvConfig(16, 32, tensor_cores=True, split_k=3,
                                                  l2_prefetch=1.0)),
                                   (3, GemvConfig(32, 64, tensor_cores=True, l2_prefetch=0.5))])
def test_l2_prefetch_leaves_results_unchanged(T, cfg, device, close):
    """Programs asking L2 for (a share of) their weight slice before the PDL wait, with
    ragged N and K (the prefetch addresses are clamped into W), on both kernels; and
    gemv(prefetch=True) with the default tiles. (The interpreter has no L2: there the
    prefetch is compiled out and only the plumbing runs.)"""
    x, w, gen = _data(T, 45, 157, torch.float32, device)
    add = torch.randn(T, 45, generator=gen).to(device)
    close(gemv(x, w, add=add, config=cfg), gemv_ref(x, w, add=add), torch.float32)
    close(gemv(x, w, add=add, prefetch=True), gemv_ref(x, w, add=add), torch.float32)


def test_prefetch_lines_cover_the_share_in_128_byte_lines():
    from pdserve.kernels._triton import prefetch_lines

    assert prefetch_lines(4096, 1, 1.0, 2) == 64  # a bf16 row of 8 KiB: 64 lines
    assert prefetch_lines(4096, 2, 1.0, 2) == 32  # each of 2 K parts: half a row
    assert prefetch_lines(12288, 4, 0.125, 2) == 8  # 3072 columns: 48 lines, an eighth: 6 -> 8
    assert prefetch_lines(157, 1, 1.0, 4) == 8  # ragged fp32 row: 5 lines -> a power of two
    assert prefetch_lines(4096, 1, 0.0, 2) == 0

"""gemv with FP8 weights (float8_e4m3fn + block scales) against gemv_ref on the dequantized
weight (kernels.reference.fp8_dequant_ref): odd sizes, partial blocks, every scale layout
(square blocks, per-row blocks of merged projections, per channel, per tensor), both ways a
program applies scales (kernels/fp8_scales.py SCALE 1 and 2), the prologues and epilogue."""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels.fp8_scales import FP8_DTYPE
from pdserve.kernels.gemv import GemvConfig
from pdserve.kernels.ops import gemv
from pdserve.kernels.reference import fp8_dequant_ref, gemv_ref


def fp8_weight(N: int, K: int, block: tuple[int, int], device, seed: int = 0):
    """A random W8 [N, K] and scales for `block` that vary from block to block."""
    gen = torch.Generator().manual_seed(seed + N * 7 + K)
    w8 = (torch.randn(N, K, generator=gen) * 64).clamp(-448, 448).to(FP8_DTYPE)
    grid = (-(-N // block[0]), -(-K // block[1]))
    scales = (torch.rand(grid, generator=gen) + 0.5) / (64 * K ** 0.5)
    return w8.to(device), scales.to(device)


def _x(T: int, k_in: int, dtype, device, seed: int = 1):
    gen = torch.Generator().manual_seed(seed + T * 31 + k_in)
    return torch.randn(T, k_in + 3, generator=gen)[:, :k_in].to(device, dtype)  # strided rows


BLOCKS = {"square": lambda N, K: (32, 64), "per_row": lambda N, K: (1, 64),
          "channel": lambda N, K: (1, K), "tensor": lambda N, K: (N, K)}


@pytest.mark.parametrize("layout", sorted(BLOCKS))
@pytest.mark.parametrize("T,N,K", [(1, 100, 300), (3, 45, 130), (4, 70, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain(layout, T, N, K, dtype, device, close):
    block = BLOCKS[layout](N, K)
    w8, s = fp8_weight(N, K, block, device)
    x = _x(T, K, dtype, device)
    y = gemv(x, w8, scales=s, block=block)
    assert y.shape == (T, N) and y.dtype == dtype
    close(y, gemv_ref(x, fp8_dequant_ref(w8, s, block).to(dtype)), dtype)


@pytest.mark.parametrize("T", [1, 2, 5])
@pytest.mark.parametrize("layout", ["square", "per_row", "tensor"])
def test_norm_prologue_with_residual_and_add(T, layout, device, close):
    N, K, dtype = 77, 200, torch.bfloat16
    block = BLOCKS[layout](N, K)
    w8, s = fp8_weight(N, K, block, device)
    x, res, add = _x(T, K, dtype, device), _x(T, K, dtype, device, 2), _x(T, N, dtype, device, 3)
    nw = torch.linspace(0.5, 1.5, K).to(device, dtype)
    y, h = gemv(x, w8, "norm", residual=res, norm_weight=nw, eps=1e-5, scales=s, block=block)
    y_ref, h_ref = gemv_ref(x, fp8_dequant_ref(w8, s, block).to(dtype), "norm", residual=res,
                            norm_weight=nw, eps=1e-5)
    close(h, h_ref, dtype)
    close(y, y_ref, dtype)
    y = gemv(x, w8, add=add.contiguous(), scales=s, block=block)
    close(y, gemv_ref(x, fp8_dequant_ref(w8, s, block).to(dtype), add=add), dtype)


@pytest.mark.parametrize("T", [1, 4])
def test_silu_prologue(T, device, close):
    N, K, dtype = 50, 136, torch.float32
    w8, s = fp8_weight(N, K, (1, 64), device)  # gate_up's per-row merged scales
    x = _x(T, 2 * K, dtype, device)
    close(gemv(x, w8, "silu", scales=s, block=(1, 64)),
          gemv_ref(x, fp8_dequant_ref(w8, s, (1, 64)), "silu"), dtype)


@pytest.mark.parametrize("T,cfg,block", [
    (1, GemvConfig(16, 256), (32, 64)),  # rows in one row block: SCALE 1, K step > bk
    (1, GemvConfig(64, 256), (32, 64)),  # rows span row blocks: SCALE 2, K step cut to 64
    (1, GemvConfig(16, 256, one_row=False), (32, 64)),  # the same on the 1..4-row kernel
    (1, GemvConfig(64, 256, one_row=False), (32, 64)),
    (1, GemvConfig(4, 512, num_warps=8), (1, 16)),  # per-row blocks, K step cut to 16 < 8 x 4
    (1, GemvConfig(8, 64), (200, 16)),  # K blocks narrower than the step, rows in one block
    (1, GemvConfig(8, 32, num_stages=4), (16, 32)),  # pipelined K loop, SCALE 1
    (1, GemvConfig(32, 64, num_stages=2), (1, 200)),  # per channel, pipelined: SCALE 2
    (1, GemvConfig(16, 64, preload=True), (32, 64)),  # first tile before the wait: SCALE 1
    (1, GemvConfig(64, 128, preload=True), (32, 64)),  # the same, SCALE 2
    # as pick_config's FP8 preload: registers capped (compiled only; the interpreter has none)
    (1, GemvConfig(4, 64, preload=True, maxnreg=64), (128, 128)),
    (1, GemvConfig(8, 32, vec=16), (128, 128)),  # 16 K columns per thread
    (2, GemvConfig(8, 128), (1, 32)),  # CUDA-core kernel with 2 rows, K step cut to 32
    (3, GemvConfig(16, 128, tensor_cores=True), (32, 64)),
    (3, GemvConfig(64, 64, tensor_cores=True, split_k=3), (32, 32)),
    (6, GemvConfig(32, 64, tensor_cores=True), (1, 200)),  # per channel
])
def test_explicit_tiles(T, cfg, block, device, close):
    N, K, dtype = 130, 200, torch.float32
    w8, s = fp8_weight(N, K, block, device)
    x = _x(T, K, dtype, device)
    close(gemv(x, w8, config=cfg, scales=s, block=block),
          gemv_ref(x, fp8_dequant_ref(w8, s, block)), dtype)


def test_bad_scales_are_refused_by_name(device):
    w8, s = fp8_weight(40, 64, (16, 32), device)
    x = _x(1, 64, torch.float32, device)
    with pytest.raises(ValueError, match="needs its scales"):
        gemv(x, w8)
    with pytest.raises(ValueError, match="weight_scale: expected shape"):
        gemv(x, w8, scales=s[:, :1], block=(16, 32))
    with pytest.raises(TypeError, match="weight_scale: dtype"):
        gemv(x, w8, scales=s.double(), block=(16, 32))
    with pytest.raises(ValueError, match="must be a power of two"):
        gemv(x, w8, scales=torch.ones(3, 2, device=device), block=(16, 48))


@pytest.mark.parametrize("kernel", ["one_row", "rows", "tensor_cores"])
def test_every_e4m3_value_decodes_exactly(kernel, device):
    """Each kernel's e4m3 decode (the one-row kernel: Triton's e4m3 -> f16 -> f32 conversion;
    the others: integer ops, fp8_scales.fp8_bits_f32): each of the 254 finite byte values
    (zeros, subnormals, both signs, +-448) times a one-hot x gives back float(W8) x scale
    exactly (scales are powers of two, float32 accumulate)."""
    codes = [c for c in range(256) if c & 0x7F != 0x7F]  # 0x7f / 0xff are e4m3's NaNs
    N, K = len(codes), 32
    w8 = torch.zeros(N, K, dtype=torch.uint8)
    w8[:, 5] = torch.tensor(codes, dtype=torch.uint8)
    w8 = w8.view(FP8_DTYPE).to(device)
    s = torch.full((1, 1), 2.0 ** -5, device=device)
    T = 2 if kernel == "tensor_cores" else 1
    x = torch.zeros(T, K, device=device)
    x[:, 5] = 1.0
    cfg = GemvConfig(16, 32, tensor_cores=kernel == "tensor_cores", one_row=kernel == "one_row")
    y = gemv(x, w8, config=cfg, scales=s, block=(N, K))
    want = w8[:, 5].float() * 2.0 ** -5
    assert torch.equal(y, want.expand(T, N))  # tf32 / bf16 tl.dot keep e4m3's 3 mantissa bits

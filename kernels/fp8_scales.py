"""FP8 (e4m3) weights with block scales, as the kernels read them (GEMV, GEMM, fused MoE).

A weight W8 float8_e4m3fn [N, K] (per expert: [E, N, K]) comes with a float32 scale grid
[ceil(N / bn), ceil(K / bk)] for a block (bn, bk): the real weight is W8 times its block's
scale (engine/model/fp8.py). Per-channel scales are block (1, K), per-tensor (N, K), merged
projections with unaligned sources per-row (1, bk).

Kernels take the block as two constexprs S_BN, S_BK, normalised so that a block as tall or as
wide as the whole matrix becomes a power of two >= the dimension (same grid index 0, shifts
instead of divisions). A program applies the scales one of two ways (SCALE):
  1  all its BLOCK_N rows lie in one row block (S_BN % BLOCK_N == 0): one scale per K lane,
     a 1-D gather along K per step, multiplied into the activation (cheapest: T rows, not
     BLOCK_N);
  2  each BLOCK_K step lies in one K block (S_BK % BLOCK_K == 0): one scale per output row,
     a 1-D gather along N per step, multiplied into the weight tile.
Per-row blocks (1, bk) take 2 with BLOCK_K <= bk; 128 x 128 blocks take either.

Decoding e4m3, two ways. The one-row GEMV (kernels/gemv_row.py) uses Triton's conversion:
in sm_90 SASS one F2FP per two weights (e4m3x2 -> f16x2) and one HADD2.F32 per weight
(f16 -> f32, on the FMA pipe, not a conversion unit), no integer ops. The 1..4-row GEMV and
the tensor-core dequantization (fp8_dequant_tile) use fp8_bits_f32: the byte's bits moved
into an fp32 word by integer ops, exact, reading as the e4m3 value times 2^-120 (subnormals
as fp32 denormals, which Triton's fp32 multiplies keep), with the 2^120 folded into the scales
(BITS_HI x BITS_LO, split so that neither a scaled activation nor a partial sum leaves fp32's
range). In the 1..4-row kernel's SASS that is ~4.4 integer instructions per weight (byte
extracts, shifts, masks; 283 per 64 weights at 8 x 1024): with its shared-memory round trip
per tile, what held the FP8 GEMV at 1.9-2.5 TB/s on an H200 (kernels/gemv_row.py's doc).
"""
from __future__ import annotations

import torch
import triton.language as tl

from pdserve.kernels._triton import check_tensor, is_pow2, jit, next_pow2

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
Block = tuple[int, int]
# fp8_bits_f32's words are the weight times 2^-120: the kernels multiply the scales by
# BITS_HI = 2^64 and the fp32 result by BITS_LO = 2^56 (powers of two: exact)
BITS_HI = tl.constexpr(2.0 ** 64)
BITS_LO = tl.constexpr(2.0 ** 56)


def kernel_block(block: Block, N: int, K: int) -> Block:
    """(S_BN, S_BK): the block with whole-matrix sides widened to a power of two (see doc)."""
    bn, bk = block
    return (next_pow2(N) if bn >= N else bn, next_pow2(K) if bk >= K else bk)


def scale_mode(block: Block, N: int, K: int, block_n: int, block_k: int) -> int:
    """SCALE for a tile (block_n, block_k) over a weight [N, K] in `block`; 0 when neither way
    fits (the caller shrinks block_k)."""
    s_bn, s_bk = kernel_block(block, N, K)
    if s_bn % block_n == 0:
        return 1
    return 2 if s_bk % block_k == 0 else 0


def fit_block_k(block: Block, N: int, K: int, block_n: int, block_k: int) -> int:
    """block_k, shrunk (halved) until the tile has a scale mode; ValueError naming the block
    when none exists (a K block that is not a power of two and narrower than K)."""
    while scale_mode(block, N, K, block_n, block_k) == 0:
        if block_k <= 16 or block_k % 2:
            raise ValueError(f"scales: block {block} of a weight [{N}, {K}] has no kernel tile "
                             f"(a K block must be a power of two, or cover K)")
        block_k //= 2
    return block_k


def check_scales(weight: torch.Tensor, scales: torch.Tensor | None, block: Block | None,
                 name: str = "weight") -> None:
    """An FP8 weight [..., N, K] needs float32 scales [..., ceil(N / bn), ceil(K / bk)] on its
    device; a float weight takes none."""
    if weight.dtype != FP8_DTYPE:
        if scales is not None or block is not None:
            raise ValueError(f"{name}_scale: given for a {weight.dtype} {name} (FP8 only)")
        return
    if scales is None or block is None:
        raise ValueError(f"{name}: float8_e4m3fn needs its scales and block")
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"block: expected (bn, bk) >= 1, got {block}")
    n, k = weight.shape[-2], weight.shape[-1]
    grid = (*weight.shape[:-2], -(-n // block[0]), -(-k // block[1]))
    check_tensor(f"{name}_scale", scales, shape=grid, dtypes=(torch.float32,),
                 device=weight.device, last_contiguous=True)
    if weight.dim() == 3 and not scales.is_contiguous():
        raise ValueError(f"{name}_scale: must be contiguous, strides {scales.stride()}")
    bk = kernel_block(block, n, k)[1]
    if not (is_pow2(bk) and bk >= 16):
        raise ValueError(f"block: K side {block[1]} must be a power of two >= 16 or cover K = {k}")


@jit
def fp8_bits_f32(w):
    """A W8 tile loaded as int8 (the e4m3 bytes) -> fp32 words that read as the e4m3 values
    times 2^-120, by integer ops alone (see the module doc). The sign-extended byte shifted
    left 20 puts the sign at bit 31 (and copies at 27..30, masked off) and exponent and
    mantissa at 26..20, right under fp32's exponent bias. e4m3's NaN (0x7f) becomes 480
    (quantizers never write it)."""
    b = w.to(tl.int32)
    return ((b << 20) & -2014314496).to(tl.float32, bitcast=True)  # mask 0x87F00000


@jit
def fp8_scale_k(t, s_ptr, row_block, k0, K, stride_s, mult, ROWS: tl.constexpr,
                BLOCK_K: tl.constexpr, S_BK: tl.constexpr):
    """SCALE 1: t [ROWS, BLOCK_K] (the K lanes k0 ..) times the scales of row block
    `row_block` times `mult`, fp32. The BLOCK_K // S_BK scales of the step are loaded once and
    broadcast over a [ROWS, G, BLOCK_K // G] view: a gather per K lane cost one scalar load
    per element a thread holds (FP8 GEMV at 2.1 TB/s on an H200 where bf16 read 3.9)."""
    G: tl.constexpr = BLOCK_K // S_BK if BLOCK_K > S_BK else 1
    g = tl.arange(0, G)
    s = tl.load(s_ptr + row_block * stride_s + k0 // S_BK + g, mask=k0 + g * S_BK < K, other=0.0)
    t3 = tl.reshape(t.to(tl.float32), [ROWS, G, BLOCK_K // G])
    return tl.reshape(t3 * (s * mult)[None, :, None], [ROWS, BLOCK_K])


@jit
def fp8_n_scales(s_ptr, offs_n, N, k0, stride_s, S_BN: tl.constexpr, S_BK: tl.constexpr):
    """SCALE 2: the scales of rows offs_n for the K block holding column k0, fp32 [BLOCK_N]."""
    return tl.load(s_ptr + (offs_n // S_BN) * stride_s + k0 // S_BK, mask=offs_n < N, other=0.0)


@jit
def fp8_dequant_tile(w, s_ptr, offs_n, N, K, k0, stride_s, row_block, SCALE: tl.constexpr,
                     S_BN: tl.constexpr, S_BK: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    """A W8 tile [BLOCK_N, BLOCK_K] loaded as int8, times its scales: the real weights, fp32
    (for a 16-bit tl.dot)."""
    wb = fp8_bits_f32(w)
    if SCALE == 1:
        wb = fp8_scale_k(wb, s_ptr, row_block, k0, K, stride_s, BITS_HI, BLOCK_N, BLOCK_K, S_BK)
    else:
        wb = wb * (fp8_n_scales(s_ptr, offs_n, N, k0, stride_s, S_BN, S_BK) * BITS_HI)[:, None]
    return wb * BITS_LO

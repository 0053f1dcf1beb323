"""The decode attention kernel's launch shape (kernels/decode_attention.py): how many
split programs per (sequence, KV head), and the tile shape per cache dtype, with the
measurements that chose them."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from pdserve.kernels._triton import num_sms
from pdserve.kernels.kv_quant import FP8

MAX_SPLITS = 64


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, block_n: int,
                      device: torch.device, waves: int = 1) -> int:
    """About `waves` waves of (sequence, KV head, split) programs on the GPU, never more
    splits than key tiles. With the merge inside the kernel, more splits cost: at batch 1 on
    an H100 (Qwen3-8B, 640-token context), 64 splits took 0.61 ms per step in attention, 32
    took 0.47, 16 0.36 and 8 0.41 (bench/results/diag_decode_h100_2026-11-23_run5.json,
    _run6). A power of 2 computed from host shapes only: a CUDA graph replays the same choice,
    and few distinct values reach the kernel's specialisations."""
    if device.type == "cuda":
        sms = num_sms(torch.cuda.current_device() if device.index is None else device.index)
    else:
        sms = 32  # interpreter: the choice only has to be valid
    want = triton.cdiv(sms * waves, max(1, batch * num_kv_heads))
    tiles = triton.cdiv(max(1, max_context), block_n)
    n = max(1, min(want, tiles, MAX_SPLITS))
    return 1 << (n.bit_length() - 1)


FP8_LOADS = ("cast", "v_words", "kv_words", "kv_quarters")


@dataclass(frozen=True)
class DecodeTiles:
    """The decode kernel's launch shape: keys per tile, warps per program, pipeline stages,
    waves of split programs at small batch (choose_num_splits), how an fp8 cache's tiles
    become fp16 tl.dot operands (decode_attention_tiles.py): "cast" (tl's conversion of the
    fp8 tile), "v_words" / "kv_words" (V, or K and V, read as int32 words and converted by
    PTX in the loaded layout), "kv_quarters" (K and V as words, never joined: one dot per
    quarter of head_dim; head_dim >= 64, else kv_words), and an optional per-thread register
    cap for ptxas (max_regs: more programs per SM at the price of a few spills)."""

    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    waves: int = 1
    fp8_loads: str = "cast"
    max_regs: int | None = None  # ptxas register cap per thread (more programs per SM)

    def __post_init__(self) -> None:
        for name in ("block_n", "num_warps", "waves"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1 or value & (value - 1):
                raise ValueError(f"tiles.{name}: {value!r} must be a power of 2 >= 1")
        if self.block_n < 16:
            raise ValueError(f"tiles.block_n: {self.block_n} must be >= 16 (tl.dot)")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"tiles.num_stages: {self.num_stages!r} must be an int >= 1")
        if self.fp8_loads not in FP8_LOADS:
            raise ValueError(f"tiles.fp8_loads: {self.fp8_loads!r} not in {FP8_LOADS}")
        if self.max_regs is not None and not (isinstance(self.max_regs, int)
                                              and 64 <= self.max_regs <= 255):
            raise ValueError(f"tiles.max_regs: {self.max_regs!r} must be an int in [64, 255]")


def decode_tiles(q_dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int,
                 prefetch: bool = False) -> DecodeTiles:
    """Tile shape by the cache's dtype (its bytes per tile), not q's. bf16/fp16 at D=128:
    64-key tiles (32 KB of K+V per step); fp32 and D=256 halve the tile. H200 sweep (batch
    1-8, 2K-10K contexts): 2 stages beat 3-4 by up to 20%. fp8 at D <= 128: 128-key tiles,
    kv_quarters, 2 stages, <= 168 registers (3 programs per SM): batch 256 x 4K (Qwen3-8B,
    H200) 0.737 / 0.754 ms per layer plain / fused, 0.878 / 0.890 before (kv_words, 1 stage;
    bench/results/attention_fp8_quarters_h200_2026-11-25.json); 2 waves of splits at small
    batch. With `prefetch` (the fused prologue at small batch holds a split's first
    tile in registers across the PDL wait; fp8 64-key tiles: 128 spill) a short split is a
    latency chain: bf16 takes 8 warps and 2 waves (attention per layer, batch 1: 6.9 -> 4.0
    us at 576 keys, 21.4 -> 16.8 at 8K; bench/results/b1_attention_h200_2026-11-25.json)."""
    if cache_dtype == FP8 and q_dtype != torch.float32 and head_dim <= 128:
        if prefetch:
            return DecodeTiles(64, 4, 2, waves=2, fp8_loads="kv_words")
        return DecodeTiles(128, 4, 2, waves=2, fp8_loads="kv_quarters", max_regs=168)
    block_n = 64 if q_dtype != torch.float32 and head_dim <= 128 else 32
    return DecodeTiles(64, 8, 2, 2) if prefetch and block_n == 64 else DecodeTiles(block_n, 4, 2)

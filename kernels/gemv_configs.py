"""Tile choice for kernels.gemv: GemvConfig, the per-device tables of measured one-row tiles,
and the rules for shapes they do not list (pick_config, pick_dot_config).

A device whose name has an entry in DEVICE_TILES / FP8_DEVICE_TILES takes its own measured
one-row tile for the shapes listed there (device_tile; the H200 has Qwen3-8B's); other shapes
and devices take the rules (the 16-bit one from an H100 sweep, the FP8 one from the H200's).
`python -m bench.lab.bench_gemv --one-row` measures them on the device at hand, and
`python -m bench.lab.bench_fp8 --gemv-stages` installs the winners for one benchmark run.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton

from pdserve.kernels._triton import interpreting, next_pow2

# gemv(prefetch=True): the share of each program's weight slice asked into L2 before its PDL
# wait (see gemv)
PREFETCH_SHARE = 1.0


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int = 4
    # tensor-core kernel: Triton's pipeline depth; one-row kernel: > 1 streams the K loop's
    # next tiles through shared memory (cp.async; measured slower, see kernels/gemv_row.py)
    num_stages: int = 1
    # 2+ rows: tl.dot on the tensor cores (prologue as its own kernel) instead of the
    # CUDA-core kernel with the prologue fused (which 1 row always takes)
    tensor_cores: bool = False
    # weights are read once per step: loaded evict-first so they do not push the activation
    # rows (read by every program) out of the caches
    stream_weights: bool = True
    # tensor-core kernel: K split over this many programs per output tile, the last to finish
    # summing the fp32 partials (more programs in flight for narrow, deep matrices)
    split_k: int = 1
    # share of each program's weight slice asked into L2 before the PDL wait (0: none); set
    # by gemv(prefetch=True) for a launch behind a latency-bound kernel
    l2_prefetch: float = 0.0
    # 1 row: the one-row kernel (kernels/gemv_row.py); False: the 1..4-row CUDA-core kernel
    one_row: bool = True
    # one-row kernel: the first K step's weight tile is loaded before the PDL wait, so a
    # launch's first bytes are in flight while the kernel before it drains
    preload: bool = False
    # one-row kernel: K columns per thread (0: one 16-byte activation load, 8 for bf16 x)
    vec: int = 0
    # one-row kernel: ptxas register cap per thread (0: none); fewer registers, more
    # programs resident per SM
    maxnreg: int = 0


# One-row tiles (kernels/gemv_row.py) measured on a device at given shapes, where they beat
# pick_config's H100 rule by >= 3%: {device name fragment: {(N, K): (block_n, block_k,
# num_warps[, num_stages])}}. Shapes not listed keep the rule.
# H200 at Qwen3-30B-A3B's shapes, measured on the 1..4-row kernel before the one-row kernel
# existed (`python -m bench.lab.bench_moe --sweep`, bench/results/moe_h200_2026-11-25_tuned.json,
# 7 tiles each): o_proj 2048 x 4096 8.33 -> 6.96 us with whole-row-half K steps; qkv 5120 x 2048
# kept the rule's 4 x 1024 (8.58 us; 2048-wide steps 10.6); lm_head 151936 x 2048 within 3%
# (4 x 1024: 144.8 us = 4.3 TB/s, the rule's 8 x 1024: 148.1).
# H200 at Qwen3-8B's shapes, the one-row kernel (kernels/gemv_row.py), each projection called
# as the decoder calls it (`python -m bench.lab.bench_gemv --one-row`,
# bench/results/gemv_one_row_h200_2026-11-25.json; spread between repeats of one tile ~3%):
# qkv 6144 x 4096 16.2 -> 14.5 us, o 4096 x 4096 13.3 -> 11.4, down 4096 x 12288 28.6 ->
# 25.4; gate_up and lm_head keep the rule (8 x 1024: 49.0 and 275 us, within 3% of the best).
# Re-chosen in the whole decode step once 16-bit GEMVs preload their first tile (pick_config;
# bench/results/diag_preload_h200_2026-11-25.json): o_proj 4096 x 4096 16 x 1024 -> 8 x 2048
# (Qwen3-8B step 3.926 -> 3.896 ms), 2048 x 4096 4 x 2048 -> 2 x 4096 (Qwen3-30B-A3B 2.517
# -> 2.504), down 4096 x 12288 4 x 2048 -> 8 x 2048 on 8 warps (Qwen3-8B 3.936 -> 3.892,
# "qwen3_8b_bf16_mlp_lm_head_tiles"); q/k/v in one K step, other gate_up and LM head tiles
# were no faster.
DEVICE_TILES: dict[str, dict[tuple[int, int], tuple[int, ...]]] = {
    "H200": {(2048, 4096): (2, 4096, 4), (6144, 4096): (8, 2048, 8),
             (4096, 4096): (8, 2048, 8), (4096, 12288): (8, 2048, 8)},
}
# The same for FP8 weights (kernels/fp8_scales.py), where they beat pick_config's FP8 rule
# (Qwen3-8B's shapes on the H200, as above: qkv 4 x 2048 9.8 us, o 4 x 2048 6.6, down
# 16 x 2048 on 8 warps 14.7; gate_up keeps the rule's 8 x 1024, 27.3).
FP8_DEVICE_TILES: dict[str, dict[tuple[int, int], tuple[int, ...]]] = {
    "H200": {(6144, 4096): (4, 2048, 4), (4096, 4096): (4, 2048, 4),
             (4096, 12288): (16, 2048, 8)},
}


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_entry(tables: dict[str, dict], device: torch.device | None, key: object):
    """tables[fragment][key] for the first fragment in this CUDA device's name, else None
    (no device, the interpreter, another device, a key not listed). The per-device tile
    tables of the decode kernels (here, kernels.moe_route, kernels.moe_gemm) use it."""
    if device is None or device.type != "cuda" or interpreting():
        return None
    name = _device_name(device.index if device.index is not None else torch.cuda.current_device())
    return next((t.get(key) for frag, t in tables.items() if frag in name), None)


def device_tile(N: int, K: int, device: torch.device | None, elem_size: int = 2
                ) -> GemvConfig | None:
    """The measured one-row tile of DEVICE_TILES (16-bit weights) or FP8_DEVICE_TILES (FP8)
    for this device and shape, if any."""
    tables = {2: DEVICE_TILES, 1: FP8_DEVICE_TILES}.get(elem_size)
    tile = None if tables is None else device_entry(tables, device, (N, K))
    if tile is None:
        return None
    return GemvConfig(tile[0], tile[1], num_warps=tile[2],
                      num_stages=tile[3] if len(tile) > 3 else 1)


def pick_config(N: int, K: int, T: int, elem_size: int = 2, prefetch: bool = False,
                device: torch.device | None = None) -> GemvConfig:
    """Tile for y[T, N] = a[T, K] @ W[N, K]^T. One row (kernels/gemv_row.py): this device's
    DEVICE_TILES / FP8_DEVICE_TILES entry for (N, K) where there is one, else _one_row_rule.
    Two or more rows (the tensor-core kernel): see pick_dot_config.
    The CPU interpreter runs one program at a time, so there few big tiles are fastest.
    prefetch: the launch follows a latency-bound kernel (see gemv); the interpreter has no L2.
    device: where the table lookup happens (None: the rule)."""
    tile = device_tile(N, K, device, elem_size) if T == 1 else None
    if T > 1:
        cfg = pick_dot_config(N, K, elem_size)
    elif tile is not None:
        cfg = tile
    elif interpreting():
        cfg = GemvConfig(min(64, next_pow2(N)), min(256, next_pow2(K)))
    else:
        cfg = _one_row_rule(N, K, elem_size)
    if prefetch and not interpreting():
        cfg = replace(cfg, l2_prefetch=PREFETCH_SHARE)
    return _with_preload(cfg, K, elem_size) if T == 1 else cfg


def _with_preload(cfg: GemvConfig, K: int, elem_size: int) -> GemvConfig:
    """One-row GEMVs load their first weight tile before the PDL wait. H200, batch-1 decode
    graph replay incl. LM head, round-robin medians of 7 (`python -m bench.lab.diag_decode
    --variants preload --no-engine`, bench/results/diag_preload_h200_2026-11-25.json):
    Qwen3-8B bf16 4.059 -> 3.929 ms, Qwen3-30B-A3B bf16 2.590 -> 2.515.
    FP8 tiles are small (8 KB), and the preloaded one raised the kernel's registers (o_proj
    62 -> 72, gate_up 64 -> 80): 6-7 instead of 8 programs of 4 warps per SM, so o_proj's
    1024 programs no longer ran in one wave, and the step got slower (2.552 -> 2.649 ms).
    Capped at 64 registers (ptxas, no spills at 4 x 2048 and 8 x 1024) it gains: 2.574 ->
    2.542 and 2.535 -> 2.515 ms in two runs; the 8-warp down_proj (16 x 2048, 128
    registers, 2 programs per SM either way) gained nothing and keeps no preload. Nor does
    a GEMV done in one K step (Qwen3-30B-A3B's q/k/v, 5120 x 2048), whose preload is the
    whole matrix read while the kernel before still streams: its FP8 step 1.814 -> 1.835 ms
    with it, 1.810 without (bench/results/fp8_b1_probes_h200_2026-11-26.json)."""
    if elem_size > 1:
        return replace(cfg, preload=True)
    if cfg.num_warps == 4 and cfg.block_n * cfg.block_k <= 8192 and K > cfg.block_k:
        return replace(cfg, preload=True, maxnreg=64)
    return cfg


def _one_row_rule(N: int, K: int, elem_size: int) -> GemvConfig:
    """The one-row tile for shapes no device table lists. 16-bit, from a sweep on an H100 at
    Qwen3-8B's shapes with the 1..4-row kernel (bench/results/gemv_sweep_h100_2026-11-22.json;
    not re-swept with the one-row kernel on an H100): 1024-wide K steps and 4 warps won
    everywhere, 8 output columns per program on the big matrices (gate_up, down, lm_head) and
    4 on the small (q/k/v, o); narrow matrices shrink BLOCK_N so that ~2 programs per SM
    exist. FP8 (elem_size 1), the one-row kernel on an H200 at Qwen3-8B's shapes
    (bench/results/gemv_one_row_h200_2026-11-25.json): 2048-wide K steps on 4 output rows for
    the small matrices (qkv 9.8 us, o 6.6), 8 x 1024 for the wide one (gate_up 27.3), 16 x 2048
    on 8 warps for the deep one (down 14.7); the 1..4-row kernel's 8 x 1024 took 13.5, 8.4,
    39.8 and 23.1 us. The H200 also lists these shapes in FP8_DEVICE_TILES, so the rule
    may change without moving it."""
    if elem_size == 1:
        if K >= 8192:
            block_n, block_k, warps = 16, 2048, 8
        elif N * K >= (64 << 20):
            block_n, block_k, warps = 8, 1024, 4
        else:
            block_n, block_k, warps = 4, 2048, 4
    else:
        block_n, block_k, warps = (8 if N * K >= (32 << 20) else 4), 1024, 4
    block_k = min(block_k, next_pow2(K))
    while block_n > 1 and triton.cdiv(N, block_n) < 256:  # ~2 programs per SM at least
        block_n //= 2
    return GemvConfig(block_n, block_k, num_warps=warps)


def pick_dot_config(N: int, K: int, elem_size: int = 2) -> GemvConfig:
    """Tile of the tensor-core kernel (2..16 rows), from a sweep at 2 rows on an H100 over
    output widths, K steps, pipeline depths and K splits at Qwen3-8B's shapes
    (bench/results/gemv_dot_split_sweep_h100_2026-11-24.json): 64 columns per program where
    that still leaves >= 264 programs (gate_up 70.8 -> 70.0 us, lm_head 406 -> 400), else 32;
    narrow matrices (< 192 programs) split K so that >= 256 programs run: o_proj in 2
    (14.2 -> 13.7 us), down_proj (K = 12288) in 4 with 128-wide K steps (39.2 -> 37.4).
    fp32 (elem_size 4) halves the K step: 4 stages of 64 x 256 fp32 tiles exceed an H100's
    shared memory."""
    if interpreting():
        return GemvConfig(min(64, max(16, next_pow2(N))), min(128, max(16, next_pow2(K))),
                          tensor_cores=True)
    block_n = 64 if triton.cdiv(N, 64) >= 264 else 32
    grid_n = triton.cdiv(N, block_n)
    wide = 2 if elem_size <= 2 else 1  # 256- or 128-wide K steps
    if grid_n >= 192 or K < 1024:
        return GemvConfig(block_n, min(128 * wide, next_pow2(K)), num_warps=4, num_stages=4,
                          tensor_cores=True)
    split = 4 if K >= 8192 else 2
    return GemvConfig(block_n, 64 * wide, num_warps=4, num_stages=3 if split == 4 else 4,
                      tensor_cores=True, split_k=split)


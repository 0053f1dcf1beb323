"""Fresh-prompt prefill attention through PyTorch SDPA (cuDNN / FlashAttention backends).

A prompt with no cached prefix, prefilled in one chunk, is plain causal self-attention over a
square [S, S]: the case the vendor kernels are tuned for (cuDNN's Hopper kernels reach well
above our paged Triton kernel's ~400 TFLOP/s at 10K tokens, see bench/results). So for one
such sequence of >= MIN_TOKENS tokens on CUDA, the backend gathers the sequence's K/V blocks
into contiguous [S, Hkv, D] tensors (~2 x 21 MB per layer at 10K for an 8B model: tens of
microseconds) and calls SDPA; everything else (prefix hits, later chunks, mixed batches,
decode) stays on the paged Triton kernels, which compute the same function.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from pdserve.kernels.kv_quant import KVScales, dequant_blocks

if TYPE_CHECKING:
    from pdserve.engine.model.attention import AttentionMetadata

log = logging.getLogger(__name__)

MIN_TOKENS = 1024  # below this the gather + dispatch is not worth it
PLAN_STEPS = 8  # sequence lengths per power of two that SDPA runs at (padded_len)
BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
            SDPBackend.EFFICIENT_ATTENTION]


def applies(q: torch.Tensor, meta: AttentionMetadata) -> bool:
    """One sequence, all of it new this step (no cached prefix), long enough, on CUDA."""
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
            and len(meta.query_lens_cpu) == 1
            and meta.query_lens_cpu[0] == meta.seq_lens_cpu[0] >= MIN_TOKENS)


def fresh_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            meta: AttentionMetadata, scale: float,
                            kv_scales: KVScales | None = None) -> torch.Tensor:
    """q [S, Hq, D] of one fresh sequence over its S cached keys -> [S, Hq, D] (a strided
    view; callers reshape). k_cache/v_cache: [NB, BS, Hkv, D] layer views; an fp8 cache's
    blocks are dequantized (kv_scales) in the gather, so SDPA attends over what the paged
    kernels would read."""
    S, bs = meta.seq_lens_cpu[0], k_cache.shape[1]
    blocks = meta.block_tables[0, :-(-S // bs)].long()
    if kv_scales is not None:
        k = dequant_blocks(k_cache, kv_scales.k, blocks, q.dtype).flatten(0, 1)[:S]
        v = dequant_blocks(v_cache, kv_scales.v, blocks, q.dtype).flatten(0, 1)[:S]
    else:
        k = k_cache[blocks].flatten(0, 1)[:S]  # [S, Hkv, D] contiguous gather
        v = v_cache[blocks].flatten(0, 1)[:S]
    return causal_attention(q, k, v, scale)


def padded_len(s: int) -> int:
    """s rounded up to one of PLAN_STEPS lengths per power of two (under 1/PLAN_STEPS more
    rows). cuDNN builds an execution plan for each new sequence length, ~40 ms on an H200,
    which every prompt of a new length paid in its prefill step
    (bench/results/jit_h200_2026-11-29.json); the start-up warm-up builds these few."""
    step = max(1, (1 << (s.bit_length() - 1)) // PLAN_STEPS)
    return -(-s // step) * step


def plan_lengths(max_len: int) -> list[int]:
    """The shortest prompt of each padded length from MIN_TOKENS up to max_len: one fresh
    prefill of each builds every plan a prompt of <= max_len tokens can need."""
    out, s = [], MIN_TOKENS
    while s <= max_len:
        out.append(s)
        s = padded_len(s) + 1
    return out


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     backends: list[SDPBackend] = BACKENDS) -> torch.Tensor:
    """Causal SDPA of q [S, Hq, D] over k, v [S, Hkv, D] -> [S, Hq, D] (a strided view),
    computed at padded_len(S) rows: rows appended after a causal sequence change nothing
    before them, so the first S rows are exact."""
    S = q.shape[0]
    pad = padded_len(S) - S
    if pad:  # [S, H, D] -> [S + pad, H, D], zeros at the end
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
    with sdpa_kernel(backends):
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            is_causal=True, scale=scale, enable_gqa=True)  # [1, Hq, S + pad, D]
    return o[0].transpose(0, 1)[:S]

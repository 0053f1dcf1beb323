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
    with sdpa_kernel(BACKENDS):
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            is_causal=True, scale=scale, enable_gqa=True)  # [1, Hq, S, D]
    return o[0].transpose(0, 1)

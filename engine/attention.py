"""Attention metadata for one engine step over the paged KV cache, and the torch reference.

KV cache layout (one tensor per worker, allocated once):
    kv_cache: [num_blocks, num_kv_layers, 2, block_size, num_kv_heads, head_dim]
One block = all layers, K and V, contiguous -- so a KV transfer moves whole blocks as single
regions (see DESIGN.md, KV transfer). A layer's view kv_cache[:, layer, 0] is
[num_blocks, block_size, num_kv_heads, head_dim] with a large block stride.

A step packs the new tokens of all scheduled sequences into one flat batch of T tokens
(varlen, no padding): sequence i owns rows query_start_loc[i]:query_start_loc[i+1] and,
after this step, has seq_lens[i] tokens of context (cached + new), the new ones last.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset where each new token's K/V goes
    query_start_loc: torch.Tensor  # [B + 1] int32 cumulative new-token counts
    seq_lens: torch.Tensor  # [B] int32 context length after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # host copies so the torch path loops without device syncs
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

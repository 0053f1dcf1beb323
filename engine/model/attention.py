"""Attention metadata for one engine step over the paged KV cache, and the torch reference.

KV cache layout (one tensor per worker, allocated once; engine/exec/kv_cache.py):
    kv_cache: [num_blocks, num_kv_heads, num_kv_layers (+ fp8 scale layers), 2, block_size, head_dim]
One block = all layers, K and V, contiguous -- so a KV transfer moves whole blocks as single
regions (see docs/design.md, KV transfer) -- and inside it each KV head's part is contiguous
too (a tensor-parallel peer pulls just its heads). A layer's K view (kv_cache.layer_views) is
[num_blocks, block_size, num_kv_heads, head_dim], strided.

A step packs the new tokens of all scheduled sequences into one flat batch of T tokens
(varlen, no padding): sequence i owns rows query_start_loc[i]:query_start_loc[i+1] and,
after this step, has seq_lens[i] tokens of context (cached + new), the new ones last.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from pdserve.kernels.kv_quant import KVScales, cache_is_fp8, dequant_blocks, write_kv_fp8_ref


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
    # set by Model.rope on the fused path: [T] positions into the RoPE tables that the layers
    # then get as cos/sin (the attention kernels pick each token's row); None: per-token rows
    rope_positions: torch.Tensor | None = None

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @functools.cached_property
    def uniform_query_len(self) -> int:
        """R when every sequence brings exactly R new tokens (decode: 1; an MTP verify step:
        k + 1), else 0. From the host lists, once per step (every layer asks)."""
        r = self.max_query_len
        return r if all(n == r for n in self.query_lens_cpu) else 0


@dataclass
class HostBatch:
    """One step's flat inputs while still on the host (ModelRunner builds it from the
    scheduler's output). CUDA-graph steps stage it into the graphs' static buffers through
    pinned memory; other steps turn it into device tensors with to_device()."""

    input_ids: list[int]  # [T]
    positions: list[int]  # [T]
    slots: list[int]  # [T] cache slot of each new token
    query_lens: list[int]  # [B]
    seq_lens: list[int]  # [B] context length after this step
    block_tables: list[list[int]]  # [B][blocks needed], unpadded
    block_size: int

    @functools.cached_property
    def widest(self) -> int:
        """Blocks in the longest block table: the width a padded table needs (a step asks it
        up to three times: to_device, or the CUDA graphs' fit and their replay)."""
        return max(len(t) for t in self.block_tables)

    def to_device(self, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids [T] int64, positions [T] int64, metadata) on `device`."""
        padded = [t + [0] * (self.widest - len(t)) for t in self.block_tables]
        qsl = [0]
        for q in self.query_lens:
            qsl.append(qsl[-1] + q)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(self.slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
            max_query_len=max(self.query_lens), max_seq_len=max(self.seq_lens),
            query_lens_cpu=self.query_lens, seq_lens_cpu=self.seq_lens,
            block_size=self.block_size)
        return (torch.tensor(self.input_ids, dtype=torch.int64, device=device),
                torch.tensor(self.positions, dtype=torch.int64, device=device), meta)


# --------------------------------------------------------------------------------------------
# Torch reference path. The Triton kernels (kernels/) replace write_kv and paged_attention_torch
# through an attention backend with the same two methods (see TorchAttentionBackend).
# --------------------------------------------------------------------------------------------

def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scales: KVScales | None = None) -> None:
    """Scatter the new tokens' K/V into one layer's paged cache.

    k, v: [T, Hkv, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D] (strided views of the
    whole cache, so the block and offset dims cannot be flattened into one); slot_mapping: [T],
    where a slot < 0 marks a padding token (CUDA-graph batches) that is not written. An fp8
    cache (kv_scales given) is quantized on write (kernels/kv_quant.py's rule).
    """
    if cache_is_fp8(k_cache, kv_scales):
        write_kv_fp8_ref(k, v, k_cache, v_cache, slot_mapping, kv_scales)
        return
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = k[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = v[keep].to(v_cache.dtype)


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, scale: float,
                          kv_scales: KVScales | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole paged context.

    q: [T, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]; returns [T, Hq, D].
    Sequence i's new tokens are the last query_len of its seq_len context, so query j may see
    keys 0 .. seq_len - query_len + j. One SDPA call per sequence (GQA via enable_gqa). An fp8
    cache's blocks are dequantized with their per-head scales (kv_scales) first.
    """
    fp8 = cache_is_fp8(k_cache, kv_scales)
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        if q_len == 0:
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = meta.block_tables[i, :num_blocks].long()
        # [num_blocks, block_size, Hkv, D] -> [Hkv, seq_len, D]
        if fp8:
            kb = dequant_blocks(k_cache, kv_scales.k, blocks, q.dtype)
            vb = dequant_blocks(v_cache, kv_scales.v, blocks, q.dtype)
        else:
            kb, vb = k_cache[blocks], v_cache[blocks]
        k = kb.flatten(0, 1)[:seq_len].transpose(0, 1)
        v = vb.flatten(0, 1)[:seq_len].transpose(0, 1)
        qi = q[start:start + q_len].transpose(0, 1)  # [Hq, q_len, D]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # [q_len, seq_len]
        o = F.scaled_dot_product_attention(qi, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                           scale=scale, enable_gqa=True)
        out[start:start + q_len] = o.transpose(0, 1)
        start += q_len
    return out


@runtime_checkable
class AttentionBackend(Protocol):
    """The seam between the model and the attention implementation.

    The Model calls only these two, once per layer, so a backend drops in at construction:
    Model(cfg, backend=...). TorchAttentionBackend (below) is the reference;
    engine/model/triton_attention.py's TritonAttentionBackend drives the Triton kernels.
    """

    name: str

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata,
                 kv_scales: KVScales | None = None) -> None:
        """Store new k, v [T, Hkv, D] at meta.slot_mapping in the layer views [NB, BS, Hkv, D]
        (an fp8 cache: quantized, setting its kv_scales)."""
        ...

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float,
               kv_scales: KVScales | None = None) -> torch.Tensor:
        """Paged causal attention of q [T, Hq, D] over the cached KV -> [T, Hq, D]."""
        ...


class TorchAttentionBackend:
    """The reference AttentionBackend: plain torch over the paged KV views."""

    name = "torch"

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata,
                 kv_scales: KVScales | None = None) -> None:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float,
               kv_scales: KVScales | None = None) -> torch.Tensor:
        return paged_attention_torch(q, k_cache, v_cache, meta, scale, kv_scales)


def make_metadata(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                  block_size: int, device: torch.device | str = "cpu") -> AttentionMetadata:
    """Metadata for sequences whose new tokens are the last query_lens[i] of seq_lens[i], with
    KV in block_tables[i] (tests, tools; the engine's runner builds its own from requests)."""
    slots: list[int] = []
    for q_len, seq_len, table in zip(query_lens, seq_lens, block_tables):
        slots += [table[p // block_size] * block_size + p % block_size
                  for p in range(seq_len - q_len, seq_len)]
    width = max(len(t) for t in block_tables)
    qsl = [0]
    for q_len in query_lens:
        qsl.append(qsl[-1] + q_len)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in block_tables],
                                  dtype=torch.int32, device=device),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens), block_size=block_size)

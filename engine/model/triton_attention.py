"""The Triton attention backend: the engine's AttentionBackend that drives pdserve.kernels.

TritonAttentionBackend plugs into the engine's attention seam (engine/model/attention.py,
AttentionBackend; TorchAttentionBackend is the reference): write_kv + attend, picking the
split-K decode kernel for decode-only and uniform verify steps, the chunked-prefill kernel
(which also serves the decode rows of mixed steps) otherwise, and SDPA for one fresh long
prompt (engine/model/sdpa_prefill.py).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from pdserve.engine.model import sdpa_prefill
from pdserve.engine.model.attention import AttentionBackend, AttentionMetadata
from pdserve.kernels.attn_prologue import fused_qk_norm_rope_kv
from pdserve.kernels.decode_attention import (
    MAX_GROUP_ROWS,
    Prologue,
    SplitPartials,
    decode_num_splits,
    fused_decode_attention,
    paged_decode_attention,
)
from pdserve.kernels.kv_quant import KVScales
from pdserve.kernels.kv_write import write_kv
from pdserve.kernels.prefill_attention import paged_prefill_attention


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              meta: AttentionMetadata, scale: float, num_splits: int | None = None,
              kv_scales: KVScales | None = None, max_rows: int = MAX_GROUP_ROWS
              ) -> torch.Tensor:
    """Same function as pdserve.engine.model.attention.paged_attention_torch: q [T, Hq, D] over layer views
    [NB, BS, Hkv, D] -> [T, Hq, D]. Decode steps, and verify steps where every sequence brings
    the same few tokens (MTP: the last token + k drafts), take the split-K decode kernel (its
    split count comes from the block table's width unless given, so keep that width fixed
    under CUDA graphs); anything else takes the chunked-prefill kernel. An fp8 cache comes
    with its kv_scales, which every kernel reads. max_rows: uniform steps of more rows per
    sequence take the prefill kernel (TritonAttentionBackend's verify_rows)."""
    rows = _uniform_rows(q, k_cache, meta, max_rows)
    if rows:
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                      scale, num_splits=num_splits, rows_per_seq=rows,
                                      kv_scales=kv_scales)
    return paged_prefill_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens,
                                   meta.block_tables, meta.max_query_len, scale, kv_scales)


def attend_with_prologue(backend: AttentionBackend, q: torch.Tensor, prologue: Prologue,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                         scale: float, kv_scales: KVScales | None = None,
                         compute_dtype: torch.dtype | None = None, partials: bool = False
                         ) -> torch.Tensor | SplitPartials:
    """QK-norm + RoPE + KV write, then attention, for the raw q [T, Hq, D] of a qkv projection
    (the model's fused path). With the Triton backend, decode and uniform verify steps run it
    all as one kernel (fused_decode_attention); otherwise the prologue kernel runs first and
    the backend attends over the rotated q. With an fp8 cache (kv_scales) the quantization
    happens inside whichever kernel writes the cache. compute_dtype: the attention's type
    where q/k/v come in fp32 (kernels/fp8_gemv_tc.py's output) over a cache of that type.
    partials: where the fused decode kernel runs, return its splits unmerged (SplitPartials,
    for kernels/fp8_gemv_tc.py's "merge" prologue); any other route returns the output."""
    if isinstance(backend, TritonAttentionBackend) and not backend.takes_sdpa(q, meta):
        rows = _uniform_rows(q, k_cache, meta, backend.verify_rows)
        if rows:
            return fused_decode_attention(q, prologue, k_cache, v_cache, meta.block_tables,
                                          meta.seq_lens, scale, num_splits=backend.num_splits,
                                          rows_per_seq=rows, kv_scales=kv_scales,
                                          compute_dtype=compute_dtype, partials=partials)
    if compute_dtype is not None and q.dtype != compute_dtype:  # the unfused route: cast
        dt = compute_dtype
        q, prologue = q.to(dt), replace(prologue, k=prologue.k.to(dt), v=prologue.v.to(dt))
    p = prologue
    q = fused_qk_norm_rope_kv(q, p.k, p.v, p.positions, p.cos, p.sin, k_cache, v_cache,
                              p.slot_mapping, p.q_norm, p.k_norm, p.eps, kv_scales)
    fp8 = {} if kv_scales is None else {"kv_scales": kv_scales}
    return backend.attend(q, k_cache, v_cache, meta, scale, **fp8)


def _uniform_rows(q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata,
                  max_rows: int) -> int:
    """R when every sequence of the step brings exactly R <= max_rows new tokens and R query
    rows per KV head fit one decode program; 0 otherwise (host lists only: no device read)."""
    if meta.is_decode_only:
        return 1
    r, group = meta.uniform_query_len, q.shape[1] // k_cache.shape[2]
    if r > max_rows or r * group > MAX_GROUP_ROWS or r * len(meta.query_lens_cpu) != q.shape[0]:
        return 0
    return r


class TritonAttentionBackend:
    """Drop-in for pdserve.engine.model.attention.TorchAttentionBackend:
    Model(cfg, backend=TritonAttentionBackend())."""

    name = "triton"

    def __init__(self, num_splits: int | None = None, fresh_prefill_sdpa: bool = True,
                 verify_rows: int = 1) -> None:
        self.num_splits = num_splits  # fixed decode split count (None: chosen per shape)
        # the most new tokens per sequence a uniform step takes to the decode kernel: MTP's
        # k + 1 (verify steps). Each R is a compile of its own (~2-6 s cold on an H200), so a
        # prefill step whose prompts happen to be equally long takes the prefill kernel
        self.verify_rows = verify_rows
        # one fresh long prompt -> SDPA's cuDNN/flash kernels (engine/model/sdpa_prefill.py)
        self.fresh_prefill_sdpa = fresh_prefill_sdpa

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata,
                 kv_scales: KVScales | None = None) -> None:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)

    def decode_splits(self, batch: int, k_cache: torch.Tensor, dtype: torch.dtype,
                      context: int) -> int:
        """The split count of a decode step of `batch` sequences over a block table of
        `context` tokens (engine/exec/cuda_graphs.py asks it to pick the graphs to capture);
        k_cache: a layer's view [NB, BS, Hkv, D]; dtype: the attention's type."""
        if self.num_splits is not None:
            return self.num_splits
        return decode_num_splits(dtype, k_cache.dtype, k_cache.shape[-1], batch,
                                 k_cache.shape[2], context, k_cache.device)

    def takes_sdpa(self, q: torch.Tensor, meta: AttentionMetadata) -> bool:
        """True when attend() hands this step to SDPA (one fresh long prompt)."""
        return self.fresh_prefill_sdpa and sdpa_prefill.applies(q, meta)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float,
               kv_scales: KVScales | None = None) -> torch.Tensor:
        if self.takes_sdpa(q, meta):
            try:
                return sdpa_prefill.fresh_prefill_attention(q, k_cache, v_cache, meta, scale,
                                                            kv_scales)
            except RuntimeError as e:  # no SDPA backend takes this shape: stay on Triton
                sdpa_prefill.log.warning("fresh-prefill SDPA disabled: %s", e)
                self.fresh_prefill_sdpa = False
        return attention(q, k_cache, v_cache, meta, scale, num_splits=self.num_splits,
                         kv_scales=kv_scales, max_rows=self.verify_rows)

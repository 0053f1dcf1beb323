"""CUDA graphs for MTP verify steps: the target forward over B sequences x (k+1) tokens.

A verify step at small batch is as launch-bound as a decode step, so it replays a captured
graph the same way (engine/exec/cuda_graphs.py): static buffers, the batch padded up to a bucket,
padding rows that write no KV (slot -1). The differences: every sequence brings q = k + 1
tokens (one graph set per k), the attention takes the split-K decode kernel with q causal
rows per sequence (triton_attention.attention(): uniform query lengths), and a padding sequence gets
seq_len q over block 0 (every row needs seq_len >= q; it reads block 0 and writes nothing).

Only steps where every scheduled request verifies exactly k drafts replay; the rest (prefill
chunks, mixed k near max_tokens) run eagerly. The MTP drafting itself stays eager.
"""
from __future__ import annotations

import logging

import torch

from pdserve.engine.core.config import EngineConfig, SpecConfig
from pdserve.engine.exec.cuda_graphs import DecodeGraphs, decode_buckets
from pdserve.engine.exec.static_inputs import StaticInputs
from pdserve.engine.model.decoder import Model

log = logging.getLogger(__name__)


class VerifyGraphs(DecodeGraphs):
    """Captured target forwards for B sequences of q tokens each, one per batch bucket."""

    def __init__(self, config: EngineConfig, model: Model, kv_cache: torch.Tensor, q: int,
                 max_batch: int) -> None:
        super().__init__(config, model, kv_cache)
        self.q = q  # tokens per sequence: the last accepted one + k drafts
        self.buckets = decode_buckets(max_batch)
        n, dev = self.buckets[-1], self.device
        # padding sequences: seq_len q over block 0 (see the module docstring)
        self._set_inputs(StaticInputs(n, q, self.width, q, dev))
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev) * q


def maybe_verify_graphs(config: EngineConfig, model: Model, kv_cache: torch.Tensor,
                        spec: SpecConfig | None) -> dict[int, VerifyGraphs]:
    """{k: VerifyGraphs} for k = 1..spec's k, up to the largest batch that still drafts,
    when CUDA graphs are on (as for decode steps); {} without speculation or graphs, or
    when capture fails (verify steps then run eagerly, logged). With TP
    every rank captures the same graphs in the same order (rank 0's ModelRunner and each
    follower's RankParts.follower): the captures' warm-up forwards meet in collectives, and
    a rank replays a verify graph when rank 0 does, so a failed capture raises there rather
    than leave one rank eager."""
    if spec is None or not config.use_cuda_graphs or kv_cache.device.type != "cuda":
        return {}
    max_k, max_batch = spec.num_speculative_tokens, spec.max_drafting_batch(
        config.scheduler.max_num_seqs)
    if max_batch < 1:
        return {}
    graphs: dict[int, VerifyGraphs] = {}
    try:
        for k in range(1, max_k + 1):
            g = VerifyGraphs(config, model, kv_cache, k + 1, max_batch)
            g.capture()
            graphs[k] = g
    except Exception as e:  # a kernel that cannot be captured: stay correct, run eagerly
        if model.tp is not None:
            raise
        log.warning("verify CUDA graphs disabled (capture failed: %s: %s)", type(e).__name__, e)
        return {}
    return graphs

"""CUDA graphs for decode steps: one captured model forward per batch-size bucket.

At batch 1 an 8B model's decode step is ~300 kernel launches; launched one by one from Python
they take longer than the GPU needs to run them. A graph replays the whole step with one
launch. What a replay needs:

- Static inputs. Every graph reads the same buffers (input_ids, positions, slot_mapping,
  seq_lens, block_tables), views of one device buffer that a step fills with one async copy
  from a pinned host mirror (engine/exec/static_inputs.py).
- A fixed shape per graph. The batch is padded up to the next bucket (1, 2, 4, ... 256, up
  to max_num_seqs) with dummy rows: slot -1 (the KV write skips it) and seq_len 0 (the
  decode kernel writes a zero row and reads no keys), so padding touches no cache block.
  The block table has a fixed width, max_model_len / block_size, so the decode kernel picks
  the same split count at capture and at every replay.
- A second graph per bucket for short contexts, where the decode kernel would split a table
  of SHORT_CONTEXT tokens fewer ways (batch 1: 16 splits of a KV head instead of 32): it
  replays over the static table's first columns when every sequence's blocks fit them. The
  long table's split count suits long contexts, but at a short one most of its split
  programs find no keys and the merge's tile is twice the size it needs.
- No host reads of device data inside the captured region: the Triton path (Model with
  use_fused_ops + engine.model.triton_attention.TritonAttentionBackend) uses only tensor shapes and host ints;
  the torch attention path loops over host lengths, so graphs require use_triton.

Only decode-only steps (every sequence brings one token) on CUDA replay a graph; anything
else (prefill, mixed steps, MTP verify) runs eagerly. Logits and sampling stay eager: the
runner computes them from the returned hidden rows.
"""
from __future__ import annotations

import torch

from pdserve.engine.core.config import ConfigError, EngineConfig
from pdserve.engine.exec.kv_cache import layer_views
from pdserve.engine.exec.static_inputs import StaticInputs
from pdserve.engine.model.attention import AttentionMetadata, HostBatch
from pdserve.engine.model.decoder import Model

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# tokens of a short-context graph's table. Qwen3-8B FP8 at batch 1 on an H200, 640-token
# context: its graph (16 splits of a KV head) against the whole table's (32) took the step
# 2.372 -> 2.353 ms (bench/results/diag_short_graph_h200_2026-11-30.json). At 2K tokens 32
# splits beat 16 (2.493 vs 2.522 ms, diag_splits_h200_2026-11-30_*): up to 1024 tokens 16
# splits of 64-key tiles still give every tile a program of its own
SHORT_CONTEXT = 1024
Entry = tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]  # (graph, hidden, prenorm)


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: the powers of two up to max_num_seqs, plus max_num_seqs itself
    (so every batch the scheduler can form has a bucket)."""
    if max_num_seqs < 1:
        raise ConfigError(f"max_num_seqs: must be >= 1, got {max_num_seqs}")
    sizes = [b for b in BUCKETS if b < max_num_seqs]
    return sizes + [max_num_seqs]


def bucket_for(batch: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds `batch` rows, or None when none does."""
    return next((b for b in buckets if b >= batch), None)


class DecodeGraphs:
    """Captured decode forwards of `model` over `kv_cache`, one per bucket.

    run() returns (hidden, prenorm) [B, hidden] for a decode-only step, or None when the step
    must run eagerly. hidden is a view of the graph's output buffer (valid until the next
    replay); prenorm is a copy, since MTP drafting may keep it across steps.
    """

    def __init__(self, config: EngineConfig, model: Model, kv_cache: torch.Tensor) -> None:
        self.model, self.kv_cache = model, kv_cache
        self.device = kv_cache.device
        self.block_size = config.cache.block_size
        self.q = 1  # tokens per sequence (VerifyGraphs: k + 1)
        self.buckets = decode_buckets(config.scheduler.max_num_seqs)
        n = self.buckets[-1]
        self.width = -(-config.scheduler.max_model_len // self.block_size)  # fixed table width
        # padding rows: slot -1, seq_len 0 (the decode kernel reads no keys for them)
        self._set_inputs(StaticInputs(n, 1, self.width, 0, self.device))
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=self.device)
        self.graphs: dict[int, Entry] = {}  # bucket -> its graph over the whole table
        self.short: dict[int, tuple[int, Entry]] = {}  # bucket -> (short width, its graph)
        self.short_context = SHORT_CONTEXT  # 0: no short-context graphs
        self.pool = None  # one memory pool shared by all graphs (captured largest first)
        self.replays = 0  # steps served by a graph (tests and benchmarks read it)

    def _set_inputs(self, inputs: StaticInputs) -> None:
        self.inputs = inputs
        self.input_ids, self.positions = inputs.input_ids, inputs.positions
        self.slot_mapping, self.seq_lens = inputs.slot_mapping, inputs.seq_lens
        self.block_tables = inputs.block_tables

    def meta(self, bucket: int, width: int | None = None) -> AttentionMetadata:
        """Metadata over the first `bucket` rows (and `width` table columns, default all) of
        the static buffers. The host lists are only for the torch path, which never runs
        under a graph."""
        width = width or self.width
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket * self.q],
            query_start_loc=self.query_start_loc[:bucket + 1],
            seq_lens=self.seq_lens[:bucket], block_tables=self.block_tables[:bucket, :width],
            max_query_len=self.q, max_seq_len=width * self.block_size,
            query_lens_cpu=[self.q] * bucket, seq_lens_cpu=[self.inputs.seq_pad] * bucket,
            block_size=self.block_size)

    def forward_eager(self, bucket: int, width: int | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The function each graph captures, run eagerly on the static buffers (warm-up, and
        profiling: it launches the same kernels with the same split counts as a replay)."""
        n = bucket * self.q
        return self.model(self.input_ids[:n], self.positions[:n], self.meta(bucket, width),
                          self.kv_cache, return_prenorm=True)

    def _short_width(self, bucket: int) -> int | None:
        """The table width of the bucket's short-context graph: SHORT_CONTEXT tokens, where
        the decode kernel splits that table fewer ways than the whole one; else None."""
        short = -(-self.short_context // self.block_size)
        splits = getattr(self.model.backend, "decode_splits", None)
        if not 0 < short < self.width or splits is None:
            return None
        k = layer_views(self.kv_cache, 0).k
        dtype = self.model.embed_tokens.weight.dtype
        fewer = (splits(bucket, k, dtype, short * self.block_size)
                 < splits(bucket, k, dtype, self.width * self.block_size))
        return short if fewer else None

    @torch.inference_mode()
    def capture(self, buckets: list[int] | None = None) -> None:
        """Capture the given buckets (default: all), largest first so the shared pool is sized
        by the first. The static inputs hold padding only, so capture writes no KV."""
        self.inputs.reset()
        for bucket in sorted(buckets or self.buckets, reverse=True):
            if bucket in self.graphs:
                continue
            self.graphs[bucket] = self._capture_one(bucket, self.width)
            short = self._short_width(bucket)
            if short is not None:
                self.short[bucket] = (short, self._capture_one(bucket, short))
        torch.cuda.synchronize(self.device)

    def entry(self, bucket: int, widest: int) -> Entry:
        """The captured graph that replays `bucket` rows whose block tables hold at most
        `widest` blocks: the short-context one where they fit it."""
        short = self.short.get(bucket)
        return short[1] if short is not None and widest <= short[0] else self.graphs[bucket]

    def _capture_one(self, bucket: int, width: int) -> Entry:
        for _ in range(2):  # compile Triton kernels, pick cuBLAS algorithms, fill caches
            self.forward_eager(bucket, width)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls on other threads (a TP group's keep-alive marks and
        # GPU watchdog, KV transfers) cannot invalidate a capture, as in "global" mode
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            hidden, prenorm = self.forward_eager(bucket, width)
        if self.pool is None:
            self.pool = graph.pool()
        return graph, hidden, prenorm

    def fits(self, batch: HostBatch) -> int | None:
        """The bucket that replays this step, or None when it must run eagerly."""
        if any(q != self.q for q in batch.query_lens) or batch.widest > self.width:
            return None
        return bucket_for(len(batch.seq_lens), self.buckets)

    @torch.inference_mode()
    def run_host(self, batch: HostBatch, keep_prenorm: bool = False,
                 input_ids: torch.Tensor | None = None, bucket: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Replay the bucket's graph for this step: (hidden, prenorm) [T, H] views of the
        graph's outputs (valid until the next replay; keep_prenorm returns a copy of prenorm,
        for MTP drafting, which keeps it), or None when the step must run eagerly.
        input_ids on the device, if given, replace batch.input_ids (overlapped decode: the
        previous step's sampled ids, not yet read by the host): all of them [T], or the last
        c of each sequence's q [B, c] (an MTP verify: its drafts; the rest come staged).
        bucket: fits(batch), when the caller already asked it."""
        bucket = self.fits(batch) if bucket is None else bucket
        if bucket is None:
            return None
        if bucket not in self.graphs:  # a bucket not captured up front: capture it now
            self.capture([bucket])
        self.inputs.stage(batch, bucket)
        if input_ids is not None:
            T = len(batch.input_ids)
            if input_ids.dim() == 1:
                self.input_ids[:T].copy_(input_ids)
            else:  # [B, c]: the last c columns of each sequence's q rows
                rows = self.input_ids[:T].view(-1, self.q)
                rows[:, self.q - input_ids.shape[1]:].copy_(input_ids)
        graph, hidden, prenorm = self.entry(bucket, batch.widest)
        graph.replay()
        self.replays += 1
        T = len(batch.input_ids)
        return hidden[:T], (prenorm[:T].clone() if keep_prenorm else prenorm[:T])


def maybe_decode_graphs(config: EngineConfig, model: Model,
                        kv_cache: torch.Tensor) -> DecodeGraphs | None:
    """DecodeGraphs, captured for every bucket, when the config asks for CUDA graphs and the
    cache lives on a CUDA device; None otherwise (CPU runs stay eager)."""
    if not config.use_cuda_graphs or kv_cache.device.type != "cuda":
        return None
    if not config.use_triton:
        raise ConfigError("use_cuda_graphs: needs use_triton (the torch attention path loops "
                          "over host-side sequence lengths, which a graph would freeze)")
    if getattr(model.backend, "name", None) != "triton":
        raise ConfigError("use_cuda_graphs: the model must be built with "
                          "backend=TritonAttentionBackend() (engine.llm.build_engine "
                          "does this for use_triton)")
    graphs = DecodeGraphs(config, model, kv_cache)
    graphs.capture()
    return graphs

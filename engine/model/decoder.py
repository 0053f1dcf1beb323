"""The decoder: Llama (SmolLM2, Llama 3), Qwen3, Qwen2 / MiMo, Qwen3-MoE and GLM-4.5 in one
file, read top to bottom.

The families differ only in per-layer parts, picked once at build time from the ModelConfig
(engine/model/families.py reads those fields from config.json): the attention's q/k/v biases
(Qwen2, MiMo, GLM), QK-norm (Qwen3, GLM's use_qk_norm) and partial rotary (GLM: RoPE on the
first half of each head), and the MLP: dense SwiGLU or a mixture of experts, with GLM's shared
expert and dense first layers (engine/model/moe.py make_mlp).

Tokens arrive as one flat varlen batch [T] (no padding, see engine/model/attention.py); every layer
writes its new K/V into the paged cache and attends over each sequence's blocks. The only
attention calls go through `backend` (write_kv, attend), so a Triton backend replaces the
torch one without touching this file.

Fast path (Model.use_fused_ops, with TritonAttentionBackend): the residual-add + norm
pairs, SiLU-and-mul and the attention prologue (QK-norm + RoPE + KV write, one kernel) run as
Triton kernels; at batch-1 decode (T = 1) each norm and SiLU-mul also folds into the GEMV
kernel of the projection after it (kernels/gemv.py), and decode attention takes in the
attention prologue (kernels/decode_attention.py), so a decode layer is 4 GEMVs + one
attention kernel: 5 kernels.
Nothing in that path reads device values on the host, so it can be captured in a CUDA graph
(engine/exec/cuda_graphs.py).

Tensor parallelism (Model(tp=TPContext), docs/tensor_parallel.md): the Model holds one
rank's shard (engine/dist/shard.py); an all-reduce follows o_proj and the MLP / MoE block
(on the batch-1 GEMV path rank 0 alone adds the residual in those epilogues, so the sum holds
it once), the embedding is vocabulary-parallel (masked lookup + all-reduce) and the LM head
all-gathers the logits, or takes a cross-rank argmax for greedy.

Parameter names follow Hugging Face's modules (minus the `model.` prefix), except that q/k/v
and gate/up are merged into qkv_proj and gate_up_proj (one matmul each) and the experts are
stacked (moe.py); engine/model/weights.py maps checkpoints onto them.
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.core.config import ModelConfig
from pdserve.engine.dist import parallel
from pdserve.engine.dist.parallel import TPContext
from pdserve.engine.exec.kv_cache import layer_views
from pdserve.engine.model.attention import AttentionBackend, AttentionMetadata, TorchAttentionBackend
from pdserve.engine.model.layers import (
    RMSNorm,
    RotaryEmbedding,
    SwiGLUMLP,
    apply_rope,
    fused_attention,
    fused_kernels,
)
from pdserve.engine.model.linear_ops import linear_gemv
from pdserve.engine.model.moe import make_mlp
from pdserve.engine.model.tc_decode import TcBuffers, forward_tc, tc_layer_fits

if TYPE_CHECKING:  # the torch path never imports the kernels
    from pdserve.kernels.decode_attention import SplitPartials


class Attention(nn.Module):
    """GQA self-attention over the paged KV cache. Variants, from the config: biases on q/k/v
    (attention_bias), RMSNorm on q and k per head (qk_norm), RoPE on the first rotary_dim
    dims of each head only (partial_rotary_factor < 1)."""

    def __init__(self, cfg: ModelConfig, kv_layer: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.kv_layer = kv_layer  # index into kv_cache's layer dim (MTP layers come after the decoder's)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.backend = backend
        self.fused = False  # one Triton kernel for QK-norm + RoPE + KV write
        # the prologue kernels rotate whole heads; partial rotary keeps the torch RoPE (the
        # backend's kernels still write the cache and attend)
        self.prologue_kernel = cfg.rotary_dim == cfg.head_dim
        # an fp8 KV cache's per-tensor (k_scale, v_scale) when the checkpoint ships them (every
        # block then takes them as its scales); None: per-block scales from each block's values
        self.kv_static_scales: tuple[float, float] | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        o = self.attend_qkv(self.qkv_proj(x), cos, sin, meta, kv_cache)
        return self.o_proj(o)

    def attend_qkv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   meta: AttentionMetadata, kv_cache: torch.Tensor,
                   compute_dtype: torch.dtype | None = None,
                   partials: bool = False) -> torch.Tensor | SplitPartials:
        """qkv [T, (Hq + 2 Hkv) * D] -> attention output [T, Hq * D] (before o_proj); writes
        this step's K/V into the cache. compute_dtype: the attention's (and output's) type
        for an fp32 qkv (kernels/fp8_gemv_tc.py; fused path only). partials: the fused
        decode kernel's splits unmerged where it runs (attend_with_prologue)."""
        T = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        # this layer's views [num_blocks, block_size, Hkv, D] of the all-layers cache, and
        # for an fp8 cache its scales [num_blocks, Hkv] (engine/exec/kv_cache.py)
        k_cache, v_cache, kv_scales = layer_views(kv_cache, self.kv_layer, self.kv_static_scales)
        if self.fused and self.prologue_kernel:  # q/k/v: strided views of qkv; rotated k -> cache
            kern = fused_kernels()
            prologue = kern.Prologue(
                k, v, cos, sin, meta.slot_mapping,
                None if self.q_norm is None else self.q_norm.weight,
                None if self.k_norm is None else self.k_norm.weight,
                self.q_norm.eps if self.q_norm is not None else 1e-6, meta.rope_positions)
            o = fused_attention().attend_with_prologue(self.backend, q, prologue, k_cache,
                                                       v_cache, meta, self.scale, kv_scales,
                                                       compute_dtype, partials)
            return o.reshape(T, self.q_size) if torch.is_tensor(o) else o  # o: SplitPartials
        if meta is not None and meta.rope_positions is not None:  # tables (Model.rope): rows
            cos, sin = cos[meta.rope_positions], sin[meta.rope_positions]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # kv_scales only for an fp8 cache: backends that never see one (training's) keep the
        # five-argument form
        fp8 = {} if kv_scales is None else {"kv_scales": kv_scales}
        self.backend.write_kv(k, v, k_cache, v_cache, meta, **fp8)
        o = self.backend.attend(q, k_cache, v_cache, meta, self.scale, **fp8)  # [T, Hq, D]
        return o.reshape(T, self.q_size)


class DecoderLayer(nn.Module):
    """Pre-norm block. The residual add is folded into the next norm: (x, residual) in and out
    (residual None: x is the whole residual stream, as for the first layer)."""

    def __init__(self, cfg: ModelConfig, kv_layer: int, backend: AttentionBackend,
                 tp: TPContext | None = None) -> None:
        super().__init__()
        # the row-parallel sum after o_proj and after the MLP (identity without TP)
        self.group = tp.group if tp is not None and tp.size > 1 else None
        self.reduce = self.group.all_reduce if self.group is not None else _identity
        self.adds_residual = tp is None or tp.rank == 0  # GEMV epilogues: rank 0 adds it
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, kv_layer, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = make_mlp(cfg, kv_layer)  # dense SwiGLU or MoE (moe.py)
        self.fused = False  # decode-sized batches: 4 prologue-fused GEMV kernels (kernels.gemv)
        self.tc: TcBuffers | None = None  # batch 1 on the tensor cores (Model.use_tc_gemv)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.fused and 0 < x.shape[0] <= fused_kernels().GEMV_ROWS:
            return self._forward_gemv(x, residual, cos, sin, meta, kv_cache)
        if residual is None:  # first layer: the embedding is the residual stream
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.reduce(self.self_attn(x, cos, sin, meta, kv_cache))
        x, residual = self.post_attention_layernorm(x, residual)
        return self.reduce(self.mlp(x)), residual

    def _forward_gemv(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                      sin: torch.Tensor, meta: AttentionMetadata,
                      kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The same layer through kernels.gemv for 1..GEMV_ROWS rows (batch-1 decode, MTP
        verify of a few drafts). 5 kernels at batch 1: each norm rides in the next projection's
        prologue, SiLU-and-mul in down_proj's, both residual adds in the epilogues of o_proj
        and down_proj, and QK-norm + RoPE + the KV write in the attention kernel. Returns (the
        residual stream after the layer, None): the adds are done, so the next layer (or final
        norm) takes x alone. A MoE layer returns (its MLP output, residual) instead; at batch 1
        its norm rides in the router's prologue (MoEBlock.forward_normed): 6 kernels."""
        if self.tc is not None and x.shape[0] == 1 and residual is None:
            return forward_tc(self, x, cos, sin, meta, kv_cache, self.tc), None
        attn, mlp = self.self_attn, self.mlp
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        qkv, h = linear_gemv(x, attn.qkv_proj, "norm", residual, ln1.weight, ln1.eps)
        if attn.qkv_proj.bias is not None:  # Qwen2 / GLM: one add kernel more
            qkv = qkv + attn.qkv_proj.bias
        o = attn.attend_qkv(qkv, cos, sin, meta, kv_cache)
        # o_proj's programs ask L2 for its weight while the (latency-bound) attention runs:
        # batch-1 step 5.66-5.70 -> 5.49-5.57 ms on an H100; the attention kernel asking for
        # it instead was slower (bench/results/diag_decode_h100_2026-11-24_prefetch*.json)
        # with TP, rank 0 alone adds the residual: the all-reduce then holds it once
        add = self.adds_residual
        h = self.reduce(linear_gemv(o, attn.o_proj, add=h if add else None, prefetch=True),
                        pdl=True)
        if not isinstance(mlp, SwiGLUMLP):  # MoE: the norm rides in the router (batch 1),
            # a PDL launch behind o_proj, or behind its all-reduce when that is our push
            # kernel (PDL behind NCCL's kernel broke CUDA-graph captures, kernels/rmsnorm.py)
            pdl = self.group is None or self.group.reduces_in_triton(h)
            return self.reduce(mlp.forward_normed(h, ln2, pdl=pdl)), h
        gate_up, _ = linear_gemv(h, mlp.gate_up_proj, "norm", None, ln2.weight, ln2.eps)
        return self.reduce(linear_gemv(gate_up, mlp.down_proj, "silu",
                                       add=h if add else None), pdl=True), None


def _identity(t: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    return t


class Model(nn.Module):
    """config: this rank's shape (with tp: its heads, MLP and vocabulary rows,
    engine/dist/shard.py ShardPlan.local_config)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend | None = None,
                 tp: TPContext | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.backend = backend if backend is not None else TorchAttentionBackend()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config.rotary_dim, config.rope_theta, config.rope_scaling)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, self.backend, self.tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def use_fused_ops(self, enabled: bool = True) -> Model:
        """Switch every norm, MLP and attention prologue (MTP modules included, when they are
        submodules) to the Triton kernels, or back to torch. Pair it with
        backend=TritonAttentionBackend() (engine/model/triton_attention.py) so attention runs as
        Triton kernels too."""
        for module in self.modules():
            if hasattr(module, "fused") and isinstance(module.fused, bool):
                module.fused = enabled
        weight = self.embed_tokens.weight
        self.use_tc_gemv(enabled and weight.is_cuda
                         and fused_kernels().tc_available(weight.device.index or 0))
        return self

    def use_tc_gemv(self, enabled: bool = True, merge: bool = True) -> bool:
        """Batch-1 decode through kernels/fp8_gemv_tc.py (engine/model/tc_decode.py): on by
        use_fused_ops on a Hopper GPU where every layer fits (tc_layer_fits: dense, block
        FP8) and there is no TP; elsewhere the kernel's torch reference runs it (tests).
        merge: o_proj merges the decode attention's splits (TcBuffers.merge; off for A/B
        measurements). Returns whether it is on."""
        on = enabled and self.tp is None and all(tc_layer_fits(la) for la in self.layers)
        buffers = TcBuffers.for_layer(self.layers[0], self.embed_tokens.weight.device,
                                      merge) if on else None
        for layer in self.layers:
            layer.tc = buffers
        return on

    def tie_weights(self) -> None:
        """Share the embedding with the output head when the config says so. Call again after
        anything that replaces parameters (to_empty after a meta-device build does)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden] (with TP: the rank's vocabulary rows, summed over ranks)."""
        if self.tp is not None:
            return parallel.embed(input_ids, self.embed_tokens.weight, self.tp.vocab,
                                  self.tp.group)
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor, return_prenorm: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """input_ids, positions [T] -> hidden [T, hidden] after the final norm.

        With return_prenorm, also the last layer's output before the final norm (residual
        stream included), which MTP drafting consumes.
        """
        cos, sin, meta = self.rope(positions, meta)
        x, residual = self.embed(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, meta, kv_cache)
        x = x.to(self.embed_tokens.weight.dtype)  # the tensor-core path's fp32 stream
        if residual is None:  # the batch-1 fused layers add the residual themselves
            hidden, prenorm = self.norm(x), x
        else:
            hidden, prenorm = self.norm(x, residual)
        return (hidden, prenorm) if return_prenorm else hidden

    def rope(self, positions: torch.Tensor, meta: AttentionMetadata | None
             ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata | None]:
        """cos, sin for the layers, and the metadata to pass with them. On the fused path
        with reserved tables: the whole tables [max_pos, head_dim / 2], and meta carries the
        positions, so the attention kernels read each token's row themselves (one gather
        kernel less per forward: ~4 us of a batch-1 decode step). Otherwise the per-token
        rows [T, head_dim / 2] (float32) and meta as given (None: a training backend's)."""
        fused = self.norm.fused and meta is not None
        tables = self.rotary.tables(positions.device) if fused else None
        if tables is None:
            return (*self.rotary.cos_sin(positions), meta)
        return (*tables, replace(meta, rope_positions=positions))

    def compute_logits(self, hidden: torch.Tensor, as_float: bool = True,
                       weight: torch.Tensor | None = None) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 (only the rows that sample, to save the big matmul).
        as_float=False keeps the weights' dtype: enough for an argmax (greedy drafting and
        verifying), and it skips a conversion pass over the logits. weight [V', hidden]: other
        head rows instead of lm_head's (a reduced draft vocabulary, engine/spec/mtp_head.py).
        With TP every rank calls it for the same rows: the ranks' [N, V / tp] logits are
        all-gathered into the full rows (the sampler needs them: penalties, grammars)."""
        logits = self._local_logits(hidden, weight)
        if self.tp is not None:
            logits = parallel.gather_logits(logits, self.tp.vocab, self.tp.group)
        return logits.float() if as_float else logits

    def _local_logits(self, hidden: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """[N, hidden] -> [N, rows of weight] (this rank's vocabulary rows with TP)."""
        if weight is not None and self.tp is not None:
            raise ValueError("weight: a reduced draft vocabulary is not tensor-parallel yet")
        weight = self.lm_head.weight if weight is None else weight
        if self._head_is_gemv(hidden.shape[0]):
            return fused_kernels().gemv(hidden, weight)
        return F.linear(hidden, weight)

    def argmax(self, logits: torch.Tensor, after_head: bool = False) -> torch.Tensor:
        """logits [N, V] -> int64 [N], torch.argmax(logits, -1). On the fused path a Triton
        kernel spread over the GPU (torch reduces a 152K row in one block: ~9 us per call at
        batch 1). after_head: logits came straight from compute_logits, so the kernel may be
        a programmatic dependent launch when the head was the GEMV kernel."""
        if self.norm.fused and logits.is_cuda:
            pdl = after_head and self._head_is_gemv(logits.shape[0])
            return fused_kernels().argmax(logits, pdl=pdl)
        return logits.argmax(dim=-1)

    def _head_is_gemv(self, rows: int) -> bool:
        """Whether compute_logits runs the LM head for `rows` rows as the GEMV kernel."""
        return self.norm.fused and 0 < rows <= fused_kernels().GEMV_ROWS

    def greedy(self, hidden: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """[N, hidden] -> int64 [N]: the argmax tokens (greedy drafting and verifying); with
        `weight`, indices into its rows (see compute_logits). With TP a cross-rank argmax
        (two values per row cross ranks instead of the logits)."""
        if self.tp is not None:
            return parallel.argmax(self._local_logits(hidden, weight), self.tp.vocab,
                                   self.tp.group)
        return self.argmax(self.compute_logits(hidden, False, weight), after_head=True)

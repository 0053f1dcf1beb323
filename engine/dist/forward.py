"""The forward of a rank's shard (shard.py): engine/model/decoder.py's Model.forward and
DecoderLayer.forward / _forward_gemv with the collectives of parallel.py in their places.

Phase 1 keeps this beside decoder.py (read-only use of its modules: attention, norms, MLP);
phase 2 folds the same few calls into decoder.py and deletes this file
(docs/tensor_parallel.md lists the lines): an all-reduce after o_proj and after the MLP,
`add` on rank 0 only in the batch-1 GEMV path, and the vocabulary-parallel embedding and head.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pdserve.engine.dist.group import TPGroup
from pdserve.engine.dist.parallel import VocabRange, argmax, embed, gather_logits, row_parallel
from pdserve.engine.model.attention import AttentionMetadata
from pdserve.engine.model.decoder import DecoderLayer, Model
from pdserve.engine.model.layers import SwiGLUMLP

# kernels/gemv.py's signature (kernels.reference.gemv_ref on CPU tests, ops.gemv on GPU)
Gemv = Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]]


class TPContext:
    """What a rank's forward needs beside its shard: the group and its vocabulary rows."""

    def __init__(self, group: TPGroup, vocab_size: int) -> None:
        self.group = group
        self.vocab = VocabRange(vocab_size, group.size, group.rank)


def layer_forward(layer: DecoderLayer, ctx: TPContext, x: torch.Tensor,
                  residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                  meta: AttentionMetadata, kv_cache: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """DecoderLayer.forward on the rank's heads and MLP rows; x, residual [T, H] replicated."""
    if residual is None:
        residual, x = x, layer.input_layernorm(x)
    else:
        x, residual = layer.input_layernorm(x, residual)
    x = ctx.group.all_reduce(layer.self_attn(x, cos, sin, meta, kv_cache))  # after o_proj
    x, residual = layer.post_attention_layernorm(x, residual)
    return ctx.group.all_reduce(layer.mlp(x)), residual  # after down_proj / the MoE block


def layer_forward_gemv(layer: DecoderLayer, ctx: TPContext, x: torch.Tensor,
                       residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                       meta: AttentionMetadata, kv_cache: torch.Tensor, gemv: Gemv
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """DecoderLayer._forward_gemv (dense MLP) on the rank's shard: the residual adds ride in
    o_proj's and down_proj's epilogues on rank 0 only, and the all-reduce sums them back in.
    Returns (the residual stream after the layer, None), as the unsharded path does."""
    attn, mlp = layer.self_attn, layer.mlp
    ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
    qkv, h = gemv(x, attn.qkv_proj.weight, "norm", residual, ln1.weight, ln1.eps)
    if attn.qkv_proj.bias is not None:
        qkv = qkv + attn.qkv_proj.bias
    o = attn.attend_qkv(qkv, cos, sin, meta, kv_cache)
    h = row_parallel(lambda add: gemv(o, attn.o_proj.weight, add=add), h, ctx.group)
    if not isinstance(mlp, SwiGLUMLP):
        return ctx.group.all_reduce(mlp(ln2(h))), h
    gate_up, _ = gemv(h, mlp.gate_up_proj.weight, "norm", None, ln2.weight, ln2.eps)
    return row_parallel(lambda add: gemv(gate_up, mlp.down_proj.weight, "silu", add=add), h,
                        ctx.group), None


def model_forward(model: Model, ctx: TPContext, input_ids: torch.Tensor,
                  positions: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor,
                  return_prenorm: bool = False, gemv: Gemv | None = None
                  ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Model.forward on the rank's shard -> hidden [T, H] (replicated on every rank).
    gemv: run the layers through the batch-1 GEMV path with that kernel."""
    cos, sin, meta = model.rope(positions, meta)
    x = embed(input_ids, model.embed_tokens.weight, ctx.vocab, ctx.group)
    residual = None
    for layer in model.layers:
        if gemv is not None:
            x, residual = layer_forward_gemv(layer, ctx, x, residual, cos, sin, meta, kv_cache,
                                             gemv)
        else:
            x, residual = layer_forward(layer, ctx, x, residual, cos, sin, meta, kv_cache)
    if residual is None:
        hidden, prenorm = model.norm(x), x
    else:
        hidden, prenorm = model.norm(x, residual)
    return (hidden, prenorm) if return_prenorm else hidden


def compute_logits(model: Model, ctx: TPContext, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [N, H] -> full logits [N, V] float32 on every rank (the all-gather)."""
    local = F.linear(hidden, model.lm_head.weight)  # [N, rows]
    return gather_logits(local, ctx.vocab, ctx.group).float()


def greedy(model: Model, ctx: TPContext, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [N, H] -> int64 [N] argmax ids on every rank (no logits all-gather)."""
    return argmax(F.linear(hidden, model.lm_head.weight), ctx.vocab, ctx.group)


"""Batch-1 decode of a dense block-FP8 model on Hopper's tensor cores (kernels/fp8_gemv_tc.py).

A layer is q/k/v -> attention -> o_proj -> gate_up -> down: four GEMV launches that each add
(fp32, RED atomics over K splits) into an output buffer that must be zero, and one attention
launch. A memset between two launches would break the PDL chain, so the launches zero the
buffers themselves, each only buffers whose every reader has finished by the time the launch
before it has (PDL orders a launch after its predecessor only):

    q/k/v    reads x (down's buffer, or the embedding), copies it to `res`; zeroes o, gate_up
    attn     reads qkv
    o_proj   reads the attention's output, adds res;                      zeroes qkv, down
             (its splits unmerged, merged as o_proj loads them, where D % 128 == 0)
    gate_up  reads o (norm)
    down     reads gate_up (silu), adds o

One buffer per projection serves every layer, allocated zero; every T = 1 forward runs whole
layers, so the rule holds across steps, eager runs and CUDA-graph replays alike. The residual
stream stays fp32 between layers (one rounding less than the bf16 path); the model rounds the
last layer's output to its dtype before the final norm.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pdserve.engine.model.fp8 import Fp8Linear
from pdserve.engine.model.layers import SwiGLUMLP, fused_kernels


@dataclass(frozen=True)
class TcBuffers:
    """fp32 [1, N] outputs of the four projections, and res [1, hidden] (the residual for
    o_proj's add): see the module doc for who zeroes which. merge: o_proj merges the
    attention's splits (head_dim a multiple of 128)."""
    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    res: torch.Tensor
    merge: bool = True

    @staticmethod
    def for_layer(layer: nn.Module, device: torch.device, merge: bool = True) -> TcBuffers:
        attn, mlp = layer.self_attn, layer.mlp

        def zeros(n: int) -> torch.Tensor:
            return torch.zeros(1, n, dtype=torch.float32, device=device)
        return TcBuffers(zeros(attn.qkv_proj.out_features), zeros(attn.o_proj.out_features),
                         zeros(mlp.gate_up_proj.out_features), zeros(mlp.down_proj.out_features),
                         zeros(attn.o_proj.out_features), merge and attn.head_dim % 128 == 0)


def tc_layer_fits(layer: nn.Module) -> bool:
    """A dense SwiGLU layer whose four projections are 128 x 128 block-FP8 weights the kernel
    takes, no q/k/v bias, and the attention prologue fused into the decode kernel."""
    attn, mlp = layer.self_attn, layer.mlp
    if not isinstance(mlp, SwiGLUMLP) or not attn.prologue_kernel:
        return False
    mods = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    fits = fused_kernels().fp8_gemv_tc_fits
    return attn.qkv_proj.bias is None and all(
        isinstance(m, Fp8Linear) and fits(m.weight, m.block) for m in mods)


def forward_tc(layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               meta, kv_cache: torch.Tensor, b: TcBuffers) -> torch.Tensor:
    """The layer for one token: x [1, hidden] (the residual stream, fp32 or the embedding's
    dtype) -> the next residual stream, b.down (fp32; read it before the next layer's
    o_proj zeroes it)."""
    attn, mlp = layer.self_attn, layer.mlp
    ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
    gemv = fused_kernels().fp8_gemv_tc

    def w(m: Fp8Linear) -> tuple[torch.Tensor, torch.Tensor]:
        return m.weight, m.weight_scale
    gemv(x, *w(attn.qkv_proj), "norm", ln1.weight, ln1.eps, out=b.qkv, res_out=b.res,
         zero=(b.o, b.gate_up))
    # the attention's splits merged by o_proj as it loads them: no arrival atomic, no merge
    # round trip in the latency-bound attention (docs/design.md, "Session 35")
    o = attn.attend_qkv(b.qkv, cos, sin, meta, kv_cache, compute_dtype=ln1.weight.dtype,
                        partials=b.merge)
    # o_proj follows the latency-bound attention: part of its ring waits (tc_plan)
    gemv(o, *w(attn.o_proj), "none" if torch.is_tensor(o) else "merge", out=b.o, add=b.res,
         zero=(b.qkv, b.down), light_prefill=True)
    gemv(b.o, *w(mlp.gate_up_proj), "norm", ln2.weight, ln2.eps, out=b.gate_up)
    gemv(b.gate_up, *w(mlp.down_proj), "silu", out=b.down, add=b.o)
    return b.down

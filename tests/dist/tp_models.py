"""Tiny transformers checkpoints for the tensor-parallel engine tests: Qwen3 (4 heads, 2 KV
heads), Llama with 1 KV head (replicated at TP 2) and Qwen3-MoE, made with transformers' own
classes and saved with save_pretrained (loaded through our loader)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
VOCAB = 101  # divides by neither 2 nor 3: the last rank's vocabulary rows are padding


def _config(family: str) -> transformers.PretrainedConfig:
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, rms_norm_eps=1e-6, max_position_embeddings=256,
                  tie_word_embeddings=False, rope_parameters=_ROPE)
    if family == "qwen3":
        return transformers.Qwen3Config(num_key_value_heads=2, head_dim=16, **common)
    if family == "llama_1kv":
        return transformers.LlamaConfig(num_key_value_heads=1, **common)
    return transformers.Qwen3MoeConfig(  # layer 1 dense; 8 experts, top 2
        num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], **common)


def save_tiny(family: str, folder: Path) -> Path:
    """A transformers model of `family` with O(1) random weights, saved as a checkpoint."""
    torch.manual_seed(0)
    cfg = _config(family)
    cfg._attn_implementation = "eager"
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name
                    else torch.randn_like(p) / p.shape[-1] ** 0.5)
    hf.save_pretrained(folder)
    return folder

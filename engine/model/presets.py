"""Named model shapes for random-weight runs (benchmarks, tests) and their parameter counts.

The real models' shapes are copied from their published config.json files, so a preset
benchmarks the same matmuls and KV sizes as the real checkpoint.
"""
from __future__ import annotations

import dataclasses

from pdserve.engine.core.config import ConfigError, ModelConfig, MoEConfig, RopeScaling

_QWEN_EOS = (151645, 151643)
_GLM_EOS = (151329, 151336, 151338)

_PRESETS: dict[str, ModelConfig] = {
    "qwen3-8b": ModelConfig(
        arch="qwen3", vocab_size=151936, hidden_size=4096, num_layers=36, num_heads=32,
        num_kv_heads=8, head_dim=128, intermediate_size=12288, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False, qk_norm=True,
        max_position_embeddings=40960, bos_token_id=None, eos_token_ids=(151645, 151643)),
    "qwen3-0.6b": ModelConfig(
        arch="qwen3", vocab_size=151936, hidden_size=1024, num_layers=28, num_heads=16,
        num_kv_heads=8, head_dim=128, intermediate_size=3072, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True, qk_norm=True,
        max_position_embeddings=40960, bos_token_id=None, eos_token_ids=(151645, 151643)),
    "llama-3-8b": ModelConfig(
        arch="llama", vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, intermediate_size=14336, rope_theta=500_000.0,
        rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192),
        rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=131072,
        bos_token_id=128000, eos_token_ids=(128001, 128008, 128009)),
    "smollm2-135m": ModelConfig(
        arch="llama", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, intermediate_size=1536, rope_theta=100_000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=8192,
        bos_token_id=1, eos_token_ids=(2,)),
    "qwen2.5-7b": ModelConfig(
        arch="qwen2", vocab_size=152064, hidden_size=3584, num_layers=28, num_heads=28,
        num_kv_heads=4, head_dim=128, intermediate_size=18944, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=True,
        max_position_embeddings=32768, bos_token_id=None, eos_token_ids=_QWEN_EOS),
    # MiMo-7B (Base / RL): Qwen2-shaped with q/k/v biases, plus one MTP layer
    "mimo-7b": ModelConfig(
        arch="mimo", vocab_size=151680, hidden_size=4096, num_layers=36, num_heads=32,
        num_kv_heads=8, head_dim=128, intermediate_size=11008, rope_theta=640_000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=True,
        max_position_embeddings=32768, num_mtp_layers=1, bos_token_id=None,
        eos_token_ids=_QWEN_EOS),
    "qwen3-30b-a3b": ModelConfig(
        arch="qwen3_moe", vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32,
        num_kv_heads=4, head_dim=128, intermediate_size=6144, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False, qk_norm=True,
        max_position_embeddings=40960, bos_token_id=None, eos_token_ids=_QWEN_EOS,
        moe=MoEConfig(num_experts=128, top_k=8, intermediate_size=768, scoring="softmax",
                      norm_topk_prob=True)),
    "qwen3-235b-a22b": ModelConfig(
        arch="qwen3_moe", vocab_size=151936, hidden_size=4096, num_layers=94, num_heads=64,
        num_kv_heads=4, head_dim=128, intermediate_size=12288, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False, qk_norm=True,
        max_position_embeddings=40960, bos_token_id=None, eos_token_ids=_QWEN_EOS,
        moe=MoEConfig(num_experts=128, top_k=8, intermediate_size=1536, scoring="softmax",
                      norm_topk_prob=True)),
    # GLM-4.5-Air (106B-A12B) and GLM-4.5 (355B-A32B): RoPE on half of each head, q/k/v
    # biases, sigmoid routing with a correction bias, a shared expert, dense first layers,
    # one MTP layer
    "glm-4.5-air": ModelConfig(
        arch="glm4_moe", vocab_size=151552, hidden_size=4096, num_layers=46, num_heads=96,
        num_kv_heads=8, head_dim=128, intermediate_size=10944, rope_theta=1_000_000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=True,
        partial_rotary_factor=0.5, max_position_embeddings=131072, num_mtp_layers=1,
        bos_token_id=None, eos_token_ids=_GLM_EOS,
        moe=MoEConfig(num_experts=128, top_k=8, intermediate_size=1408, scoring="sigmoid",
                      norm_topk_prob=True, correction_bias=True, routed_scaling_factor=1.0,
                      num_shared_experts=1, dense_layers=(0,))),
    "glm-4.5": ModelConfig(
        arch="glm4_moe", vocab_size=151552, hidden_size=5120, num_layers=92, num_heads=96,
        num_kv_heads=8, head_dim=128, intermediate_size=12288, rope_theta=1_000_000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, qk_norm=True, attention_bias=True,
        partial_rotary_factor=0.5, max_position_embeddings=131072, num_mtp_layers=1,
        bos_token_id=None, eos_token_ids=_GLM_EOS,
        moe=MoEConfig(num_experts=160, top_k=8, intermediate_size=1536, scoring="sigmoid",
                      norm_topk_prob=True, correction_bias=True, routed_scaling_factor=2.5,
                      num_shared_experts=1, dense_layers=(0, 1, 2))),
    # tiny shapes for CPU tests: odd-ish sizes, GQA, both tying modes
    "tiny-llama": ModelConfig(
        arch="llama", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, intermediate_size=160, rope_theta=10_000.0,
        rope_scaling=RopeScaling(factor=8.0, original_max_position_embeddings=64),
        rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=1024,
        bos_token_id=1, eos_token_ids=(2,)),
    "tiny-qwen3": ModelConfig(
        arch="qwen3", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=32, intermediate_size=128, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False, qk_norm=True,
        max_position_embeddings=1024, bos_token_id=None, eos_token_ids=(2,)),
    "tiny-qwen2": ModelConfig(
        arch="qwen2", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, intermediate_size=128, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6, attention_bias=True, max_position_embeddings=1024,
        eos_token_ids=(2,)),
    "tiny-mimo": ModelConfig(
        arch="mimo", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, intermediate_size=128, rope_theta=640_000.0,
        rms_norm_eps=1e-5, attention_bias=True, max_position_embeddings=1024,
        num_mtp_layers=1, eos_token_ids=(2,)),
    # 16 experts, top 4: a few-token batch leaves experts without tokens
    "tiny-qwen3-moe": ModelConfig(
        arch="qwen3_moe", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, intermediate_size=128, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6, qk_norm=True, max_position_embeddings=1024, eos_token_ids=(2,),
        moe=MoEConfig(num_experts=16, top_k=4, intermediate_size=32, scoring="softmax",
                      norm_topk_prob=True)),
    "tiny-glm4-moe": ModelConfig(
        arch="glm4_moe", vocab_size=512, hidden_size=64, num_layers=3, num_heads=4,
        num_kv_heads=2, head_dim=32, intermediate_size=128, rope_theta=1_000_000.0,
        rms_norm_eps=1e-5, qk_norm=True, attention_bias=True, partial_rotary_factor=0.5,
        max_position_embeddings=1024, num_mtp_layers=1, eos_token_ids=(2,),
        moe=MoEConfig(num_experts=16, top_k=4, intermediate_size=32, scoring="sigmoid",
                      norm_topk_prob=True, correction_bias=True, n_group=4, topk_group=2,
                      routed_scaling_factor=2.5, num_shared_experts=1, dense_layers=(0,))),
}


def preset_names() -> list[str]:
    return sorted(_PRESETS)


def is_preset(name: str) -> bool:
    """A preset name, optionally cut to N decoder layers: "glm-4.5-air:8l"."""
    base, _, cut = name.lower().partition(":")
    return base in _PRESETS and (not cut or (cut.endswith("l") and cut[:-1].isdigit()
                                             and int(cut[:-1]) >= 1))


def get_preset(name: str) -> ModelConfig:
    """The ModelConfig of a named shape; "NAME:Nl" keeps the first N decoder layers (MTP layers
    stay), for benchmarking a model larger than the device at its real layer shapes. Unknown
    names raise ConfigError naming `model`."""
    if not is_preset(name):
        raise ConfigError(f"model: unknown preset {name!r}; known presets: "
                          f"{', '.join(preset_names())} (cut to N layers: NAME:Nl)")
    base, _, cut = name.lower().partition(":")
    cfg = _PRESETS[base]
    return dataclasses.replace(cfg, num_layers=int(cut[:-1])) if cut else cfg


def param_count(cfg: ModelConfig) -> int:
    """Parameters of the decoder by arithmetic (tied embeddings counted once, MTP excluded),
    so big shapes can be checked without allocating them."""
    h, d = cfg.hidden_size, cfg.head_dim
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * d
    attn = h * qkv + cfg.num_heads * d * h + (qkv if cfg.attention_bias else 0)
    qk_norm = 2 * d if cfg.qk_norm else 0
    per_layer = attn + qk_norm + 2 * h  # + input and post-attention norms
    layers = sum(per_layer + mlp_param_count(cfg, i) for i in range(cfg.num_layers))
    embed = cfg.vocab_size * h
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
    return embed + layers + h + head  # + final norm


def mlp_param_count(cfg: ModelConfig, layer: int, active: bool = False) -> int:
    """Parameters of layer `layer`'s MLP; active: only those one token reads (top_k experts)."""
    h, moe = cfg.hidden_size, cfg.moe
    if moe is None or not moe.is_moe_layer(layer):
        return 3 * h * cfg.intermediate_size
    experts = (moe.top_k if active else moe.num_experts) * 3 * h * moe.intermediate_size
    shared = 3 * h * moe.intermediate_size * moe.num_shared_experts
    router = moe.num_experts * h + (moe.num_experts if moe.correction_bias else 0)
    return experts + shared + router

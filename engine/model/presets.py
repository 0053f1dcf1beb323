"""Named model shapes for random-weight runs (benchmarks, tests) and their parameter counts.

The real models' shapes are copied from their published config.json files, so a preset
benchmarks the same matmuls and KV sizes as the real checkpoint.
"""
from __future__ import annotations

from pdserve.engine.core.config import ConfigError, ModelConfig, RopeScaling

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
}


def preset_names() -> list[str]:
    return sorted(_PRESETS)


def get_preset(name: str) -> ModelConfig:
    """The ModelConfig of a named shape; unknown names raise ConfigError naming `model`."""
    cfg = _PRESETS.get(name.lower())
    if cfg is None:
        raise ConfigError(f"model: unknown preset {name!r}; known presets: {', '.join(preset_names())}")
    return cfg


def param_count(cfg: ModelConfig) -> int:
    """Parameters of the decoder by arithmetic (tied embeddings counted once, MTP excluded),
    so big shapes can be checked without allocating them."""
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * cfg.num_heads * d + 2 * h * cfg.num_kv_heads * d + cfg.num_heads * d * h
    qk_norm = 2 * d if cfg.qk_norm else 0
    mlp = 3 * h * cfg.intermediate_size
    per_layer = attn + qk_norm + mlp + 2 * h  # + input and post-attention norms
    embed = cfg.vocab_size * h
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
    return embed + cfg.num_layers * per_layer + h + head  # + final norm

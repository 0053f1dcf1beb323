"""Model families: how a Hugging Face config.json (its model_type) becomes a ModelConfig, and
which of its values pdserve refuses.

A family is a row of FAMILIES: the transformers classes it stands for, the ModelConfig fields
it sets beyond the common shape (q/k/v biases, QK-norm, partial rotary, the MoE block) and
the config values it does not implement, refused by name. The decoder never asks which family
it runs: it builds its parts from those fields (engine/model/decoder.py, moe.py). Tensor names
are transformers' for every family (engine/model/weights.py maps them), and checkpoints' MTP
layers are found by engine/model/mtp_names.py.

No torch here; errors are ConfigError naming the config.json field (weights.py adds the path).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pdserve.engine.core.config import ConfigError, ModelConfig, MoEConfig, RopeScaling
from pdserve.engine.model.mtp_names import hf_num_mtp_layers

# (config.json field, ok(value), what is supported): a value that is present and not ok is refused
Refusal = tuple[str, Callable[[object], bool], str]


def _off(v: object) -> bool:
    return not v


def _full_attention(v: object) -> bool:
    return not v or all(t == "full_attention" for t in v)  # type: ignore[union-attr]


COMMON: tuple[Refusal, ...] = (
    ("hidden_act", lambda v: v == "silu", "SiLU-gated MLPs only"),
    ("mlp_bias", _off, "no MLP biases"),
    ("use_sliding_window", _off, "full attention only"),
    ("layer_types", _full_attention, "full attention only"),
    ("quantization_config", _off, "unquantized checkpoints only"),
)
NO_QKV_BIAS: Refusal = ("attention_bias", _off, "no q/k/v biases in this family")


@dataclass(frozen=True)
class Family:
    arch: str  # ModelConfig.arch
    architectures: tuple[str, ...]  # transformers' class names (config.json "architectures")
    fields: Callable[[dict], dict]  # config.json -> this family's extra ModelConfig fields
    refused: tuple[Refusal, ...] = ()
    partial_rotary: bool = False  # reads partial_rotary_factor (others refuse one below 1)


def _first(d: dict, *names: str) -> object:
    """The value of the first of `names` present (spellings differ across transformers
    versions); KeyError naming the first when none is."""
    for name in names:
        if d.get(name) is not None:
            return d[name]
    raise KeyError(names[0])


def _qwen3_moe(d: dict) -> dict:
    layers, step = d["num_hidden_layers"], d.get("decoder_sparse_step") or 1
    only = set(d.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step != 0)
    # Qwen's checkpoints say num_experts; transformers 5's save_pretrained, num_local_experts
    return {"qk_norm": True, "moe": MoEConfig(
        num_experts=_first(d, "num_experts", "num_local_experts"), top_k=d["num_experts_per_tok"],
        intermediate_size=d["moe_intermediate_size"], scoring="softmax",
        norm_topk_prob=bool(d.get("norm_topk_prob", False)), dense_layers=dense)}


def _glm4_moe(d: dict) -> dict:
    return {"attention_bias": bool(d.get("attention_bias")), "qk_norm": bool(d.get("use_qk_norm")),
            "moe": MoEConfig(
                num_experts=_first(d, "n_routed_experts", "num_local_experts"),
                top_k=d["num_experts_per_tok"],
                intermediate_size=d["moe_intermediate_size"], scoring="sigmoid",
                norm_topk_prob=bool(d.get("norm_topk_prob", True)), correction_bias=True,
                n_group=d.get("n_group") or 1, topk_group=d.get("topk_group") or 1,
                routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
                num_shared_experts=d.get("n_shared_experts", 1),
                dense_layers=tuple(range(d.get("first_k_dense_replace", 1))))}


# config.json model_type -> family
FAMILIES: dict[str, Family] = {
    "llama": Family("llama", ("LlamaForCausalLM",), lambda d: {}, (NO_QKV_BIAS,)),
    "qwen3": Family("qwen3", ("Qwen3ForCausalLM",), lambda d: {"qk_norm": True}, (NO_QKV_BIAS,)),
    # Qwen2 / Qwen2.5 and MiMo (Qwen2 + MTP layers) always carry q/k/v biases
    "qwen2": Family("qwen2", ("Qwen2ForCausalLM",), lambda d: {"attention_bias": True}),
    "mimo": Family("mimo", ("MiMoForCausalLM",), lambda d: {"attention_bias": True}),
    "qwen3_moe": Family("qwen3_moe", ("Qwen3MoeForCausalLM",), _qwen3_moe, (
        NO_QKV_BIAS,
        ("shared_expert_intermediate_size", _off, "no shared expert in Qwen3-MoE"))),
    "glm4_moe": Family("glm4_moe", ("Glm4MoeForCausalLM",), _glm4_moe, (
        ("scoring_func", lambda v: v == "sigmoid", "sigmoid routing"),
        ("topk_method", lambda v: v == "noaux_tc", "noaux_tc (correction-biased) top-k")),
        partial_rotary=True),
}


def family_of(d: dict) -> Family:
    """By model_type; a config.json without one by its architectures (transformers' class)."""
    model_type = d.get("model_type")
    family = FAMILIES.get(model_type)  # type: ignore[arg-type]
    if family is None and model_type is None:
        archs = d.get("architectures") or []
        family = next((f for f in FAMILIES.values() if set(archs) & set(f.architectures)), None)
    if family is None:
        raise ConfigError(f"model_type {model_type!r} is not supported ({sorted(FAMILIES)})")
    return family


def _refuse(d: dict, model_type: str, refusals: tuple[Refusal, ...]) -> None:
    for name, ok, supported in refusals:
        if d.get(name) is not None and not ok(d[name]):
            raise ConfigError(f"{name}: {d[name]!r} is not supported for {model_type} "
                              f"({supported})")


def _rope(d: dict, partial_rotary: bool) -> dict:
    """theta, Llama-3 scaling and partial rotary from transformers 4.x (top-level rope_theta,
    rope_scaling, partial_rotary_factor) or 5.x (all in rope_parameters) spellings."""
    rope = d.get("rope_parameters") or {}
    legacy = d.get("rope_scaling") or {}
    kind = rope.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
    scale_src = rope if rope.get("rope_type") not in (None, "default") else legacy
    scaling = None
    if kind == "llama3":
        scaling = RopeScaling(
            factor=float(scale_src["factor"]),
            low_freq_factor=float(scale_src["low_freq_factor"]),
            high_freq_factor=float(scale_src["high_freq_factor"]),
            original_max_position_embeddings=int(scale_src["original_max_position_embeddings"]))
    elif kind != "default":
        raise ConfigError(f"rope_type: {kind!r} is not supported (default, llama3)")
    partial = float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)))
    if partial != 1.0 and not partial_rotary:
        raise ConfigError(f"partial_rotary_factor: {partial} is not supported for "
                          f"{d.get('model_type')} (whole-head RoPE only)")
    return {"rope_theta": float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
            "rope_scaling": scaling, "partial_rotary_factor": partial}


def hf_model_config(d: dict) -> ModelConfig:
    """config.json -> ModelConfig. Raises ConfigError naming a refused or invalid field, and
    KeyError for a missing required one."""
    family = family_of(d)
    _refuse(d, family.arch, COMMON + family.refused)
    heads, hidden = d["num_attention_heads"], d["hidden_size"]
    eos = d.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return ModelConfig(
        arch=family.arch, vocab_size=d["vocab_size"], hidden_size=hidden,
        num_layers=d["num_hidden_layers"], num_heads=heads,
        num_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or hidden // heads,
        intermediate_size=d["intermediate_size"],
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        max_position_embeddings=d.get("max_position_embeddings", 4096),
        num_mtp_layers=hf_num_mtp_layers(d),  # what the checkpoint has; the engine keeps 0
        bos_token_id=d.get("bos_token_id"), eos_token_ids=eos_ids,  # unless MTP is on
        **_rope(d, family.partial_rotary), **family.fields(d))

"""Frozen configuration, one dataclass per concern, validated once at the edge.

ModelConfig describes a decoder's shape and ModelIdentity which weights and tokenizer fill it
(both are covered by the KV compatibility hash); CacheConfig the paged KV pool; SchedulerConfig
the batching limits; EngineConfig ties them.
No torch here: the scheduler and block manager import this module.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


def _require(cond: bool, field_name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{field_name}: {msg}")


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling ("rope_type": "llama3")."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


ARCHS = ("llama", "qwen3", "qwen2", "mimo", "qwen3_moe", "glm4_moe")
SCORINGS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEConfig:
    """The mixture-of-experts MLP of Qwen3-MoE (softmax routing) and GLM-4.5 (sigmoid routing,
    correction bias, expert groups, a shared expert, dense first layers). Routing follows
    kernels/reference.py moe_route_ref, whose arguments these fields are."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per routed expert (HF moe_intermediate_size)
    scoring: str = "softmax"  # "softmax" (Qwen3-MoE) | "sigmoid" (GLM-4.5, DeepSeek-V3)
    norm_topk_prob: bool = True  # renormalise the top-k weights to sum to 1
    correction_bias: bool = False  # e_score_correction_bias [E]: added for the choice only
    n_group: int = 1  # experts fall into n_group groups; only the topk_group best are eligible
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    num_shared_experts: int = 0  # one SwiGLU MLP of intermediate_size * num_shared_experts
    dense_layers: tuple[int, ...] = ()  # decoder layers with the dense MLP instead (GLM's
    # first_k_dense_replace, Qwen3-MoE's mlp_only_layers / decoder_sparse_step)

    def __post_init__(self) -> None:
        _require(self.num_experts > 0, "num_experts", "must be > 0")
        _require(0 < self.top_k <= self.num_experts, "num_experts_per_tok",
                 f"must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        _require(self.intermediate_size > 0, "moe_intermediate_size", "must be > 0")
        _require(self.scoring in SCORINGS, "scoring_func",
                 f"{self.scoring!r} is not supported {SCORINGS}")
        _require(self.n_group > 0 and self.num_experts % self.n_group == 0, "n_group",
                 f"{self.n_group} does not divide num_experts={self.num_experts}")
        _require(0 < self.topk_group <= self.n_group, "topk_group",
                 f"must be in [1, n_group={self.n_group}], got {self.topk_group}")
        eligible = self.topk_group * (self.num_experts // self.n_group)
        _require(self.top_k <= eligible, "topk_group",
                 f"{self.topk_group} groups hold {eligible} experts, fewer than top_k={self.top_k}")
        _require(self.n_group == 1 or self.scoring == "sigmoid", "n_group",
                 "expert groups need sigmoid scoring")
        _require(self.n_group == 1 or self.num_experts // self.n_group >= 2, "n_group",
                 "a group scores its best two experts, so it needs at least two")
        _require(self.num_shared_experts >= 0, "n_shared_experts", "must be >= 0")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` (or MTP layer num_layers + i) routes to experts."""
        return layer not in self.dense_layers


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder (+ optional MTP layers): Llama / Qwen3 / Qwen2 / MiMo dense, Qwen3-MoE
    and GLM-4.5 mixture of experts. The decoder picks its per-layer parts from these fields
    (engine/model/decoder.py); engine/model/families.py fills them from config.json."""

    arch: str  # one of ARCHS
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # the dense MLP's (MoE models: their dense layers')
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qk_norm: bool = False  # Qwen3, GLM-4.5 (use_qk_norm): RMSNorm over head_dim on q and k
    max_position_embeddings: int = 4096
    num_mtp_layers: int = 0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    attention_bias: bool = False  # Qwen2, MiMo, GLM-4.5: biases on q, k and v (not o)
    partial_rotary_factor: float = 1.0  # GLM-4.5: RoPE on the first half of each head only
    moe: MoEConfig | None = None  # None: every layer has the dense SwiGLU MLP

    def __post_init__(self) -> None:
        _require(self.arch in ARCHS, "arch", f"unknown architecture {self.arch!r}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size", "max_position_embeddings"):
            _require(getattr(self, name) > 0, name, "must be > 0")
        _require(self.num_heads % self.num_kv_heads == 0, "num_kv_heads",
                 f"num_heads {self.num_heads} is not a multiple of {self.num_kv_heads}")
        _require(self.num_mtp_layers >= 0, "num_mtp_layers", "must be >= 0")
        rot = self.head_dim * self.partial_rotary_factor
        _require(0 < self.partial_rotary_factor <= 1 and rot == int(rot) and int(rot) % 2 == 0,
                 "partial_rotary_factor", f"{self.partial_rotary_factor} of head_dim "
                 f"{self.head_dim} is not an even number of dimensions")

    @property
    def num_kv_layers(self) -> int:
        """Layers that own a KV cache: the decoder's plus the MTP layers' (one block holds all)."""
        return self.num_layers + self.num_mtp_layers

    @property
    def rotary_dim(self) -> int:
        """Leading dimensions of each q/k head that RoPE rotates (the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)


@dataclass(frozen=True)
class ModelIdentity:
    """WHICH weights and tokenizer fill a ModelConfig's shape. Two fine-tunes of one architecture
    share the shape, yet one's KV means nothing to the other: a pair that differs here would
    answer wrongly with a 200, so the KV compatibility payload carries it and the handshake
    refuses naming the field. Built once at load (engine/model/loader.py model_identity) from
    cheap fingerprints (engine/model/identity.py), never from paths, so a copy is the same."""

    weights: str  # "safetensors:<digest>", "gguf:<digest>" or "preset:<name>:seed=<n>"
    tokenizer: str | None  # digest of the tokenizer files or GGUF metadata; None: no tokenizer
    quantization: str | None = None  # at load ("fp8"): other weights in memory than on disk


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int = 1024
    kv_dtype: str = "float32"  # torch dtype name; "bfloat16" on GPU
    enable_prefix_caching: bool = True
    # "fp8": blocks hold e4m3 values plus a scale per (block, layer, KV head); "auto": kv_dtype
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        _require(self.block_size > 0, "block_size", "must be > 0")
        _require(self.num_blocks > 0, "num_blocks", "must be > 0")
        _require(self.kv_dtype in ("float32", "float16", "bfloat16"), "kv_dtype",
                 f"unsupported {self.kv_dtype!r}")
        _require(self.kv_cache_dtype in ("auto", "fp8"), "kv_cache_dtype",
                 f"must be 'auto' or 'fp8', got {self.kv_cache_dtype!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # sequences in one step
    max_num_batched_tokens: int = 2048  # token budget per step (prefill chunks + decodes)
    max_model_len: int = 4096
    # waiting order and preemption: "fcfs" (arrival) or "priority" (SamplingParams.priority,
    # lower first, then arrival; engine/core/request_queue.py)
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        _require(self.policy in SCHEDULING_POLICIES, "scheduling_policy",
                 f"must be one of {SCHEDULING_POLICIES}, got {self.policy!r}")
        _require(self.max_num_seqs > 0, "max_num_seqs", "must be > 0")
        _require(self.max_num_batched_tokens > 0, "max_num_batched_tokens", "must be > 0")
        _require(self.max_model_len > 0, "max_model_len", "must be > 0")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "cpu"
    dtype: str = "float32"  # weights / activations
    use_triton: bool = False  # fused Triton kernels (CUDA); False = torch reference path
    use_cuda_graphs: bool = False
    # launch the next decode forward before reading this step's tokens (engine/exec/overlap.py):
    # "auto" = with CUDA graphs (where it pays), "on" = also eagerly (tests), "off"
    overlap_decode: str = "auto"
    seed: int = 0
    # which weights and tokenizer the model was loaded from (build_engine sets it); None for
    # an engine assembled by hand, which the compat payload then says (a loaded peer refuses it)
    identity: ModelIdentity | None = None

    def __post_init__(self) -> None:
        _require(self.overlap_decode in ("auto", "on", "off"), "overlap_decode",
                 f"must be 'auto', 'on' or 'off', got {self.overlap_decode!r}")

    def with_(self, **changes: object) -> EngineConfig:
        return replace(self, **changes)


# 2: heads outermost inside a block, [NB, Hkv, L (+ S), 2, BS, D], each head's fp8 scales in
# its own region (engine/exec/kv_cache.py); 1 was [NB, L (+ S), 2, BS, Hkv, D]
KV_LAYOUT_VERSION = 2
SCALE_BYTES = 4  # an fp8 cache's scale: one fp32 per (block, layer, K/V, KV head)


def scale_layers(num_kv_layers: int, block_size: int, head_dim: int) -> int:
    """Trailing pseudo-layers of each head's region of an fp8 cache block (2 * block_size *
    head_dim bytes each) that hold that head's num_kv_layers * 2 fp32 scales:
    ceil(4 L / (block_size * D)) (engine/exec/kv_cache.py)."""
    return -(-(num_kv_layers * SCALE_BYTES) // (block_size * head_dim))


def kv_format(model: ModelConfig, cache: CacheConfig) -> dict:
    """The cache format part of the compatibility payload: value dtype and scale layout, so
    peers that would read each other's blocks differently refuse at the handshake naming it."""
    if cache.kv_cache_dtype != "fp8":
        return {"kv_cache_dtype": "auto", "kv_scales": None}
    return {"kv_cache_dtype": "fp8",
            "kv_scales": {"values": "float8_e4m3fn", "dtype": "float32",
                          "per": "block,layer,k_v,kv_head",
                          "placement": "head_region_trailing_layers",
                          "scale_layers": scale_layers(model.num_kv_layers, cache.block_size,
                                                       model.head_dim)}}


def compat_payload(model: ModelConfig, cache: CacheConfig, extra: dict | None = None,
                   identity: ModelIdentity | None = None) -> dict:
    """Everything that must agree for a KV block to mean the same on two workers: model shape
    and identity (which weights, tokenizer and load-time quantization: a refusal then reads
    "identity.weights: ... != ..."), block size, KV dtype and scale layout, layout version,
    and `extra` (the engine's speculation settings).
    The one place this payload is built; normalised through JSON (tuples -> lists, unknown
    objects -> str), so the local dict equals the one a peer receives and describe_mismatch
    only reports real differences."""
    payload = {
        "layout_version": KV_LAYOUT_VERSION,
        "model": asdict(model),
        "identity": asdict(identity) if identity is not None else None,
        "block_size": cache.block_size,
        "kv_dtype": "float8_e4m3fn" if cache.kv_cache_dtype == "fp8" else cache.kv_dtype,
        **kv_format(model, cache),
        "extra": extra or {},
    }
    return json.loads(json.dumps(payload, sort_keys=True, default=str))


def payload_hash(payload: dict) -> str:
    """The compatibility hash of a compat_payload (16 hex digits)."""
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def compatibility_hash(model: ModelConfig, cache: CacheConfig, extra: dict | None = None,
                       identity: ModelIdentity | None = None) -> str:
    """Hash of everything that must agree for a KV block to mean the same on two workers."""
    return payload_hash(compat_payload(model, cache, extra, identity))


def describe_mismatch(a: dict, b: dict, prefix: str = "") -> list[str]:
    """Human-readable list of fields that differ between two (nested) config dicts."""
    out: list[str] = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key), b.get(key)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += describe_mismatch(va, vb, f"{prefix}{key}.")
        elif va != vb:
            out.append(f"{prefix}{key}: {va!r} != {vb!r}")
    return out


SPECULATIVE_METHODS = ("mtp",)
# waiting order and preemption (engine/core/request_queue.py; vLLM's --scheduling-policy)
SCHEDULING_POLICIES = ("fcfs", "priority")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpecConfig:
    method: str = "mtp"
    num_speculative_tokens: int = 1  # k: drafts per step at most
    # adaptive k: ascending (max batch size, k cap) pairs; a batch above the last gets k = 0
    # (speculation stops paying once the batch already fills the GPU). () = always k.
    batch_k_caps: tuple[tuple[int, int], ...] = ((8, 3), (24, 2), (48, 1))
    # keep the MTP layer's KV current in steps that draft nothing (k = 0): costs one MTP
    # layer per step; without it drafts made later attend over stale MTP KV (acceptance only)
    maintain_mtp_kv: bool = True
    # accept every draft (WRONG tokens): ceiling benchmarks only, never the default
    forced_acceptance: bool = False
    # static-shape drafting (engine/spec/draft_graphs.py): "auto" = replayed as CUDA graphs when
    # the engine uses them, "on" = also run eagerly elsewhere (tests of the logic), "off"
    draft_graphs: str = "auto"
    # draft over the lowest N token ids (+ EOS) only: a cheaper draft LM head, verification
    # unchanged (MTPHead.use_draft_vocab); 0 = the full vocabulary
    draft_vocab: int = 0

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(f"speculative.method: unknown {self.method!r}; "
                              f"known: {SPECULATIVE_METHODS}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError("speculative.num_speculative_tokens: must be in "
                              f"[1, {MAX_SPECULATIVE_TOKENS}], got {self.num_speculative_tokens}")
        if self.draft_graphs not in ("auto", "on", "off"):
            raise ConfigError("speculative.draft_graphs: must be 'auto', 'on' or 'off', got "
                              f"{self.draft_graphs!r}")
        if isinstance(self.draft_vocab, bool) or not isinstance(self.draft_vocab, int) or \
                self.draft_vocab < 0:
            raise ConfigError("speculative.draft_vocab: must be an int >= 0 (0 = the full "
                              f"vocabulary), got {self.draft_vocab!r}")
        prev = 0
        for max_batch, cap in self.batch_k_caps:
            if max_batch <= prev or cap < 0:
                raise ConfigError("speculative.batch_k_caps: needs ascending batch sizes and "
                                  f"caps >= 0, got {self.batch_k_caps}")
            prev = max_batch

    def k_for_batch(self, batch_size: int) -> int:
        """Drafts per request for a step whose batch has `batch_size` running requests."""
        if not self.batch_k_caps:
            return self.num_speculative_tokens
        for max_batch, cap in self.batch_k_caps:
            if batch_size <= max_batch:
                return min(cap, self.num_speculative_tokens)
        return 0

    def max_drafting_batch(self, max_num_seqs: int) -> int:
        """The largest batch for which k_for_batch still drafts (verify graphs stop there)."""
        if not self.batch_k_caps:
            return max_num_seqs
        return min(max_num_seqs, max((b for b, cap in self.batch_k_caps if cap > 0), default=0))

    def compat(self, head_id: str) -> dict:
        """What the KV compatibility hash covers: the method and which MTP weights wrote the
        MTP layer's KV (k and the adaptive caps are per-worker tuning, not block content)."""
        return {"method": self.method, "head": head_id}

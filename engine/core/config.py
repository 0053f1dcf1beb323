"""Frozen configuration, one dataclass per concern, validated once at the edge.

ModelConfig describes a decoder's shape (it is also what the KV compatibility hash covers);
CacheConfig the paged KV pool; SchedulerConfig the batching limits; EngineConfig ties them.
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


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family / Qwen3 dense decoder (+ optional MTP layers)."""

    arch: str  # "llama" | "qwen3"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    max_position_embeddings: int = 4096
    num_mtp_layers: int = 0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _require(self.arch in ("llama", "qwen3"), "arch", f"unknown architecture {self.arch!r}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size", "max_position_embeddings"):
            _require(getattr(self, name) > 0, name, "must be > 0")
        _require(self.num_heads % self.num_kv_heads == 0, "num_kv_heads",
                 f"num_heads {self.num_heads} is not a multiple of {self.num_kv_heads}")
        _require(self.num_mtp_layers >= 0, "num_mtp_layers", "must be >= 0")

    @property
    def num_kv_layers(self) -> int:
        """Layers that own a KV cache: the decoder's plus the MTP layers' (one block holds all)."""
        return self.num_layers + self.num_mtp_layers


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int = 1024
    kv_dtype: str = "float32"  # torch dtype name; "bfloat16" on GPU
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _require(self.block_size > 0, "block_size", "must be > 0")
        _require(self.num_blocks > 0, "num_blocks", "must be > 0")
        _require(self.kv_dtype in ("float32", "float16", "bfloat16"), "kv_dtype",
                 f"unsupported {self.kv_dtype!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # sequences in one step
    max_num_batched_tokens: int = 2048  # token budget per step (prefill chunks + decodes)
    max_model_len: int = 4096

    def __post_init__(self) -> None:
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

    def __post_init__(self) -> None:
        _require(self.overlap_decode in ("auto", "on", "off"), "overlap_decode",
                 f"must be 'auto', 'on' or 'off', got {self.overlap_decode!r}")

    def with_(self, **changes: object) -> EngineConfig:
        return replace(self, **changes)


KV_LAYOUT_VERSION = 1


def compat_payload(model: ModelConfig, cache: CacheConfig, extra: dict | None = None) -> dict:
    """Everything that must agree for a KV block to mean the same on two workers: model shape,
    block size, KV dtype, layout version, and `extra` (the engine's speculation settings).
    The one place this payload is built; normalised through JSON (tuples -> lists, unknown
    objects -> str), so the local dict equals the one a peer receives and describe_mismatch
    only reports real differences."""
    payload = {
        "layout_version": KV_LAYOUT_VERSION,
        "model": asdict(model),
        "block_size": cache.block_size,
        "kv_dtype": cache.kv_dtype,
        "extra": extra or {},
    }
    return json.loads(json.dumps(payload, sort_keys=True, default=str))


def payload_hash(payload: dict) -> str:
    """The compatibility hash of a compat_payload (16 hex digits)."""
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def compatibility_hash(model: ModelConfig, cache: CacheConfig, extra: dict | None = None) -> str:
    """Hash of everything that must agree for a KV block to mean the same on two workers."""
    return payload_hash(compat_payload(model, cache, extra))


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

    def compat(self, head_id: str) -> dict:
        """What the KV compatibility hash covers: the method and which MTP weights wrote the
        MTP layer's KV (k and the adaptive caps are per-worker tuning, not block content)."""
        return {"method": self.method, "head": head_id}

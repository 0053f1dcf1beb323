"""EngineArgs: what a user chooses about one engine, frozen and validated once, at the edge.

build_engine, LLM, the `pdserve` CLI and WorkerConfig (which embeds it whole) all carry this
one object; nothing copies its fields. Speculative settings are validated here and only here:
the flat, flag-shaped fields (speculative, num_speculative_tokens, mtp_head, draft_vocab) or
a ready SpecConfig, turned into the engine's SpecConfig by spec_config().

    args = EngineArgs(model="qwen3-0.6b", device="cuda", speculative="mtp",
                      num_speculative_tokens=2)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pdserve.engine.core.config import (
    MAX_SPECULATIVE_TOKENS,
    SCHEDULING_POLICIES,
    SPECULATIVE_METHODS,
    ConfigError,
    SpecConfig,
)

OVERLAP_MODES = ("auto", "on", "off")
QUANTIZATIONS = ("fp8",)
KV_CACHE_DTYPES = ("auto", "fp8")  # auto: the model dtype; fp8: e4m3 with per-block scales


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class EngineArgs:
    model: str | None = None  # HF folder, .gguf, preset name; None = embedded SmolLM2
    device: str | None = None  # None: cuda when available, else cpu
    dtype: str | None = None  # None: bfloat16 on CUDA, float32 on CPU
    num_blocks: int | None = None  # KV blocks; None: sized from max_model_len
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's own
    enable_prefix_caching: bool = True
    # "fcfs" (arrival order) or "priority" (SamplingParams.priority, lower first; vLLM's
    # --scheduling-policy): the waiting order and who is preempted first
    scheduling_policy: str = "fcfs"
    # Triton kernels (fused norms, SiLU-mul, attention prologue, paged attention); on CPU they
    # run in Triton's interpreter (tests). CUDA graphs (needs use_triton, CUDA): decode steps
    # replay graphs captured when the engine is built (engine/exec/cuda_graphs.py).
    use_triton: bool = False
    use_cuda_graphs: bool = False
    # launch the next decode forward before the host reads this step's tokens
    # (engine/exec/overlap.py): "auto" (with CUDA graphs), "on" or "off"
    overlap_decode: str = "auto"
    seed: int = 0
    # MTP speculative decoding: "mtp" (or a SpecConfig), None = off. Every worker of a
    # disaggregated pool needs the same setting: the prefill worker runs the MTP layer over
    # the prompt so its KV travels with the target's (the KV handshake refuses a mismatch).
    speculative: str | SpecConfig | None = None
    num_speculative_tokens: int | None = None  # k; None = the SpecConfig's
    mtp_head: str | None = None  # a train-mtp file; None = the model's own / shipped head
    draft_vocab: int | None = None  # draft over N token ids only (SpecConfig.draft_vocab)
    # "fp8": a float checkpoint or preset quantized block-wise (128x128 e4m3) at load; FP8
    # checkpoints (quantization_config) load as FP8 without it. The FP8 weights run on the
    # torch path (dequantized per forward) until the FP8 kernels land: no use_triton yet.
    quantization: str | None = None
    # "fp8": the paged KV cache holds e4m3 values with a scale per (block, layer, KV head),
    # written by the attention prologue; "auto": the model dtype
    kv_cache_dtype: str = "auto"
    # ranks (devices) of one engine: column/row-parallel layers, KV heads split across ranks
    tensor_parallel_size: int = 1
    # run the step shapes serving will run before taking requests, so Triton compiles its
    # kernels' specializations at start-up rather than inside served steps (CUDA with
    # use_triton only; engine/exec/warmup.py)
    warmup: bool = True

    def __post_init__(self) -> None:
        if self.speculative == "none":  # the CLI's spelling of off
            object.__setattr__(self, "speculative", None)
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ConfigError(f"{name}: must be an int >= 1, got {value!r}")
        for name in ("num_blocks", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ConfigError(f"{name}: must be an int >= 1 or None, got {value!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"scheduling_policy: must be one of {SCHEDULING_POLICIES}, "
                              f"got {self.scheduling_policy!r}")
        if self.overlap_decode not in OVERLAP_MODES:
            raise ConfigError(f"overlap_decode: must be one of {OVERLAP_MODES}, "
                              f"got {self.overlap_decode!r}")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ConfigError(f"quantization: must be one of {QUANTIZATIONS} or None, "
                              f"got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype: must be one of {KV_CACHE_DTYPES}, "
                              f"got {self.kv_cache_dtype!r}")
        tp = self.tensor_parallel_size
        if not _is_int(tp) or tp < 1:
            raise ConfigError(f"tensor_parallel_size: must be an int >= 1, got {tp!r}")
        self._check_speculative()

    def _check_speculative(self) -> None:
        spec = self.speculative
        if spec is not None and not isinstance(spec, SpecConfig) and \
                spec not in SPECULATIVE_METHODS:
            raise ConfigError(f"speculative: must be one of {SPECULATIVE_METHODS}, a SpecConfig "
                              f"or None, got {spec!r}")
        k = self.num_speculative_tokens
        if k is not None and (not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS):
            raise ConfigError(f"num_speculative_tokens: must be an int in "
                              f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if self.mtp_head is not None and (not isinstance(self.mtp_head, str)
                                          or not self.mtp_head):
            raise ConfigError(f"mtp_head: must be a non-empty path, got {self.mtp_head!r}")
        dv = self.draft_vocab
        if dv is not None and (not _is_int(dv) or dv < 0):
            raise ConfigError(f"draft_vocab: must be an int >= 0, got {dv!r}")
        if spec is None:
            for name in ("num_speculative_tokens", "mtp_head", "draft_vocab"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"{name}: needs speculative='mtp'")

    def spec_config(self) -> SpecConfig | None:
        """The engine's speculative configuration, or None when speculation is off."""
        if self.speculative is None:
            return None
        spec = self.speculative if isinstance(self.speculative, SpecConfig) else \
            SpecConfig(method=self.speculative)
        if self.num_speculative_tokens is not None:
            spec = dataclasses.replace(spec, num_speculative_tokens=self.num_speculative_tokens)
        if self.draft_vocab is not None:
            spec = dataclasses.replace(spec, draft_vocab=self.draft_vocab)
        return spec

    def replace(self, **changes: object) -> EngineArgs:
        return dataclasses.replace(self, **changes)

"""WorkerConfig: everything one worker process needs, frozen and validated at the edge.

It crosses the Ray actor boundary as a plain dataclass (Ray's own control plane); the data
plane (gRPC, NIXL) never carries it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kv_transfer.faults import FaultConfig

ROLES = ("prefill", "decode", "colocated")
SPECULATIVE_METHODS = ("mtp",)
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class WorkerConfig:
    role: str
    worker_id: str
    model: str | None = None  # None = embedded default
    device: str = "cpu"
    dtype: str | None = None
    block_size: int = 16
    num_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    use_triton: bool = False
    use_cuda_graphs: bool = False  # decode steps replay CUDA graphs (needs use_triton, CUDA)
    host: str = "127.0.0.1"
    grpc_port: int = 0  # 0 = pick a free port
    metrics_port: int = 0  # 0 = pick a free port; -1 = no metrics server
    lease_ttl_s: float = 30.0
    transfer_timeout_s: float = 30.0
    faults: FaultConfig = field(default_factory=FaultConfig)  # test switches, off by default
    seed: int = 0
    # MTP speculative decoding (engine.llm.build_engine speculative=...). Every worker of a
    # disaggregated pool needs the same setting: the prefill worker runs the MTP layer over
    # the prompt so that layer's KV travels with the target's (the KV handshake refuses a
    # mismatch). None = off.
    speculative: str | None = None
    num_speculative_tokens: int | None = None  # k; None = the SpecConfig default
    mtp_head: str | None = None  # a train-mtp file; None = the model's own / the shipped head
    draft_vocab: int | None = None  # draft over N token ids only (SpecConfig.draft_vocab)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role: must be one of {ROLES}, got {self.role!r}")
        if not self.worker_id:
            raise ValueError("worker_id: must not be empty")
        if self.lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s: must be > 0, got {self.lease_ttl_s}")
        if self.transfer_timeout_s <= 0:
            raise ValueError(f"transfer_timeout_s: must be > 0, got {self.transfer_timeout_s}")
        if self.speculative is not None and self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative: must be one of {SPECULATIVE_METHODS} or None, "
                             f"got {self.speculative!r}")
        k = self.num_speculative_tokens
        if k is not None:
            if isinstance(k, bool) or not isinstance(k, int) or \
                    not 1 <= k <= MAX_SPECULATIVE_TOKENS:
                raise ValueError(f"num_speculative_tokens: must be an int in "
                                 f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
            if self.speculative is None:
                raise ValueError("num_speculative_tokens: needs speculative='mtp'")
        if self.mtp_head is not None:
            if not isinstance(self.mtp_head, str) or not self.mtp_head:
                raise ValueError(f"mtp_head: must be a non-empty path, got {self.mtp_head!r}")
            if self.speculative is None:
                raise ValueError("mtp_head: needs speculative='mtp'")
        if self.draft_vocab is not None:
            if isinstance(self.draft_vocab, bool) or not isinstance(self.draft_vocab, int) \
                    or self.draft_vocab < 0:
                raise ValueError(f"draft_vocab: must be an int >= 0, got {self.draft_vocab!r}")
            if self.speculative is None:
                raise ValueError("draft_vocab: needs speculative='mtp'")

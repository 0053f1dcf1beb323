"""WorkerConfig: everything one worker process needs, frozen and validated at the edge.

It crosses the Ray actor boundary as a plain dataclass (Ray's own control plane); the data
plane (gRPC, NIXL) never carries it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kv_transfer.faults import FaultConfig

ROLES = ("prefill", "decode", "colocated")


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

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role: must be one of {ROLES}, got {self.role!r}")
        if not self.worker_id:
            raise ValueError("worker_id: must not be empty")
        if self.lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s: must be > 0, got {self.lease_ttl_s}")
        if self.transfer_timeout_s <= 0:
            raise ValueError(f"transfer_timeout_s: must be > 0, got {self.transfer_timeout_s}")

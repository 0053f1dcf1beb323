"""ParallelConfig: one rank's place in a tensor-parallel worker, frozen and validated once."""
from __future__ import annotations

from dataclasses import dataclass, replace

from pdserve.engine.core.config import ConfigError

BACKENDS = ("gloo", "nccl")
# 8 MiB: a decode step of 1024 rows of hidden 4096 in bf16, so decode graphs never capture NCCL
GRAPH_ALL_REDUCE_BYTES = 8 << 20


@dataclass(frozen=True)
class ParallelConfig:
    """tp_size ranks of one worker; this process is `rank`. init_address is rank 0's
    "tcp://host:port" (the TCP store every rank joins); timeout_s bounds every wait once the
    group has formed: each collective (gloo raises after it; NCCL's watchdog aborts the
    communicator) and each lockstep receive on a follower. Forming it (reaching the store,
    every rank in the control group) may take join_timeout_s, or timeout_s where that is
    longer: ranks join once their shard has loaded, and a short timeout_s, chosen to catch a
    dead rank fast, must not fail a start where one rank loads a few seconds slower."""

    tp_size: int = 1
    rank: int = 0
    backend: str = "gloo"  # gloo on CPU, nccl on CUDA (for_device picks)
    init_address: str = ""  # "tcp://127.0.0.1:29512"; "" only when tp_size == 1
    timeout_s: float = 60.0
    device: str = "cpu"  # this rank's device, e.g. "cuda:1"
    # NCCL only: the receive buffer of the one-shot peer all-reduce that CUDA graph
    # captures (and a decode step's few collectives around them) use (peer_all_reduce.py);
    # larger all-reduces take NCCL. 0 (the default, and every group that captures no
    # graphs): not joined. with_graphs(True) sets GRAPH_ALL_REDUCE_BYTES: the offline
    # engine's ranks and a serving TP worker's, each side from the same engine config.
    peer_all_reduce_bytes: int = 0
    join_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        tp = self.tp_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ConfigError(f"tensor_parallel_size: must be an int >= 1, got {tp!r}")
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or not 0 <= self.rank < tp:
            raise ConfigError(f"rank: must be in [0, {tp}), got {self.rank!r}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend: must be one of {BACKENDS}, got {self.backend!r}")
        if self.backend == "nccl" and not self.device.startswith("cuda"):
            raise ConfigError(f"backend: nccl needs a CUDA device, got device={self.device!r}")
        if tp > 1 and not (self.init_address.startswith("tcp://")
                           and self.init_address.rpartition(":")[2].isdigit()):
            raise ConfigError(f"init_address: need 'tcp://host:port' for tensor_parallel_size="
                              f"{tp}, got {self.init_address!r}")
        b = self.peer_all_reduce_bytes
        if not isinstance(b, int) or isinstance(b, bool) or b < 0:
            raise ConfigError(f"peer_all_reduce_bytes: must be an int >= 0, got {b!r}")
        if not self.timeout_s > 0:
            raise ConfigError(f"timeout_s: must be > 0, got {self.timeout_s!r}")
        if not self.join_timeout_s > 0:
            raise ConfigError(f"join_timeout_s: must be > 0, got {self.join_timeout_s!r}")

    @property
    def join_deadline_s(self) -> float:
        """How long forming the group may take (see the class doc)."""
        return max(self.timeout_s, self.join_timeout_s)

    @property
    def is_leader(self) -> bool:
        """Rank 0 runs the scheduler and speaks gRPC; the others follow its steps."""
        return self.rank == 0

    @classmethod
    def for_device(cls, tp_size: int, rank: int, init_address: str, device: str,
                   timeout_s: float = 60.0) -> ParallelConfig:
        """nccl on CUDA devices, gloo elsewhere."""
        backend = "nccl" if device.startswith("cuda") else "gloo"
        return cls(tp_size, rank, backend, init_address, timeout_s, device)

    def with_graphs(self, graphs: bool) -> ParallelConfig:
        """This config for a group whose ranks capture CUDA graphs (`graphs`): they join the
        peer all-reduce (NCCL groups only). Every rank must decide from the same setting."""
        on = graphs and self.backend == "nccl"
        return replace(self, peer_all_reduce_bytes=GRAPH_ALL_REDUCE_BYTES if on else 0)

    def with_rank(self, rank: int) -> ParallelConfig:
        return replace(self, rank=rank)

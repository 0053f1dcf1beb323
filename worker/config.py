"""WorkerConfig: everything one worker process needs, frozen and validated at the edge.

The engine's part is one EngineArgs, embedded whole (validated there: model, cache, batch,
kernels, speculation); the fields here are the worker's own: role, identity, endpoints,
leases, KV transport. It crosses the Ray actor boundary as a plain dataclass (Ray's own
control plane); the data plane (gRPC, NIXL) never carries it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pdserve.engine.core.engine_args import EngineArgs
from pdserve.kv_transfer.faults import FaultConfig
from pdserve.kv_transfer.transport import TRANSPORTS
from pdserve.proto.rpc import check_cluster_secret

ROLES = ("prefill", "decode", "colocated")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# host "node": each worker binds and advertises its own Ray node's address (multi-node
# clusters: one flag for workers that land on different machines)
NODE_HOST = "node"


@dataclass(frozen=True)
class WorkerConfig:
    role: str
    worker_id: str
    # the credential every worker RPC must carry (proto/rpc.py); never printed
    cluster_secret: str = field(repr=False)
    engine: EngineArgs = field(default_factory=EngineArgs)
    host: str = "127.0.0.1"  # or NODE_HOST: resolved by the worker process (on_node)
    grpc_port: int = 0  # 0 = pick a free port
    metrics_port: int = 0  # 0 = pick a free port; -1 = no metrics server
    lease_ttl_s: float = 30.0
    transfer_timeout_s: float = 30.0
    # a tensor-parallel worker (engine.tensor_parallel_size > 1, worker/tp_worker.py): every
    # wait inside its group (joining, each collective, a rank's silence) ends after this
    tp_timeout_s: float = 60.0
    kv_transport: str = "nixl"  # kv_transfer.transport.TRANSPORTS: "nixl" | "inproc"
    faults: FaultConfig = field(default_factory=FaultConfig)  # test switches, off by default
    log_level: str = "info"  # the worker process's logging (pdserve serve passes --log-level)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role: must be one of {ROLES}, got {self.role!r}")
        if not self.worker_id:
            raise ValueError("worker_id: must not be empty")
        check_cluster_secret(self.cluster_secret)
        if not isinstance(self.engine, EngineArgs):
            raise TypeError(f"engine: expected EngineArgs, got {type(self.engine).__name__}")
        if self.lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s: must be > 0, got {self.lease_ttl_s}")
        if self.transfer_timeout_s <= 0:
            raise ValueError(f"transfer_timeout_s: must be > 0, got {self.transfer_timeout_s}")
        if self.engine.tensor_parallel_size > 1 and self.kv_transport == "inproc":
            raise ValueError(f"kv_transport: 'inproc' copies between engines of one process; "
                             f"a worker of engine.tensor_parallel_size="
                             f"{self.engine.tensor_parallel_size} is that many processes "
                             f"(use 'nixl')")
        if not self.tp_timeout_s > 0:
            raise ValueError(f"tp_timeout_s: must be > 0, got {self.tp_timeout_s}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level: must be one of {LOG_LEVELS}, got {self.log_level!r}")
        if self.kv_transport not in TRANSPORTS:
            raise ValueError(f"kv_transport: must be one of {sorted(TRANSPORTS)}, "
                             f"got {self.kv_transport!r}")

    def on_node(self) -> WorkerConfig:
        """This config with host "node" replaced by the address Ray knows this process's
        node by (called in the worker process, where Ray placed it)."""
        if self.host != NODE_HOST:
            return self
        import ray

        return dataclasses.replace(self, host=ray.util.get_node_ip_address())

    @classmethod
    def of(cls, role: str, worker_id: str, cluster_secret: str, **fields: object) -> WorkerConfig:
        """Shorthand for scripts and tests: fields of EngineArgs go into `engine`, the rest
        are the worker's own (an unknown name is a TypeError, as for any dataclass)."""
        names = {f.name for f in dataclasses.fields(EngineArgs)}
        engine = EngineArgs(**{k: v for k, v in fields.items() if k in names})  # type: ignore[arg-type]
        own = {k: v for k, v in fields.items() if k not in names}
        return cls(role=role, worker_id=worker_id, cluster_secret=cluster_secret, engine=engine,
                   **own)  # type: ignore[arg-type]

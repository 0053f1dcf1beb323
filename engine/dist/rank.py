"""The ranks of one offline engine (`LLM(..., tensor_parallel_size=N)`): this process is rank
0 and leads; N - 1 spawned processes on the same host follow (engine/dist/lockstep.py).

    ranks = LocalRanks.start(args, tp, device)   # store hosted, followers spawned
    group = ranks.join()                          # after rank 0 loaded its weights
    ...  LLMEngine(..., leader=ranks.leader) ...
    ranks.close()                                 # STOP, join with a deadline, kill leftovers

Each follower loads the same checkpoint, keeps its shard (engine/llm.py load_rank), joins the
group and runs Follower until STOP or a GroupError (its process then ends with exit code 1).
A follower is a fresh interpreter (`python -m pdserve.engine.dist.follower`, its EngineArgs
and ParallelConfig as JSON on argv: no pickle, and no `if __name__ == "__main__"` needed in
the user's script, which multiprocessing's spawn would re-import). Every wait is bounded: the
join by the group's timeout_s, the shutdown by close's deadline, after which a follower still
alive is killed.
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from dataclasses import dataclass, field

from pdserve.engine.core.config import ConfigError, SpecConfig
from pdserve.engine.core.engine_args import EngineArgs
from pdserve.engine.dist.config import ParallelConfig
from pdserve.engine.dist.group import GroupError, TPGroup, open_store
from pdserve.engine.dist.lockstep import Leader


def check_tp_args(args: EngineArgs) -> None:
    """Refuse, naming the field, what a tensor-parallel engine (offline or serving) does not
    run yet (docs/tensor_parallel.md): MTP's static drafting (draft graphs) and a reduced
    draft vocabulary are single-rank paths. Decode and MTP verify CUDA graphs (every rank
    captures its own and replays it when rank 0 does; the group's GpuWatchdog bounds their
    collectives), MTP speculation (engine/spec/mtp_plan.py) and overlapped decode
    (launched-ahead decode forwards, their ids shared from rank 0) run."""
    if args.tensor_parallel_size <= 1:
        return
    tp = args.tensor_parallel_size
    spec = args.spec_config()
    if spec is not None and spec.draft_vocab:
        raise ConfigError(f"draft_vocab: a reduced draft vocabulary is not supported with "
                          f"tensor_parallel_size={tp} yet (use 0, the full vocabulary)")
    if spec is not None and spec.draft_graphs == "on":
        raise ConfigError(f"speculative.draft_graphs: 'on' is not supported with "
                          f"tensor_parallel_size={tp} yet (use 'auto' or 'off')")


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: cpu for every rank on CPU; cuda:(i + r) from rank 0's cuda:i."""
    if not device.startswith("cuda"):
        return device
    base = device.partition(":")[2]
    return f"cuda:{int(base or 0) + rank}"


def follower_argv(args: EngineArgs, cfg: ParallelConfig) -> list[str]:
    """The command line of a follower process (JSON: EngineArgs' fields are plain values but
    speculative, which may hold a SpecConfig: sent as {"SpecConfig": its fields})."""
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    if isinstance(args.speculative, SpecConfig):
        fields["speculative"] = {"SpecConfig": dataclasses.asdict(args.speculative)}
    return [sys.executable, "-m", "pdserve.engine.dist.follower", json.dumps(fields),
            json.dumps(dataclasses.asdict(cfg))]


def engine_args_of(fields: dict) -> EngineArgs:
    """The EngineArgs follower_argv sent (JSON lists back to the SpecConfig's tuples)."""
    spec = fields.get("speculative")
    if isinstance(spec, dict):
        spec = dict(spec.get("SpecConfig", {}))
        if "batch_k_caps" in spec:
            spec["batch_k_caps"] = tuple(tuple(c) for c in spec["batch_k_caps"])
        fields = {**fields, "speculative": SpecConfig(**spec)}
    return EngineArgs(**fields)


@dataclass
class LocalRanks:
    """Rank 0's view of the offline engine's ranks: the store it hosts, the spawned
    followers, and after join() the group and the Leader."""

    cfg: ParallelConfig
    store: object
    procs: list = field(default_factory=list)
    group: TPGroup | None = None
    leader: Leader | None = None

    @classmethod
    def start(cls, args: EngineArgs, device: str, timeout_s: float = 60.0) -> LocalRanks:
        """Host the group's store on a free loopback port and spawn ranks 1..tp-1."""
        tp = args.tensor_parallel_size
        cfg = ParallelConfig.for_device(tp, 0, "tcp://127.0.0.1:0", rank_device(device, 0),
                                        timeout_s)
        store = open_store(cfg)
        # captures: their all-reduces through peer memory
        cfg = dataclasses.replace(cfg, init_address=f"tcp://127.0.0.1:{store.port}"
                                  ).with_graphs(args.use_cuda_graphs)
        ranks = cls(cfg, store)
        try:
            for r in range(1, tp):
                rcfg = dataclasses.replace(cfg, rank=r, device=rank_device(device, r))
                ranks.procs.append(subprocess.Popen(follower_argv(args, rcfg)))
        except BaseException:
            ranks.close()
            raise
        return ranks

    def join(self) -> TPGroup:
        """Join the followers (each joins once loaded), within the group's timeout_s."""
        try:
            self.group = TPGroup(self.cfg, self.store)
        except GroupError as e:
            dead = {f"rank {r}": p.poll() for r, p in enumerate(self.procs, 1)
                    if p.poll() is not None}
            self.close()
            raise GroupError(f"tensor_parallel_size: the follower ranks did not join "
                             f"(exited: {dead or 'none'}): {e}") from e
        self.leader = Leader(self.group)
        self.leader.start_keepalive()
        return self.group

    def close(self, timeout_s: float = 10.0) -> None:
        """STOP the followers, wait for them at most timeout_s, kill any left, leave."""
        if self.leader is not None:
            try:
                self.leader.stop()
            except GroupError:
                pass  # a follower already died: the others fail on their own
        for p in self.procs:
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=timeout_s)
        if self.group is not None:
            self.group.close()
        self.leader = self.group = self.store = None
        self.procs = []

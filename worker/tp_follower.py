"""A follower rank of a serving tensor-parallel worker (ranks > 0; rank 0 is
worker/tp_worker.py TPWorkerActor): its shard and KV cache (with speculative, its shard of
the MTP head and the MTP layers' KV), the lockstep Follower loop, and the KV thread over its
own transport (worker/tp_kv.py KVRankServer).

    rank = FollowerRank.start(cfg, parallel_cfg)   # load, join, KV channel, endpoint
    ... rank 0 steps and pulls; this rank follows ...

Any failure ends the process (die): a rank cannot leave a group and come back, so the whole
worker is relaunched (the module docstring of tp_worker.py).
"""
from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

import torch

from pdserve.engine.core.config import EngineConfig, compat_payload
from pdserve.engine.core.tp import TPKVInfo
from pdserve.engine.dist.watchdog import end_process
from pdserve.engine.exec.heap import freeze_startup_heap
from pdserve.kv_transfer.faults import FaultInjector
from pdserve.kv_transfer.transport import KVTransport, make_transport
from pdserve.worker.config import WorkerConfig

if TYPE_CHECKING:
    from pdserve.engine.dist.config import ParallelConfig
    from pdserve.engine.dist.group import TPGroup
    from pdserve.engine.dist.lockstep import Follower
    from pdserve.engine.llm import RankParts

log = logging.getLogger(__name__)

ENDPOINT_KEY = "kvep/{rank}"  # the store key under which rank r publishes its RankEndpoint


def tp_kv_info(compat: dict, tp: int) -> TPKVInfo:
    """The worker's TP map for its transports (heads outermost in a block from KV layout
    version 2 on)."""
    model = compat["model"]
    return TPKVInfo.of(model["num_heads"], model["num_kv_heads"], tp,
                       heads_outer=compat.get("layout_version", 1) >= 2)


def spec_extra(parts: RankParts) -> dict:
    """The speculation part of the KV compat payload, as LLMEngine.compat_extra says it: every
    rank loaded the same MTP head (its id is the checkpoint's, not the shard's), so every
    rank's transport carries the hash a TP-1 worker with the same head carries."""
    return {} if parts.spec is None else {"speculative": parts.spec.compat(parts.head_id)}


def rank_transport(cfg: WorkerConfig, config: EngineConfig, kv_cache: torch.Tensor, rank: int,
                   extra: dict, **kw: Any) -> KVTransport:
    """Rank `rank`'s own KV transport over its cache (the compat payload is the FULL model's,
    its identity and `extra`, spec_extra: the same on every rank and at every TP size)."""
    compat = compat_payload(config.model, config.cache, extra, config.identity)
    return make_transport(cfg.kv_transport, kv_cache, cfg.worker_id, compat, role=cfg.role,
                          tp=tp_kv_info(compat, cfg.engine.tensor_parallel_size), rank=rank,
                          **kw)


def die(who: str, why: object) -> None:
    """End this rank's process: its peers fail at their next collective, Ray marks the actor
    dead and the owner relaunches the whole group."""
    end_process(f"{who} leaves its tensor-parallel group: {why}")


class FollowerRank:
    """What a follower rank runs: built by start(), then two daemon threads (the lockstep
    Follower and the KV thread)."""

    def __init__(self, cfg: WorkerConfig, parts: RankParts, follower: Follower,
                 transport: KVTransport) -> None:
        assert parts.group is not None  # a follower always has its group
        self.cfg, self.parts, self.follower, self.transport = cfg, parts, follower, transport
        self.group: TPGroup = parts.group
        self.rank = self.group.rank
        self.first_head = transport.peer_info().tp_info.head_map[self.rank][0]
        self.who = f"worker {cfg.worker_id} rank {self.rank}"

    @classmethod
    def start(cls, cfg: WorkerConfig, parallel: ParallelConfig) -> FollowerRank:
        """Load the shard and join the group (load_rank), allocate the KV cache, join the KV
        channel, build this rank's transport, publish its endpoint, start both loops."""
        from pdserve.engine.llm import load_rank
        from pdserve.worker.tp_kv import KVChannel, KVRankServer

        if parallel.device == "cpu":  # the ranks share the host's cores
            torch.set_num_threads(max(1, torch.get_num_threads() // parallel.tp_size))
        parts = load_rank(cfg.engine, parallel)
        follower = parts.follower()  # with MTP, its head shard too (graphs captured here)
        parts.group.start_watchdog()  # a deadline on the graphs' collectives
        transport = rank_transport(cfg, parts.config, follower.kv_cache, parallel.rank,
                                   spec_extra(parts), faults=FaultInjector(cfg.faults))
        rank = cls(cfg, parts, follower, transport)
        server = KVRankServer(KVChannel(rank.group), transport, lambda e: die(rank.who, e))
        rank.group.store.set(ENDPOINT_KEY.format(rank=rank.rank),
                             transport.rank_endpoint().to_bytes())
        server.start()
        freeze_startup_heap()  # following: full GC pauses out of the lockstep
        threading.Thread(target=rank._follow, name=f"tp-follow{rank.rank}", daemon=True).start()
        return rank

    def _follow(self) -> None:
        """The lockstep loop until rank 0's STOP (then leave quietly); any error ends us."""
        try:
            self.follower.run()
        except Exception as e:  # noqa: BLE001 - GroupError: rank 0 or a peer is gone
            die(self.who, e)
        log.info("%s stopped by rank 0", self.who)
        self.transport.close()
        self.group.close()

    def kv_head_digests(self, block_ids: list[int], num_tokens: int) -> dict[int, list[str]]:
        """This rank's KV heads' digests (worker/runtime.py head_digests). Read while the
        engine may step: tests call it once the blocks are settled."""
        from pdserve.worker.runtime import head_digests

        c = self.parts.config
        return head_digests(self.follower.kv_cache, c.model.num_kv_layers, self.first_head,
                            block_ids, num_tokens, c.cache.block_size)

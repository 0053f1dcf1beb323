"""A tensor-parallel prefill worker's KV side in its own process (multiprocessing "spawn"):
one NixlKVTransport per rank, each over its own KV tensor, and the group PeerInfo rank 0
publishes. Driven over a Pipe by the tests (the harness's private channel, JSON-able values
only); KV bytes move over NIXL/UCX only.
"""
from __future__ import annotations

from typing import Any

from tests.kv_transfer.kv_peer_proc import SpawnedProc


def serve(conn: Any, worker_id: str, compat: dict, tp: dict, shape: tuple, dtype: str) -> None:
    import torch
    from prometheus_client import CollectorRegistry

    from pdserve.engine.core.tp import TPKVInfo
    from pdserve.kv_transfer import NixlKVTransport, group_peer_info
    from pdserve.kv_transfer.metrics import kv_metrics

    info = TPKVInfo.from_dict(tp)
    kvs, ranks = [], []
    for r in range(info.tp_size):  # `shape` is one rank's: every rank holds as many heads
        kvs.append(torch.zeros(shape, dtype=getattr(torch, dtype)))
        metrics = kv_metrics(CollectorRegistry()).bind("prefill", f"{worker_id}/{r}")
        ranks.append(NixlKVTransport(kvs[r], worker_id, compat, role="prefill",
                                     metrics=metrics, tp=info, rank=r))
    group = group_peer_info(ranks[0].peer_info(), [t.rank_endpoint() for t in ranks])
    conn.send(group.to_bytes())
    while conn.poll(300):  # the parent vanished if nothing comes for this long
        cmd, args = conn.recv()
        if cmd == "fill":  # random bytes into these blocks of every rank; reply with them
            block_ids, seed = args
            gen = torch.Generator().manual_seed(seed)
            out = []
            for kv in kvs:
                raw = kv.view(torch.uint8)  # fp8 scales included: any bytes must travel
                for b in block_ids:
                    raw[b] = torch.randint(0, 256, raw[b].shape, generator=gen,
                                           dtype=torch.uint8)
                out.append([raw[b].numpy().tobytes() for b in block_ids])
            conn.send(out)
        elif cmd == "stop":
            for t in ranks:
                t.close()
            conn.send("stopped")
            return


class GroupProc(SpawnedProc):
    """Handle on a spawned TP prefill group (one transport per rank)."""

    what = "group process"

    def __init__(self, worker_id: str, compat: dict, tp: dict, shape: tuple,
                 dtype: str = "float32", timeout_s: float = 120) -> None:
        super().__init__(serve, (worker_id, compat, tp, shape, dtype), timeout_s)

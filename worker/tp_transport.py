"""GroupTransport: a tensor-parallel worker's KV transport, as rank 0's services see it.

DecodeService and WorkerRuntime call one KVTransport (kv_transfer/transport.py); a TP worker
has one per rank, each over that rank's cache and with its own NIXL agent. This facade gives
rank 0's services the same interface: every call runs on rank 0's own transport and, through
the KV channel (worker/tp_kv.py), on every follower's, and succeeds only if every rank's
does. So a TP-1 worker's path is unchanged, and a TP-N worker's is the same code.

  peer_info()   the group's PeerInfo (kv_transfer/handshake.py group_peer_info): rank 0's
                own, with every rank's endpoint (gathered at start-up) and the TP map
  add_peer      every rank checks the pair (refusals name `tp.<field>`) and loads the
                agents it reads from; if any rank refuses, the peer is removed everywhere
  warm_up       every rank reads once from each source rank, off the request path
  read_blocks   every rank pulls its heads of the same block ids (the ranks share rank 0's
                scheduler, so its block ids are every rank's); the call returns only when
                every rank's read has ended, so no rank's destination blocks are still
                being written when the caller frees or reuses them
  remove_peer   on every rank

A rank that does not report a pull by the deadline plus GRACE_S means the group is broken:
the call raises KVTransferTimeout(local_blocks_safe=False) (the caller quarantines the
blocks) and `broken` is set, which the worker's monitor turns into the whole worker's end
(worker/tp_worker.py): Ray relaunches the group, a new incarnation.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from pdserve.engine.dist import protocol as proto
from pdserve.engine.dist.group import GroupError
from pdserve.kv_transfer.errors import KVTransferTimeout, TransferStats
from pdserve.kv_transfer.handshake import PeerInfo, RankEndpoint, group_peer_info
from pdserve.kv_transfer.metrics import KVMetrics
from pdserve.kv_transfer.transport import KVTransport
from pdserve.worker.tp_kv import KVLeader, parse_result, raise_result

GRACE_S = 5.0  # a follower's read report may trail its own deadline by this much
# add_peer / remove_peer have no caller deadline: this bounds them (their work is local:
# checks and loading NIXL agents), below the router's AddPeer timeout (router/pool.py)
PEER_TIMEOUT_S = 4.0
PEER_GRACE_S = 0.5


class GroupTransport:
    """KVTransport over every rank of a TP worker (rank 0's `local` + the followers')."""

    def __init__(self, local: KVTransport, kv: KVLeader, endpoints: list[RankEndpoint],
                 on_broken: Callable[[str], None] | None = None,
                 metrics: KVMetrics | None = None) -> None:
        """metrics: the worker's KV metrics, counted here once per group read (every rank's
        bytes); `local` then counts into a registry of its own."""
        self.local, self.kv, self.metrics = local, kv, metrics
        self.worker_id, self.incarnation = local.worker_id, local.incarnation
        self._info = group_peer_info(local.peer_info(), endpoints)
        self._on_broken = on_broken
        self.broken: str | None = None  # why the group cannot go on (the worker must end)

    def peer_info(self) -> PeerInfo:
        return self._info

    def rank_endpoint(self) -> RankEndpoint:
        return self.local.rank_endpoint()

    def add_peer(self, info: PeerInfo) -> None:
        deadline = time.monotonic() + PEER_TIMEOUT_S
        fields = {"info": proto.pack_bytes(info.to_bytes()), "budget_ms": _budget(deadline)}
        self._everywhere(proto.Kind.ADD_PEER, fields, lambda: self.local.add_peer(info),
                         deadline, grace_s=PEER_GRACE_S,
                         undo=lambda: self._forget(info.worker_id))

    def warm_up(self, peer_worker_id: str, incarnation: str, deadline: float) -> float:
        start = time.monotonic()
        fields = {"worker_id": proto.pack_bytes(peer_worker_id.encode()),
                  "incarnation": proto.pack_bytes(incarnation.encode()),
                  "budget_ms": _budget(deadline)}
        self._everywhere(proto.Kind.WARM_UP, fields,
                         lambda: self.local.warm_up(peer_worker_id, incarnation, deadline),
                         deadline)
        return time.monotonic() - start

    def read_blocks(self, peer_worker_id: str, incarnation: str,
                    remote_block_ids: Sequence[int], local_block_ids: Sequence[int],
                    deadline: float) -> TransferStats:
        start = time.monotonic()
        remote, local = [int(b) for b in remote_block_ids], [int(b) for b in local_block_ids]
        fields = {"worker_id": proto.pack_bytes(peer_worker_id.encode()),
                  "incarnation": proto.pack_bytes(incarnation.encode()),
                  "remote_ids": remote, "local_ids": local, "budget_ms": _budget(deadline)}
        try:
            stats, results = self._everywhere(
                proto.Kind.KV_PULL, fields,
                lambda: self.local.read_blocks(peer_worker_id, incarnation, remote, local,
                                               deadline), deadline)
        except Exception:
            if self.metrics is not None:
                self.metrics.transfer_failed()
            raise
        nbytes = stats.bytes + sum(d.get("bytes", 0) for d in results.values())
        descriptors = stats.descriptors + sum(d.get("descriptors", 0) for d in results.values())
        out = TransferStats(nbytes, time.monotonic() - start, descriptors, stats.blocks)
        if self.metrics is not None:
            self.metrics.transfer_done(out.bytes, out.seconds, out.descriptors)
        return out

    def remove_peer(self, worker_id: str) -> bool:
        fields = {"worker_id": proto.pack_bytes(worker_id.encode())}
        found, _ = self._everywhere(proto.Kind.REMOVE_PEER, fields,
                                    lambda: self.local.remove_peer(worker_id),
                                    time.monotonic() + PEER_TIMEOUT_S, grace_s=PEER_GRACE_S)
        return bool(found)

    def close(self) -> None:
        self.kv.stop()
        self.local.close()

    # -- every rank ----------------------------------------------------------------------
    def _everywhere(self, kind: proto.Kind, fields: dict[str, list[int]],
                    call: Callable[[], object], deadline: float, grace_s: float = GRACE_S,
                    undo: Callable[[], None] | None = None) -> tuple[object, dict]:
        """Post `kind` to the followers, run `call` here, wait for every follower's result;
        raise the worst failure (an unsafe timeout first, then rank order). `undo` runs when
        some ranks succeeded and others failed (an add_peer that only some ranks took: no
        rank keeps it; a refusal on every rank changed nothing anywhere)."""
        if self.broken:
            raise KVTransferTimeout(f"tensor-parallel group broken: {self.broken}")
        try:
            op = self.kv.post(kind, fields)
        except GroupError as e:  # the channel is gone: nothing was started anywhere
            self._break(f"KV channel: {e}")
            raise KVTransferTimeout(f"tensor-parallel group broken: {e}") from e
        value, failure = None, None
        try:
            value = call()
        except Exception as e:  # noqa: BLE001 - rank 0's failure, ranked with the others
            failure = e
        try:
            got = self.kv.collect(op, deadline + grace_s)
        except GroupError as e:
            got = {r: None for r in self.kv.followers}
            self._break(str(e))
        missing = [r for r, blob in got.items() if blob is None]
        if missing and kind == proto.Kind.KV_PULL:  # their reads may still be writing
            self._break(f"rank(s) {missing} did not report {kind.name} op {op} in time")
            raise KVTransferTimeout(f"{kind.name}: rank(s) {missing} of {self.worker_id!r} did "
                                    f"not report by the deadline", local_blocks_safe=False)
        if missing:  # nothing of ours at stake: this call failed, the group goes on
            if undo is not None:
                undo()
            raise KVTransferTimeout(f"{kind.name}: rank(s) {missing} of {self.worker_id!r} did "
                                    f"not answer by the deadline")
        results = {r: parse_result(r, blob) for r, blob in got.items() if blob is not None}
        failed = {r: d for r, d in results.items() if not d["ok"]}
        if undo is not None and (failure is not None or failed) and (
                failure is None or len(failed) < len(results)):
            undo()
        unsafe = [r for r, d in failed.items() if d.get("kind") == "timeout" and not d.get("safe")]
        if isinstance(failure, KVTransferTimeout) and not failure.local_blocks_safe:
            raise failure
        if unsafe:
            raise_result(unsafe[0], failed[unsafe[0]])
        if failure is not None:
            raise failure
        if failed:
            r = min(failed)
            raise_result(r, failed[r])
        return value, results

    def _forget(self, worker_id: str) -> None:
        try:
            self.remove_peer(worker_id)
        except Exception:  # noqa: BLE001 - best effort after a refusal
            pass

    def _break(self, why: str) -> None:
        if self.broken is None:
            self.broken = why
            if self._on_broken is not None:
                self._on_broken(why)


def _budget(deadline: float) -> list[int]:
    return [max(0, int((deadline - time.monotonic()) * 1000))]

"""The KV channel of a serving tensor-parallel worker: rank 0 tells the other ranks which KV
transport calls to make (add a peer, warm up, pull blocks, remove a peer), each rank makes
them on its own transport over its own cache, and reports its result back to rank 0.

    rank 0:     kv = KVLeader(KVChannel(group))          # worker/tp_transport.py uses it
                op = kv.post(Kind.KV_PULL, fields)       # every follower starts its pull
                ... rank 0 pulls its own heads ...
                results = kv.collect(op, deadline)       # {rank: result bytes | None}
    rank r > 0: KVRankServer(KVChannel(group), transport, on_fatal).start()

Why a second channel: the lockstep steps (engine/dist/lockstep.py) run on TPGroup's step
channel; a pull that waited for, or held up, a forward would couple KV transfer latency to
decode steps. The KV channel is its own gloo group on the worker's TCP store (prefix "kv"):
rank 0 broadcasts the messages (engine/dist/protocol.py KV kinds, no pickle), and sends a
KEEPALIVE when idle so a follower that hears nothing for the group's timeout knows rank 0
is gone. A follower runs each message on a small thread pool, so a slow pull does not hold
up the next message, and reports its result as a small JSON value in the worker's TCP store
under `kvr/<op>/<rank>`; rank 0 waits for those keys with the call's deadline (on a store
connection of its own per waiting thread: TCPStore holds a client's lock for a whole wait).
"""
from __future__ import annotations

import datetime
import itertools
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from pdserve.engine.dist import protocol as proto
from pdserve.engine.dist.group import GroupError, TPGroup
from pdserve.engine.dist.lockstep import Leader, receive_message
from pdserve.kv_transfer.errors import (
    KVTransferError,
    KVTransferTimeout,
    StalePeerError,
    TransferStats,
    UnknownPeerError,
)
from pdserve.kv_transfer.handshake import HandshakeError, IncompatiblePeerError, PeerInfo
from pdserve.kv_transfer.transport import KVTransport

log = logging.getLogger(__name__)

# error kinds a rank reports (JSON), and the exception rank 0 raises for each
ERRORS: dict[str, type[Exception]] = {
    "timeout": KVTransferTimeout, "stale_peer": StalePeerError,
    "unknown_peer": UnknownPeerError, "transfer": KVTransferError,
    "incompatible": IncompatiblePeerError, "handshake": HandshakeError, "value": ValueError,
}


def result_key(op: int, rank: int) -> str:
    return f"kvr/{op}/{rank}"


def ok_result(stats: TransferStats | None = None) -> bytes:
    d: dict = {"ok": True}
    if stats is not None:
        d.update(bytes=stats.bytes, descriptors=stats.descriptors)
    return json.dumps(d).encode()


def error_result(e: BaseException) -> bytes:
    """A rank's failure as JSON: the most specific kind of ERRORS it is an instance of."""
    # ERRORS lists subclasses before their bases (timeout before transfer, ...)
    kind = next((k for k, cls in ERRORS.items() if isinstance(e, cls)), "transfer")
    safe = getattr(e, "local_blocks_safe", True)
    return json.dumps({"ok": False, "kind": kind, "message": f"{type(e).__name__}: {e}",
                       "safe": bool(safe)}).encode()


def parse_result(rank: int, blob: bytes) -> dict:
    """A reported result, checked (a malformed one counts as a failed transfer)."""
    try:
        d = json.loads(blob.decode("utf-8"))
        if not isinstance(d, dict) or not isinstance(d.get("ok"), bool):
            raise ValueError("expected an object with a boolean 'ok'")
    except (UnicodeDecodeError, ValueError) as e:
        return {"ok": False, "kind": "transfer", "message": f"malformed result ({e})",
                "safe": False}
    return d


def raise_result(rank: int, d: dict) -> None:
    """Raise rank `rank`'s reported failure as the exception of its kind."""
    cls = ERRORS.get(d.get("kind", ""), KVTransferError)
    message = f"rank {rank}: {d.get('message', 'failed')}"
    if cls is KVTransferTimeout:
        raise KVTransferTimeout(message, local_blocks_safe=bool(d.get("safe", False)))
    raise cls(message)


class KVChannel:
    """A gloo group of its own on the worker's store (prefix "kv"): the KV messages' channel.
    Every rank constructs it (a rendezvous bounded by the group's timeout)."""

    def __init__(self, group: TPGroup) -> None:
        self.cfg, self.rank, self.size = group.cfg, group.rank, group.size
        self.store = group.store
        self.timeout = group.timeout
        self.pg: dist.ProcessGroup | None = None
        if self.size > 1:
            try:
                self.pg = dist.ProcessGroupGloo(dist.PrefixStore("kv", group.store), self.rank,
                                                self.size, self.timeout)
            except RuntimeError as e:
                raise GroupError(f"rank {self.rank}: joining the KV channel failed within "
                                 f"{self.cfg.timeout_s} s: {e}") from e

    def broadcast_control(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's CPU tensor into t on every rank, in place (at most timeout_s)."""
        if self.pg is not None:
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            try:
                self.pg.broadcast([t], opts).wait(self.timeout)
            except RuntimeError as e:
                raise GroupError(f"rank {self.rank}: KV channel broadcast failed (a rank died "
                                 f"or passed the {self.cfg.timeout_s} s deadline): {e}") from e
        return t

    def close(self) -> None:
        if self.pg is not None and hasattr(self.pg, "shutdown"):
            try:
                self.pg.shutdown()
            except RuntimeError:
                pass
        self.pg = None


class KVLeader:
    """Rank 0's end: post a KV message to every follower, collect their results."""

    def __init__(self, channel: KVChannel) -> None:
        self.channel = channel
        self.leader = Leader(channel)
        self._ops = itertools.count(1)
        self._clients: queue.SimpleQueue = queue.SimpleQueue()
        self.leader.start_keepalive()

    @property
    def followers(self) -> list[int]:
        return list(range(1, self.channel.size))

    def post(self, kind: proto.Kind, fields: dict[str, list[int]]) -> int:
        """Send a KV message to every follower; its op id (GroupError: a rank is gone)."""
        op = next(self._ops)
        self.leader.send(kind, {"op": [op], **fields})
        return op

    def _client(self) -> dist.TCPStore:
        try:
            return self._clients.get_nowait()
        except queue.Empty:
            host, _, port = self.channel.cfg.init_address.removeprefix("tcp://").rpartition(":")
            return dist.TCPStore(host, int(port), is_master=False,
                                 timeout=datetime.timedelta(seconds=self.channel.cfg.timeout_s),
                                 wait_for_workers=False)

    def collect(self, op: int, deadline: float) -> dict[int, bytes | None]:
        """Each follower's result of `op` (None: none came by `deadline`, monotonic)."""
        keys = {r: result_key(op, r) for r in self.followers}
        if not keys:
            return {}
        client = self._client()
        try:
            left = max(0.001, deadline - time.monotonic())
            try:
                client.wait(list(keys.values()), datetime.timedelta(seconds=left))
            except RuntimeError:  # DistStoreError: some rank did not report in time; read
                client = self._client()  # what came on a fresh connection (drop that one)
            out: dict[int, bytes | None] = {}
            for r, key in keys.items():
                out[r] = bytes(client.get(key)) if client.check([key]) else None
                if out[r] is not None:
                    client.delete_key(key)
            self._clients.put(client)
            return out
        except RuntimeError as e:  # the store itself failed: rank 0 hosts it, so it is broken
            raise GroupError(f"rank 0: KV results of op {op}: the store failed: {e}") from e

    def stop(self) -> None:
        """STOP the followers' KV threads (best effort: they end on a dead group anyway)."""
        try:
            self.leader.stop()
        except GroupError:
            pass
        self.channel.close()


class KVRankServer:
    """A follower rank's KV thread: receive KV messages, run each on this rank's transport
    (a small pool, so pulls overlap), report the result under kvr/<op>/<rank>. A broken
    channel (rank 0 gone or silent for the group's timeout) calls on_fatal."""

    def __init__(self, channel: KVChannel, transport: KVTransport,
                 on_fatal: Callable[[BaseException], None], threads: int = 4) -> None:
        self.channel, self.transport, self.on_fatal = channel, transport, on_fatal
        self.rank = channel.rank
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=f"tp-kv{self.rank}")
        self._thread = threading.Thread(target=self._run, name=f"tp-kv-rank{self.rank}",
                                        daemon=True)
        self.handled = 0  # messages run (tests)

    def start(self) -> KVRankServer:
        self._thread.start()
        return self

    def _run(self) -> None:
        seq = 0
        try:
            while True:
                msg = receive_message(self.channel, seq)
                seq += 1
                if msg.kind == proto.Kind.STOP:
                    break
                if msg.kind in proto.KV_KINDS:
                    self._pool.submit(self._handle, msg)
                elif msg.kind != proto.Kind.KEEPALIVE:
                    raise proto.ProtocolError(f"header.kind: {msg.kind.name} on the KV channel")
        except Exception as e:  # noqa: BLE001 - any failure here ends the rank
            self.on_fatal(e)
        finally:
            self._pool.shutdown(wait=False)

    def _handle(self, msg: proto.Message) -> None:
        try:
            op = proto.kv_op(msg)
        except proto.ProtocolError as e:
            self.on_fatal(e)
            return
        arrived = time.monotonic()
        try:
            blob = ok_result(self._run_op(msg, arrived))
        except Exception as e:  # noqa: BLE001 - reported to rank 0, which raises it
            blob = error_result(e)
        try:
            self.channel.store.set(result_key(op, self.rank), blob)
        except RuntimeError as e:  # rank 0 (the store's host) is gone
            self.on_fatal(e)
        self.handled += 1

    def _run_op(self, msg: proto.Message, arrived: float) -> TransferStats | None:
        f, t = msg.fields, self.transport
        if msg.kind == proto.Kind.ADD_PEER:
            t.add_peer(PeerInfo.from_bytes(proto.unpack_bytes(f["info"], "add_peer.info")))
            return None
        wid = proto.unpack_text(f["worker_id"], f"{msg.kind.name.lower()}.worker_id")
        if msg.kind == proto.Kind.REMOVE_PEER:
            t.remove_peer(wid)
            return None
        inc = proto.unpack_text(f["incarnation"], f"{msg.kind.name.lower()}.incarnation")
        deadline = arrived + proto.budget_s(msg)
        if msg.kind == proto.Kind.WARM_UP:
            t.warm_up(wid, inc, deadline)
            return None
        return t.read_blocks(wid, inc, f["remote_ids"], f["local_ids"], deadline)

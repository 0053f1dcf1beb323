"""The peers a NixlKVTransport may read from, and their lifetime in NIXL.

A peer is a worker the router introduced: its PeerInfo, this rank's pull_plan row against it
(which of its ranks to read, kv_transfer/tp_pull.py), the NIXL agents of those ranks and,
"prepped", their block descriptor lists. Reads `acquire` a peer and `release` it when done.
`add` of a newer incarnation, or `remove`, retires the old peer: it leaves the table at
once (new reads on it raise StalePeerError or UnknownPeerError) and is dropped from NIXL
when its last in-flight read finishes. `close` waits (bounded) for reads, then drops all.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.core.tp import TPKVInfo

from .errors import KVTransferError, StalePeerError, UnknownPeerError
from .handshake import HandshakeError, PeerInfo, check_new_peer
from .layout import block_descriptors
from .nixl_agent import try_release
from .tp_pull import SourcePull, rank_sources

log = logging.getLogger(__name__)


@dataclass
class Peer:
    info: PeerInfo
    sources: list[SourcePull]  # this rank's pull_plan row, by source rank
    # source rank -> nixl_prepped_dlist_handle ("prepped" mode, whole-block sources)
    remote_dlists: dict[int, Any] = field(default_factory=dict)
    inflight: int = 0
    retired: bool = False
    leaked: list = field(default_factory=list)  # handles NIXL could not abort yet


class PeerTable:
    def __init__(self, agent: Any, own: PeerInfo, tp: TPKVInfo, rank: int,
                 prepped: bool) -> None:
        self._agent, self._own, self._tp, self._rank = agent, own, tp, rank
        self._prepped = prepped  # prepare the sources' block descriptor lists on add
        self._lock = threading.Condition()
        self._peers: dict[str, Peer] = {}
        self._retiring: list[Peer] = []  # replaced/removed peers with reads in flight
        self._inflight = 0
        self._closed = False

    def add(self, info: PeerInfo) -> None:
        """Trust `info` for reads; refuses incompatible peers (IncompatiblePeerError naming
        the field, `tp.<field>` for TP maps that cannot pair), replaces older incarnations.
        Loads the NIXL agents of the peer's ranks that this rank reads from."""
        check_new_peer(self._own, info)
        sources = rank_sources(info, self._tp, self._rank)
        with self._lock:
            self._check_open()
            old = self._peers.get(info.worker_id)
            if old is not None and old.info.incarnation == info.incarnation:
                if old.info.ranks != info.ranks:
                    raise HandshakeError(f"peer_info.agent_metadata: changed for {info.worker_id!r}"
                                         f" incarnation {info.incarnation}")
                return  # same peer announced again
            peer = Peer(info, sources, remote_dlists=self._load(info, sources))
            self._peers[info.worker_id] = peer
            if old is not None:
                self._retire(old)
        log.info("kv peer %s incarnation %s added%s", info.worker_id, info.incarnation,
                 f" (replaces {old.info.incarnation})" if old is not None else "")

    def remove(self, worker_id: str) -> bool:
        with self._lock:
            peer = self._peers.pop(worker_id, None)
            if peer is not None:
                self._retire(peer)
        return peer is not None

    def incarnations(self) -> dict[str, str]:
        """worker_id -> incarnation of the peers reads may target now."""
        with self._lock:
            return {wid: p.info.incarnation for wid, p in self._peers.items()}

    def acquire(self, worker_id: str, incarnation: str, owner: str) -> Peer:
        """The peer for one read (counted in flight until `release`)."""
        with self._lock:
            self._check_open()
            peer = self._peers.get(worker_id)
            if peer is None:
                raise UnknownPeerError(f"peer {worker_id!r}: not added to {owner!r}")
            if peer.info.incarnation != incarnation:
                raise StalePeerError(f"peer {worker_id!r}: incarnation {incarnation} is stale "
                                     f"(current {peer.info.incarnation}); it restarted")
            peer.inflight += 1
            self._inflight += 1
            return peer

    def release(self, peer: Peer) -> None:
        with self._lock:
            peer.inflight -= 1
            self._inflight -= 1
            if peer.retired and peer.inflight == 0 and peer in self._retiring:
                self._retiring.remove(peer)
                self._drop(peer)
            self._lock.notify_all()

    def keep_leaked(self, peer: Peer, handle: Any) -> None:
        """A transfer handle NIXL could not abort yet: released when the peer is dropped."""
        with self._lock:
            peer.leaked.append(handle)

    def close(self, drain_timeout_s: float) -> bool:
        """Refuse new reads, wait (bounded) for those in flight, drop every peer. False when
        it was already closed."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            self._lock.wait_for(lambda: self._inflight == 0, timeout=drain_timeout_s)
            peers = list(self._peers.values()) + self._retiring
            self._peers.clear()
            self._retiring = []
            for peer in peers:
                self._drop(peer)
        return True

    def _check_open(self) -> None:
        if self._closed:
            raise KVTransferError(f"transport of {self._own.worker_id!r} is closed")

    # ---- NIXL state of a peer (callers hold the lock) ------------------------------------

    def _load(self, info: PeerInfo, sources: list[SourcePull]) -> dict[int, Any]:
        """Load each source rank's agent (and, prepped, its block descriptors); on any
        failure unload what was loaded."""
        loaded: list[str] = []
        dlists: dict[int, Any] = {}
        try:
            for src in sources:
                loaded.append(self._load_agent(info, src))
                if self._prepped and src.whole:
                    dlists[src.src_rank] = self._prep_remote(info, src)
        except BaseException:
            for handle in dlists.values():
                try_release(handle)
            for name in loaded:
                self._unload_agent(name)
            raise
        return dlists

    def _load_agent(self, info: PeerInfo, src: SourcePull) -> str:
        ep = src.endpoint
        try:
            name = self._agent.add_remote_agent(ep.agent_metadata)
        except Exception as e:
            raise KVTransferError(f"peer {info.worker_id!r}: NIXL refused the agent metadata "
                                  f"of its rank {src.src_rank}") from e
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name != ep.agent_name:
            self._unload_agent(name)
            field_name = "agent_name" if src.src_rank == 0 else f"ranks[{src.src_rank}].agent_name"
            raise HandshakeError(f"peer_info.{field_name}: {ep.agent_name!r} but its NIXL "
                                 f"metadata names {name!r}")
        return name

    def _prep_remote(self, info: PeerInfo, src: SourcePull) -> Any:
        ep = src.endpoint
        descs = block_descriptors(ep.kv_base_addr, info.layout, ep.kv_device_id)
        try:
            return self._agent.prep_xfer_dlist(ep.agent_name, descs, ep.kv_mem_type)
        except Exception as e:  # e.g. the advertised KV range is not what the peer registered
            raise KVTransferError(f"peer {info.worker_id!r}: NIXL could not prepare the block "
                                  f"descriptors of its rank {src.src_rank}") from e

    def _unload_agent(self, name: str) -> None:
        try:
            self._agent.remove_remote_agent(name)
        except Exception:
            log.warning("removing NIXL agent %s failed", name, exc_info=True)

    def _retire(self, peer: Peer) -> None:
        """Drop now, or when the peer's last read finishes."""
        peer.retired = True
        if peer.inflight == 0:
            self._drop(peer)
        else:
            self._retiring.append(peer)

    def _drop(self, peer: Peer) -> None:
        for handle in peer.leaked:  # reads that timed out and could not be aborted then
            try_release(handle)
        for handle in peer.remote_dlists.values():
            try_release(handle)
        in_use = {s.agent_name for p in self._peers.values() for s in p.sources}
        for src in peer.sources:
            if src.agent_name not in in_use:
                self._unload_agent(src.agent_name)

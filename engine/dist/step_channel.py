"""The lockstep step channel: rank 0's step messages (protocol.py) to the follower ranks over
plain TCP streams, one per follower, instead of gloo broadcasts.

Why: a gloo broadcast is a collective. On loopback it takes ~0.2 ms a call (a step message is
two: header, payload), and the root's call returns only once every follower has posted its
receive. On two H200s a TP 2 decode step at batch 1 spent 1.36 ms of its 4.6 ms in those
broadcasts on rank 0 (bench/results/tp_h200x2_2026-11-29_b1.json), with its GPU idle. A
TCP send returns as soon as the bytes are in the kernel's buffer: rank 0 launches its own
forward at once, and the forward's first all-reduce is where the ranks meet.

Wire: the raw bytes of the CPU int64 tensor (a header, then its payload), in order on each
stream: no pickle. Join, within timeout_s: rank 0 listens on the group's host (a port the
kernel picks) and puts the address and a random token in the group's store; each follower
connects and sends (token, rank). Hellos are read side by side; a connection that does not
say the token within a few seconds is closed and ignored. The token keeps out whoever cannot
read the store: the channel is exactly as trusted as the group's store (an unauthenticated
TCPStore on the group's host, group.py), no more.

Deadlines: a follower waits for the next message at most timeout_s (an idle leader sends
keep-alives every timeout_s / 4), and a closed stream (rank 0 gone) fails at once; rank 0's
send fails at once on a follower's closed stream, or after timeout_s when a follower stops
reading. Each failure is a GroupError naming the rank.
"""
from __future__ import annotations

import secrets
import selectors
import socket
import time

import torch

from pdserve.engine.dist.errors import GroupError

HELLO_S = 5.0  # a connection must say its token this fast
_TOKEN = 16  # bytes
ADDR_KEY, TOKEN_KEY = "step/addr", "step/token"


class StepChannel:
    """Rank 0's streams to ranks 1..size-1, or a follower's stream from rank 0."""

    def __init__(self, rank: int, size: int, store: object, host: str,
                 timeout_s: float) -> None:
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self._peers: list[socket.socket] = []  # rank 0: ranks 1..size-1, in order
        self._sock: socket.socket | None = None  # a follower: its stream from rank 0
        if size > 1:
            self._listen(store, host) if rank == 0 else self._connect(store)

    # -- join -------------------------------------------------------------------------
    def _listen(self, store: object, host: str) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            server = socket.create_server((host, 0), family=family)
        except OSError as e:
            raise GroupError(f"rank 0: step channel: cannot listen on {host}: {e}") from e
        token = secrets.token_bytes(_TOKEN)
        store.set(ADDR_KEY, f"{host}|{server.getsockname()[1]}")
        store.set(TOKEN_KEY, token)
        try:
            peers = self._accept(server, token)
        finally:
            server.close()
        self._peers = [_tuned(peers[r], self.timeout_s) for r in range(1, self.size)]

    def _accept(self, server: socket.socket, token: bytes) -> dict[int, socket.socket]:
        """Every follower's stream, by rank, within timeout_s. Hellos are read as they come,
        side by side: a connection that says nothing (a port scanner) cannot hold up the
        others; it is closed after HELLO_S, as is one with a wrong token or a rank twice."""
        deadline = time.monotonic() + self.timeout_s
        peers: dict[int, socket.socket] = {}
        pending: dict[socket.socket, tuple[bytearray, float]] = {}  # conn -> (hello, since)
        sel = selectors.DefaultSelector()
        sel.register(server, selectors.EVENT_READ)
        try:
            while len(peers) < self.size - 1:
                now = time.monotonic()
                if now >= deadline:
                    raise GroupError(f"rank 0: step channel: {len(peers)} of "
                                     f"{self.size - 1} followers connected within "
                                     f"{self.timeout_s} s")
                for key, _ in sel.select(min(deadline - now, HELLO_S)):
                    if key.fileobj is server:
                        conn, _ = server.accept()
                        conn.setblocking(False)
                        pending[conn] = (bytearray(), time.monotonic())
                        sel.register(conn, selectors.EVENT_READ)
                        continue
                    conn = key.fileobj
                    done, rank = _read_hello(conn, pending[conn][0], token, self.size)
                    if not done:
                        continue  # more of the hello to come
                    sel.unregister(conn)
                    del pending[conn]
                    if rank is None or rank in peers:
                        conn.close()
                    else:
                        conn.setblocking(True)
                        peers[rank] = conn
                for conn in [c for c, (_, since) in pending.items()
                             if time.monotonic() - since > HELLO_S]:  # said nothing in time
                    sel.unregister(conn)
                    del pending[conn]
                    conn.close()
        except BaseException:
            for c in [*peers.values(), *pending]:
                c.close()
            raise
        finally:
            sel.close()
        return peers

    def _connect(self, store: object) -> None:
        try:  # the store's get waits for rank 0's keys, at most the store's timeout
            host, port = store.get(ADDR_KEY).decode().rsplit("|", 1)
            token = store.get(TOKEN_KEY)
            sock = socket.create_connection((host, int(port)), timeout=self.timeout_s)
            sock.sendall(token + self.rank.to_bytes(8, "little"))
        except (OSError, RuntimeError) as e:  # DistStoreError is a RuntimeError
            raise GroupError(f"rank {self.rank}: step channel: could not reach rank 0 "
                             f"within {self.timeout_s} s: {e}") from e
        self._sock = _tuned(sock, self.timeout_s)

    # -- messages ---------------------------------------------------------------------
    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's CPU tensor t into t on every rank, in place (t contiguous, same shape
        and dtype on every rank)."""
        if self.size == 1:
            return t
        view = memoryview(t.numpy()).cast("B")
        if self.rank == 0:
            for r, peer in enumerate(self._peers, 1):
                try:
                    peer.sendall(view)
                except OSError as e:
                    raise GroupError(f"rank 0: step broadcast failed (rank {r} gone or not "
                                     f"reading for {self.timeout_s} s): {e}") from e
            return t
        try:
            _recv_into(self._sock, view)
        except (OSError, EOFError) as e:
            raise GroupError(f"rank {self.rank}: step broadcast failed (rank 0 gone or silent "
                             f"for {self.timeout_s} s): {e}") from e
        return t

    def close(self) -> None:
        """Close the streams: a peer still waiting fails at once."""
        for s in [*self._peers, *([self._sock] if self._sock else [])]:
            try:
                s.close()
            except OSError:
                pass
        self._peers, self._sock = [], None


def _read_hello(conn: socket.socket, buf: bytearray, token: bytes, size: int
                ) -> tuple[bool, int | None]:
    """Read what a pending connection sent of its hello into buf: (done, rank); done with
    rank None when it closed, lacked the token or named no follower."""
    try:
        chunk = conn.recv(_TOKEN + 8 - len(buf))
    except OSError:
        return True, None
    if not chunk:
        return True, None
    buf += chunk
    return (True, _rank_of(buf, token, size)) if len(buf) == _TOKEN + 8 else (False, None)


def _rank_of(hello: bytearray, token: bytes, size: int) -> int | None:
    """The rank a whole hello says, or None when it lacks the token or names no follower."""
    rank = int.from_bytes(hello[_TOKEN:], "little")
    if not secrets.compare_digest(bytes(hello[:_TOKEN]), token) or not 0 < rank < size:
        return None
    return rank


def _tuned(sock: socket.socket, timeout_s: float) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a step message is small
    sock.settimeout(timeout_s)
    return sock


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill view from sock (each recv waits at most the socket's timeout)."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError("the stream was closed")
        got += n

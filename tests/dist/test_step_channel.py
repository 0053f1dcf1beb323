"""The lockstep step channel on loopback (engine/dist/step_channel.py): rank 0 and a follower
joined through a real TCP store, a stray connection without the group's token ignored and a
silent one not holding up the join, messages in order, and each deadline or closed stream a
GroupError naming what failed."""
from __future__ import annotations

import datetime
import socket
import threading

import pytest
import torch
import torch.distributed as dist

from pdserve.engine.dist.errors import GroupError
from pdserve.engine.dist.step_channel import ADDR_KEY, StepChannel


def _store(is_master: bool, port: int = 0) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, 2, is_master, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10))


def _pair(timeout_s: float, before_follower=None) -> tuple[StepChannel, StepChannel]:
    """Rank 0 (joining on a thread) and rank 1; before_follower(store) runs in between."""
    master = _store(True)
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(
        leader=StepChannel(0, 2, master, "127.0.0.1", timeout_s)))
    t.start()
    client = _store(False, master.port)
    if before_follower is not None:
        before_follower(client)
    follower = StepChannel(1, 2, client, "127.0.0.1", timeout_s)
    t.join(timeout_s + 5)
    return got["leader"], follower


def test_messages_arrive_in_order_and_a_stray_connection_is_ignored() -> None:
    strays: list[socket.socket] = []

    def stray(store: dist.TCPStore) -> None:  # connects first, says no token
        host, port = store.get(ADDR_KEY).decode().rsplit("|", 1)
        s = socket.create_connection((host, int(port)))
        s.sendall(b"x" * 24)
        strays.append(s)

    leader, follower = _pair(10.0, stray)
    try:
        for i in range(3):
            sent = torch.arange(5, dtype=torch.int64) * (i + 1)
            leader.broadcast(sent.clone())
            got = follower.broadcast(torch.zeros(5, dtype=torch.int64))
            assert torch.equal(got, sent)
    finally:
        leader.close(), follower.close()
        for s in strays:
            s.close()


def test_a_silent_connection_does_not_hold_up_the_join() -> None:
    """A connection that says nothing (a port scanner) while the follower joins: rank 0 reads
    hellos side by side, so the join completes well inside a deadline shorter than HELLO_S."""
    silent: list[socket.socket] = []

    def connect_silently(store: dist.TCPStore) -> None:
        host, port = store.get(ADDR_KEY).decode().rsplit("|", 1)
        silent.append(socket.create_connection((host, int(port))))

    leader, follower = _pair(3.0, connect_silently)  # HELLO_S is 5 s
    try:
        leader.broadcast(torch.ones(2, dtype=torch.int64))
        assert follower.broadcast(torch.zeros(2, dtype=torch.int64)).tolist() == [1, 1]
    finally:
        leader.close(), follower.close()
        for s in silent:
            s.close()


def test_a_silent_leader_fails_the_follower_at_its_deadline() -> None:
    leader, follower = _pair(0.5)
    try:
        with pytest.raises(GroupError, match="rank 1: step broadcast failed"):
            follower.broadcast(torch.zeros(4, dtype=torch.int64))
    finally:
        leader.close(), follower.close()


def test_a_closed_stream_fails_at_once_on_both_sides() -> None:
    leader, follower = _pair(30.0)
    leader.close()
    with pytest.raises(GroupError, match="rank 1: step broadcast failed"):
        follower.broadcast(torch.zeros(4, dtype=torch.int64))  # EOF, not the 30 s deadline
    leader2, follower2 = _pair(30.0)
    follower2.close()
    with pytest.raises(GroupError, match="rank 0: step broadcast failed \\(rank 1"):
        for _ in range(64):  # the first sends may still land in the kernel's buffer
            leader2.broadcast(torch.zeros(1 << 14, dtype=torch.int64))
    leader2.close()


def test_a_follower_that_never_comes_fails_the_join() -> None:
    master = _store(True)
    with pytest.raises(GroupError, match="0 of 1 followers connected within 0.5 s"):
        StepChannel(0, 2, master, "127.0.0.1", 0.5)

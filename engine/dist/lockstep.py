"""Lockstep: rank 0 (the leader) runs the scheduler and tells the other ranks (followers)
what each step runs; every rank then runs the same forward over its shard, meeting in the
same collectives in the same order.

The leader sends one message per forward (protocol.py), before running it itself; a
follower receives it, runs the forward over its shard and its part of the LM head for the
message's logits rows, and waits for the next. While idle the leader sends KEEPALIVE at
least every keepalive_s, so a follower that hears nothing for the group's timeout knows the
leader is gone (GroupError) and its process ends: the group is restarted whole.
"""
from __future__ import annotations

import threading
import time
from typing import Protocol

import torch

from pdserve.engine.dist import protocol as proto
from pdserve.engine.dist.config import ParallelConfig
from pdserve.engine.dist.group import TPGroup
from pdserve.engine.model.attention import HostBatch
from pdserve.engine.model.decoder import Model


class Channel(Protocol):
    """What Leader and receive_message need of a group: TPGroup's control channel, or the
    KV channel of a serving worker (worker/tp_kv.py)."""

    size: int
    cfg: ParallelConfig  # its timeout_s sets the keep-alive period

    def broadcast_control(self, t: torch.Tensor) -> torch.Tensor: ...


class Leader:
    """Rank 0's sending end: the runner calls forward() per step; tick() (or the thread of
    start_keepalive) sends a keep-alive when idle. Sends are serialized by a lock, so the
    keep-alive thread and the engine thread never interleave a message's two broadcasts."""

    def __init__(self, group: TPGroup | Channel, keepalive_s: float | None = None) -> None:
        self.group = group
        self.seq = 0
        self.keepalive_s = keepalive_s if keepalive_s is not None else group.cfg.timeout_s / 4
        self._last_send = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.error: BaseException | None = None  # what ended the keep-alive thread

    def send(self, kind: proto.Kind, fields: dict[str, list[int]], flags: int = 0) -> None:
        if self.group.size == 1:
            return
        with self._lock:  # seq is read and advanced under the lock: senders on many threads
            header, payload = proto.encode(kind, self.seq, fields, flags)
            self.group.broadcast_control(header)
            if payload.numel():
                self.group.broadcast_control(payload)
            self.seq += 1
            self._last_send = time.monotonic()

    def start_keepalive(self) -> threading.Thread:
        """A daemon thread calling tick() until stop(); a failed keep-alive (a follower died)
        ends it and is kept in .error (the engine's next step fails on the group anyway)."""
        def loop() -> None:
            while not self._stop.wait(self.keepalive_s / 2):
                try:
                    self.tick()
                except Exception as e:  # noqa: BLE001 - GroupError: a follower is gone
                    self.error = e
                    return
        t = threading.Thread(target=loop, name="tp-keepalive", daemon=True)
        t.start()
        return t

    def forward(self, batch: HostBatch, logits_rows: list[int], return_prenorm: bool) -> None:
        """Announce a forward of `batch` whose logits the leader computes for logits_rows."""
        flags = proto.RETURN_PRENORM if return_prenorm else 0
        self.send(proto.Kind.FORWARD, proto.forward_fields(batch, logits_rows), flags)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.send(proto.Kind.COPY_BLOCKS, {"src": [s for s, _ in pairs],
                                           "dst": [d for _, d in pairs]})

    def tick(self) -> None:
        """Idle housekeeping: a keep-alive when nothing was sent for keepalive_s."""
        if time.monotonic() - self._last_send >= self.keepalive_s:
            self.send(proto.Kind.KEEPALIVE, {})

    def stop(self) -> None:
        self._stop.set()
        self.send(proto.Kind.STOP, {})


def receive_message(group: Channel, seq: int) -> proto.Message:
    """The next message rank 0 broadcast on `group` (header, then payload), checked to be
    number `seq` (GroupError when nothing comes within the group's timeout)."""
    header = torch.empty(proto.HEADER_LEN, dtype=torch.int64)
    group.broadcast_control(header)
    kind, flags, lens = proto.read_header(header, seq)
    payload = torch.empty(sum(lens), dtype=torch.int64)
    if payload.numel():
        group.broadcast_control(payload)
    return proto.decode(kind, seq, flags, lens, payload)


class Follower:
    """A rank > 0: receive, run, repeat until STOP (or a GroupError ends the process)."""

    def __init__(self, group: TPGroup, model: Model, kv_cache: torch.Tensor) -> None:
        self.group, self.model, self.kv_cache = group, model, kv_cache
        self.device = kv_cache.device
        self.seq = 0
        self.steps = 0  # forwards run (tests and metrics)

    def receive(self) -> proto.Message:
        msg = receive_message(self.group, self.seq)
        self.seq += 1
        return msg

    def run(self) -> int:
        """Follow until STOP; returns the number of forwards run."""
        while True:
            msg = self.receive()
            if msg.kind == proto.Kind.STOP:
                return self.steps
            if msg.kind == proto.Kind.FORWARD:
                self.forward(msg)
            elif msg.kind == proto.Kind.COPY_BLOCKS:
                for s, d in zip(msg.fields["src"], msg.fields["dst"]):
                    self.kv_cache[d].copy_(self.kv_cache[s])
            elif msg.kind != proto.Kind.KEEPALIVE:  # KV kinds go on the KV channel only
                raise proto.ProtocolError(f"header.kind: {msg.kind.name} on the step channel")

    @torch.inference_mode()
    def forward(self, msg: proto.Message) -> None:
        batch = proto.batch_of(msg)
        ids, positions, meta = batch.to_device(self.device)
        hidden = self.model(ids, positions, meta, self.kv_cache)
        rows = msg.fields["logits_rows"]
        if rows:  # the leader's LM head all-gather needs this rank's part for these rows
            self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)],
                                      as_float=False)
        self.steps += 1


class LeaderModel:
    """Rank 0's forward in lockstep: announce, then run its own shard (what ModelRunner's
    _forward and _sample call in phase 2)."""

    def __init__(self, leader: Leader, model: Model, kv_cache: torch.Tensor) -> None:
        self.leader, self.model, self.kv_cache = leader, model, kv_cache

    @torch.inference_mode()
    def step(self, batch: HostBatch, logits_rows: list[int]) -> torch.Tensor:
        """One forward of `batch` -> logits [len(logits_rows), V] float32."""
        self.leader.forward(batch, logits_rows, return_prenorm=False)
        ids, positions, meta = batch.to_device(self.kv_cache.device)
        hidden = self.model(ids, positions, meta, self.kv_cache)
        rows = torch.tensor(logits_rows, device=hidden.device)
        return self.model.compute_logits(hidden[rows])

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every rank's cache (each holds its heads)."""
        self.leader.copy_blocks(pairs)
        for src, dst in pairs:
            self.kv_cache[dst].copy_(self.kv_cache[src])

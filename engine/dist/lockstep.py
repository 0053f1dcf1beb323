"""Lockstep: rank 0 (the leader) runs the scheduler and tells the other ranks (followers)
what each step runs; every rank then runs the same forward over its shard, meeting in the
same collectives in the same order.

The leader sends one message per forward (protocol.py), before running it itself; a
follower receives it, runs the forward over its shard and its part of the LM head for the
message's logits rows, and waits for the next. With MTP speculation each drafting pass is
one MTP message too (engine/spec/mtp_plan.py), run over the follower's shard of the MTP head
from the last forward's hidden rows; with overlapped decode a forward launched ahead is
announced (its ids then come from rank 0 by an all-reduce) and the step it serves says so.
While idle the leader sends KEEPALIVE at least every keepalive_s, so a follower that hears
nothing for the group's timeout knows the leader is gone (GroupError) and its process ends:
the group is restarted whole.
"""
from __future__ import annotations

import threading
import time
from typing import Protocol

import torch

from pdserve.engine.dist import parallel
from pdserve.engine.dist import protocol as proto
from pdserve.engine.dist.config import ParallelConfig
from pdserve.engine.dist.group import TPGroup
from pdserve.engine.dist.watchdog import GpuWatchdog
from pdserve.engine.exec.cuda_graphs import DecodeGraphs
from pdserve.engine.exec.device_io import bind_thread, rows_of
from pdserve.engine.model.attention import HostBatch
from pdserve.engine.model.decoder import Model
from pdserve.engine.spec.mtp_head import tp_mtp_head
from pdserve.engine.spec.mtp_plan import MTPPlan, follow_plan

STEP_MESSAGE = "tp:step_message"  # the profiler's name of one message sent (bench/lab/tp_probes)


class Channel(Protocol):
    """What Leader and receive_message need of a group: TPGroup's control channel, or the
    KV channel of a serving worker (worker/tp_kv.py)."""

    size: int
    cfg: ParallelConfig  # its timeout_s sets the keep-alive period

    def broadcast_control(self, t: torch.Tensor) -> torch.Tensor: ...


class Leader:
    """Rank 0's sending end: the runner calls forward() per step; tick() (or the thread of
    start_keepalive) sends a keep-alive when idle. Sends are serialized by a lock, so the
    keep-alive thread and the engine thread never interleave a message's two broadcasts.
    A TPGroup's GpuWatchdog (watchdog.py) is marked before each message: a keep-alive's
    mark bounds the last step's GPU work when no step follows."""

    def __init__(self, group: TPGroup | Channel, keepalive_s: float | None = None) -> None:
        self.group = group
        self.watchdog: GpuWatchdog | None = group.watchdog if isinstance(group, TPGroup) \
            else None
        self.seq = 0
        self.keepalive_s = keepalive_s if keepalive_s is not None else group.cfg.timeout_s / 4
        self._last_send = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.error: BaseException | None = None  # what ended the keep-alive thread

    def send(self, kind: proto.Kind, fields: dict[str, list[int]], flags: int = 0) -> None:
        if self.group.size == 1:
            return
        with self._lock, torch.profiler.record_function(STEP_MESSAGE):
            # seq is read and advanced under the lock: senders on many threads
            if self.watchdog is not None:
                self.watchdog.mark(f"step message {self.seq} ({kind.name})")
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

    def forward(self, batch: HostBatch, logits_rows: list[int], return_prenorm: bool,
                verify_rows: list[int] | tuple[int, ...] = (), launched: bool = False,
                prompt_slices: list[list[int]] | tuple = (), graphed: bool = False) -> None:
        """Announce a forward of `batch` whose logits the leader computes for each of
        prompt_slices (prompt logprobs), then for logits_rows, then (MTP verification) for
        verify_rows. launched: the forward launched ahead (launch_ahead) is this one: the
        followers take its hidden states. graphed: rank 0 replays its decode graph."""
        flags = (proto.RETURN_PRENORM if return_prenorm else 0) | (
            proto.USE_LAUNCHED if launched else 0) | (proto.GRAPHED if graphed else 0)
        fields = proto.launched_fields(logits_rows, verify_rows, prompt_slices) if launched \
            else proto.forward_fields(batch, logits_rows, verify_rows, prompt_slices)
        self.send(proto.Kind.FORWARD, fields, flags)

    def launch_ahead(self, batch: HostBatch, graphed: bool = False) -> None:
        """Announce a decode forward launched ahead (engine/exec/overlap.py): its input ids
        follow from rank 0's device (parallel.from_rank0, one per sequence); no logits."""
        self.send(proto.Kind.FORWARD, proto.forward_fields(batch, []),
                  proto.LAUNCH_AHEAD | (proto.GRAPHED if graphed else 0))

    def mtp(self, plan: MTPPlan, shared_hidden: bool = False) -> None:
        """Announce an MTP drafting pass (engine/spec/mtp_plan.py) over the last forward's
        hidden rows, or over rank 0's own rows it then shares (shared_hidden)."""
        self.send(proto.Kind.MTP, proto.mtp_fields(plan),
                  proto.SHARED_HIDDEN if shared_hidden else 0)

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
    """A rank > 0: receive, run, repeat until STOP (or a GroupError ends the process).
    head: the MTP head (speculative decoding; a full head is sharded here, tp_mtp_head),
    whose drafting passes (Kind.MTP) read the last forward's hidden rows."""

    def __init__(self, group: TPGroup, model: Model, kv_cache: torch.Tensor,
                 head: torch.nn.Module | None = None, graphs: DecodeGraphs | None = None,
                 verify_graphs: dict[int, DecodeGraphs] | None = None) -> None:
        self.group, self.model, self.kv_cache = group, model, kv_cache
        # captured in step with rank 0's (RankParts.follower): decode steps, and MTP verify
        # steps of k drafts ({k: graphs})
        self.graphs = graphs
        self.verify_graphs = verify_graphs or {}
        self.head = tp_mtp_head(head, model) if head is not None else None
        self.device = kv_cache.device
        self.seq = 0
        self.steps = 0  # forwards run (tests and metrics)
        self.mtp_passes = 0  # MTP drafting passes run
        self.hidden: torch.Tensor | None = None  # [T, H] the last forward's (with a head)
        # (batch, hidden [B, H]) of the decode forward launched ahead, until the next FORWARD
        self.launched: tuple[HostBatch, torch.Tensor] | None = None

    def receive(self) -> proto.Message:
        msg = receive_message(self.group, self.seq)
        if self.group.watchdog is not None:  # the GPU work queued before this message
            self.group.watchdog.mark(f"step message {self.seq} ({msg.kind.name})")
        self.seq += 1
        return msg

    def run(self) -> int:
        """Follow until STOP; returns the number of forwards run."""
        bind_thread(self.device)  # a serving rank runs this on a thread of its own
        while True:
            msg = self.receive()
            if msg.kind == proto.Kind.STOP:
                return self.steps
            if msg.kind == proto.Kind.FORWARD:
                self.forward(msg)
            elif msg.kind == proto.Kind.MTP:
                self.mtp(msg)
            elif msg.kind == proto.Kind.COPY_BLOCKS:
                for s, d in zip(msg.fields["src"], msg.fields["dst"]):
                    self.kv_cache[d].copy_(self.kv_cache[s])
            elif msg.kind != proto.Kind.KEEPALIVE:  # KV kinds go on the KV channel only
                raise proto.ProtocolError(f"header.kind: {msg.kind.name} on the step channel")

    @torch.inference_mode()
    def forward(self, msg: proto.Message) -> None:
        launched, self.launched = self.launched, None
        if msg.flags & proto.USE_LAUNCHED:  # the forward launched ahead serves this step
            if launched is None:  # (rank 0 checked that its batch is this step's)
                raise proto.ProtocolError("forward.flags: no forward launched ahead for "
                                          "this step")
            proto.launched_of(msg, len(launched[0].input_ids))
            hidden = launched[1]
        else:
            batch = proto.batch_of(msg)
            hidden = self._run(batch, msg.flags)
            if msg.flags & proto.LAUNCH_AHEAD:
                self.launched = (batch, hidden)
                self.steps += 1
                return
        # the leader's LM head all-gathers need this rank's part for these rows, in its
        # order: each prompt-logprob slice, the sampled rows, then MTP verify rows
        f = msg.fields
        for rows in (*proto.cut(f["prompt_rows"], f["prompt_slices"]), f["logits_rows"],
                     f["verify_rows"]):
            if rows:
                # rows_of: no pageable copy, whose stream sync would hold this rank's host
                # until its forward ended, late for the next step message
                self.model.compute_logits(rows_of(hidden, rows), as_float=False)
        self.hidden = hidden if self.head is not None else None
        self.steps += 1

    def _run(self, batch: HostBatch, flags: int) -> torch.Tensor:
        """This rank's forward of `batch` -> hidden [T, H]: its decode graph's replay when rank
        0 replays its own (GRAPHED), else eager; a forward launched ahead takes rank 0's
        sampled ids (from_rank0)."""
        ids = None
        if flags & proto.LAUNCH_AHEAD:
            ids = parallel.ids_from_rank0(torch.zeros(len(batch.input_ids), dtype=torch.int64,
                                                      device=self.device), self.model.tp)
        if flags & proto.GRAPHED:  # a decode step, or a verify step of k drafts
            k = max(batch.query_lens) - 1
            graphs = self.graphs if k == 0 else self.verify_graphs.get(k)
            out = graphs.run_host(batch, input_ids=ids) if graphs is not None else None
            if out is None:
                raise proto.ProtocolError("forward.flags: rank 0 replays a graph this rank "
                                          f"has none for ({k} drafts a sequence; "
                                          "use_cuda_graphs, max_num_seqs or speculative "
                                          "differ between the ranks)")
            return out[0]
        host_ids, positions, meta = batch.to_device(self.device)
        return self.model(host_ids if ids is None else ids, positions, meta, self.kv_cache)

    @torch.inference_mode()
    def mtp(self, msg: proto.Message) -> None:
        """Rank 0's drafting pass over this rank's shard of the MTP head."""
        plan = proto.plan_of(msg)
        if self.head is None:
            raise proto.ProtocolError("mtp: this rank has no MTP head (it was started "
                                      "without speculative)")
        if msg.flags & proto.SHARED_HIDDEN:  # rank 0's own rows, shared by an all-reduce
            dtype = self.model.embed_tokens.weight.dtype
            zeros = torch.zeros(len(plan.rows), self.model.config.hidden_size, dtype=dtype,
                                device=self.device)
            hidden = parallel.from_rank0(zeros, self.group)
        else:
            if self.hidden is None or max(plan.rows) >= self.hidden.shape[0]:
                raise proto.ProtocolError("mtp.rows: rows outside the last forward's hidden "
                                          "states")
            hidden = rows_of(self.hidden, plan.rows)
        follow_plan(plan, self.head, self.model, self.kv_cache, hidden)
        self.mtp_passes += 1


class LeaderModel:
    """Rank 0's forward in lockstep without an engine: announce, then run its own shard
    (engine/dist/steps.py and the group tests; the engine's ModelRunner announces itself)."""

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

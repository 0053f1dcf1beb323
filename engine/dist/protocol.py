"""Lockstep step messages: rank 0 tells the other ranks what to run, as int64 tensors.

No pickle (broadcast_object_list pickles): a message is a fixed header of HEADER_LEN int64
followed by a payload of int64 fields whose lengths the header carries. The leader
broadcasts the header, then the payload (when not empty), on the control group.

Header: [MAGIC, VERSION, kind, seq, flags, nfields, len_0 .. len_{MAX_FIELDS-1}]
  * seq counts messages from 0; a follower refuses a gap (a lost or repeated step would
    desynchronise the ranks' collectives).
  * kind picks the schema: the field names in FIELDS, in order. A FORWARD's fields are
    HostBatch's (engine/model/attention.py) plus the rows whose logits the leader computes:
    prompt_rows (prompt logprobs, one LM head call per prompt_slices length), then
    logits_rows (sampled), then verify_rows (MTP verification), LM head calls in that order
    (the followers join each collective for exactly those rows). A FORWARD flagged
    USE_LAUNCHED carries no batch (launched_fields): its batch is the one the follower
    launched ahead, which rank 0 checked to be this step's (engine/exec/overlap.py take);
    sending it again cost a whole second encode a step (256 sequences x 1K context: ~17K
    block ids).

Kinds: FORWARD (one model forward + its logits), COPY_BLOCKS (copy-on-write of whole blocks
in every rank's cache), KEEPALIVE (the leader is idle but alive), STOP (leave the loop),
MTP (one MTP drafting pass, engine/spec/tp_draft.py MTPPlan: catch-up rows over the last
FORWARD's hidden rows, or over hidden rows rank 0 shares (flag SHARED_HIDDEN), then the
chain of k drafts per job).

KV kinds (a serving TP worker, worker/tp_kv.py): they travel on a SEPARATE gloo group from
the steps, so a KV pull never waits behind, or blocks, a forward. Each carries an `op` id
(the follower reports its result under it) and, where it waits, `budget_ms`: the time left
to the deadline when rank 0 sent it (monotonic clocks differ between processes). Strings and
bytes travel packed 8 to an int64 word after their length (pack_bytes / unpack_bytes).
  ADD_PEER (op, info = PeerInfo bytes, budget_ms), WARM_UP (op, worker_id, incarnation,
  budget_ms), KV_PULL (op, worker_id, incarnation, remote_ids, local_ids, budget_ms),
  REMOVE_PEER (op, worker_id).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch

from pdserve.engine.model.attention import HostBatch
from pdserve.engine.spec.mtp_plan import MTPPlan

MAGIC = 0x7064_7470  # "pdtp"
VERSION = 5  # 2: the KV kinds; 3: MTP, FORWARD.verify_rows; 4: FORWARD.prompt_rows;
# 5: a USE_LAUNCHED FORWARD carries no batch
MAX_FIELDS = 14
HEADER_LEN = 6 + MAX_FIELDS
MAX_PAYLOAD = 1 << 26  # int64 values: far beyond any step (tokens + block tables)


class ProtocolError(ValueError):
    """A malformed or out-of-order step message; the message names the header field."""


class Kind(IntEnum):
    FORWARD = 1
    COPY_BLOCKS = 2
    KEEPALIVE = 3
    STOP = 4
    ADD_PEER = 5
    KV_PULL = 6
    REMOVE_PEER = 7
    WARM_UP = 8
    MTP = 9


KV_KINDS = (Kind.ADD_PEER, Kind.KV_PULL, Kind.REMOVE_PEER, Kind.WARM_UP)


# flags of a FORWARD
RETURN_PRENORM = 1
# overlapped decode (engine/exec/overlap.py): a forward launched ahead, whose input ids come
# after the message from rank 0's device (parallel.from_rank0); and a step served by it
LAUNCH_AHEAD = 2
USE_LAUNCHED = 4
# rank 0 replays its captured decode graph for this forward (engine/exec/cuda_graphs.py): the
# follower replays its own, whose collectives are padded to the same bucket (an eager forward
# on one rank and a padded replay on another would all-reduce different sizes)
GRAPHED = 8
# flags of an MTP: the catch-up's hidden rows come from rank 0 (an all-reduce), not from
# the last FORWARD (a decode worker drafting from a prefill worker's hidden state)
SHARED_HIDDEN = 1

FIELDS: dict[Kind, tuple[str, ...]] = {
    Kind.FORWARD: ("input_ids", "positions", "slots", "query_lens", "seq_lens",
                   "block_tables", "table_lens", "scalars", "logits_rows", "verify_rows",
                   "prompt_rows", "prompt_slices"),
    Kind.COPY_BLOCKS: ("src", "dst"),
    Kind.KEEPALIVE: (),
    Kind.STOP: (),
    Kind.ADD_PEER: ("op", "info", "budget_ms"),
    Kind.KV_PULL: ("op", "worker_id", "incarnation", "remote_ids", "local_ids", "budget_ms"),
    Kind.REMOVE_PEER: ("op", "worker_id"),
    Kind.WARM_UP: ("op", "worker_id", "incarnation", "budget_ms"),
    Kind.MTP: ("input_ids", "rows", "starts", "lens", "block_tables", "table_lens", "ks",
               "greedy", "scalars"),
}

BATCH_FIELDS = FIELDS[Kind.FORWARD][:8]  # a FORWARD's HostBatch (forward_fields)


@dataclass(frozen=True)
class Message:
    kind: Kind
    seq: int
    flags: int
    fields: dict[str, list[int]]


def encode(kind: Kind, seq: int, fields: dict[str, list[int]], flags: int = 0
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(header [HEADER_LEN], payload [sum of lengths]) int64 CPU tensors."""
    names = FIELDS[kind]
    if set(fields) != set(names):
        raise ProtocolError(f"fields: {kind.name} takes {names}, got {sorted(fields)}")
    values = [fields[n] for n in names]
    header = [MAGIC, VERSION, int(kind), seq, flags, len(names)] + [len(v) for v in values]
    header += [0] * (HEADER_LEN - len(header))
    # one C-level pass over every value (a Python int() per value took ~2 ms for a 256-
    # sequence step's ~18K values, on the leader's critical path between two steps)
    flat = np.fromiter(itertools.chain.from_iterable(values), dtype=np.int64,
                       count=sum(header[6:]))
    return torch.tensor(header, dtype=torch.int64), torch.from_numpy(flat)


def read_header(header: torch.Tensor, expect_seq: int) -> tuple[Kind, int, list[int]]:
    """(kind, flags, field lengths) of a received header, checked field by field."""
    if header.dtype != torch.int64 or tuple(header.shape) != (HEADER_LEN,):
        raise ProtocolError(f"header: expected int64 [{HEADER_LEN}], got {header.dtype} "
                            f"{tuple(header.shape)}")
    h = header.tolist()
    if h[0] != MAGIC:
        raise ProtocolError(f"header.magic: {h[0]:#x} != {MAGIC:#x}")
    if h[1] != VERSION:
        raise ProtocolError(f"header.version: {h[1]} != {VERSION} (ranks of one worker run "
                            f"different pdserve versions)")
    try:
        kind = Kind(h[2])
    except ValueError:
        raise ProtocolError(f"header.kind: unknown {h[2]}") from None
    if h[3] != expect_seq:
        raise ProtocolError(f"header.seq: got {h[3]}, expected {expect_seq} (a step was lost "
                            f"or repeated)")
    n = len(FIELDS[kind])
    if h[5] != n:
        raise ProtocolError(f"header.nfields: {kind.name} has {n} fields, got {h[5]}")
    lens = h[6:6 + n]
    if any(x < 0 for x in lens) or any(h[6 + n:]) or sum(lens) > MAX_PAYLOAD:
        raise ProtocolError(f"header.lengths: bad field lengths {h[6:]}")
    return kind, h[4], lens


def decode(kind: Kind, seq: int, flags: int, lens: list[int], payload: torch.Tensor) -> Message:
    if payload.numel() != sum(lens):
        raise ProtocolError(f"payload: {payload.numel()} values, the header says {sum(lens)}")
    flat, fields, at = payload.tolist(), {}, 0
    for name, n in zip(FIELDS[kind], lens):
        fields[name] = flat[at:at + n]
        at += n
    return Message(kind, seq, flags, fields)


def cut(flat: list[int], lens: list[int]) -> list[list[int]]:
    """A flattened field back into its pieces of lengths `lens` (block tables, prompt rows)."""
    out, at = [], 0
    for n in lens:
        out.append(flat[at:at + n])
        at += n
    return out


def forward_fields(batch: HostBatch, logits_rows: list[int],
                   verify_rows: list[int] | tuple[int, ...] = (),
                   prompt_slices: list[list[int]] | tuple = ()) -> dict[str, list[int]]:
    """A FORWARD's fields from the leader's HostBatch (block tables flattened, their lengths
    alongside; scalars = [block_size]); prompt_slices: the rows of each prompt-logprob LM
    head call, flattened into prompt_rows with their lengths in prompt_slices."""
    return {"input_ids": batch.input_ids, "positions": batch.positions, "slots": batch.slots,
            "query_lens": batch.query_lens, "seq_lens": batch.seq_lens,
            "block_tables": [b for t in batch.block_tables for b in t],
            "table_lens": [len(t) for t in batch.block_tables], "scalars": [batch.block_size],
            "logits_rows": logits_rows, "verify_rows": list(verify_rows),
            "prompt_rows": [r for sl in prompt_slices for r in sl],
            "prompt_slices": [len(sl) for sl in prompt_slices]}


def launched_fields(logits_rows: list[int], verify_rows: list[int] | tuple[int, ...] = (),
                    prompt_slices: list[list[int]] | tuple = ()) -> dict[str, list[int]]:
    """A USE_LAUNCHED FORWARD's fields: only the rows; the batch is the launched one."""
    fields = forward_fields(HostBatch([], [], [], [], [], [], 0), logits_rows, verify_rows,
                            prompt_slices)
    fields["scalars"] = []
    return fields


def check_rows(msg: Message, num_tokens: int) -> None:
    """A FORWARD's logit rows lie in its batch of num_tokens rows (names the field)."""
    f = msg.fields
    for name in ("logits_rows", "verify_rows", "prompt_rows"):
        if any(r < 0 or r >= num_tokens for r in f[name]):
            raise ProtocolError(f"forward.{name}: rows outside [0, {num_tokens})")
    if any(n <= 0 for n in f["prompt_slices"]) or sum(f["prompt_slices"]) != len(f["prompt_rows"]):
        raise ProtocolError(f"forward.prompt_slices: {f['prompt_slices']} do not cut "
                            f"{len(f['prompt_rows'])} prompt_rows")


def launched_of(msg: Message, num_tokens: int) -> None:
    """Check a USE_LAUNCHED FORWARD: no batch of its own, rows within the launched batch's
    num_tokens (names the field)."""
    for name in BATCH_FIELDS:
        if msg.fields[name]:
            raise ProtocolError(f"forward.{name}: a USE_LAUNCHED forward carries no batch")
    check_rows(msg, num_tokens)


def batch_of(msg: Message) -> HostBatch:
    """The HostBatch a FORWARD carries, checked for consistency (names the field)."""
    f = msg.fields
    T, B = len(f["input_ids"]), len(f["query_lens"])
    for name, n, want in (("positions", len(f["positions"]), T), ("slots", len(f["slots"]), T),
                          ("seq_lens", len(f["seq_lens"]), B),
                          ("table_lens", len(f["table_lens"]), B),
                          ("block_tables", len(f["block_tables"]), sum(f["table_lens"])),
                          ("scalars", len(f["scalars"]), 1)):
        if n != want:
            raise ProtocolError(f"forward.{name}: {n} values, expected {want}")
    if sum(f["query_lens"]) != T or B == 0:
        raise ProtocolError(f"forward.query_lens: sum {sum(f['query_lens'])} != {T} tokens")
    check_rows(msg, T)
    tables = cut(f["block_tables"], f["table_lens"])
    return HostBatch(f["input_ids"], f["positions"], f["slots"], f["query_lens"],
                     f["seq_lens"], tables, f["scalars"][0])


def mtp_fields(plan: MTPPlan) -> dict[str, list[int]]:
    """An MTP message's fields (block tables flattened; greedy as 0/1; scalars =
    [block_size])."""
    return {"input_ids": plan.ids, "rows": plan.rows, "starts": plan.starts, "lens": plan.lens,
            "block_tables": [b for t in plan.tables for b in t],
            "table_lens": [len(t) for t in plan.tables], "ks": plan.ks,
            "greedy": [int(g) for g in plan.greedy], "scalars": [plan.block_size]}


def plan_of(msg: Message) -> MTPPlan:
    """The MTPPlan an MTP message carries, checked for consistency (names the field)."""
    f = msg.fields
    J, T = len(f["starts"]), len(f["input_ids"])
    for name, want in (("lens", J), ("table_lens", J), ("ks", J), ("greedy", J), ("rows", T),
                       ("block_tables", sum(f["table_lens"])), ("scalars", 1)):
        if len(f[name]) != want:
            raise ProtocolError(f"mtp.{name}: {len(f[name])} values, expected {want}")
    if J == 0 or sum(f["lens"]) != T or min(f["lens"]) < 1:
        raise ProtocolError(f"mtp.lens: {f['lens']} do not split {T} catch-up rows")
    if min(f["rows"]) < 0 or min(f["ks"]) < 0 or min(f["starts"]) < 0:
        raise ProtocolError("mtp.rows: negative rows, ks or starts")
    tables = cut(f["block_tables"], f["table_lens"])
    return MTPPlan(f["input_ids"], f["rows"], f["starts"], f["lens"], tables, f["ks"],
                   [bool(g) for g in f["greedy"]], f["scalars"][0])


def pack_bytes(data: bytes) -> list[int]:
    """[len, then the bytes 8 to a little-endian int64 word, zero-padded]."""
    padded = data + b"\0" * (-len(data) % 8)
    words = torch.frombuffer(bytearray(padded), dtype=torch.int64).tolist() if padded else []
    return [len(data)] + words


def unpack_bytes(values: list[int], name: str) -> bytes:
    """The bytes pack_bytes packed; ProtocolError naming the field when they do not fit."""
    if not values or not 0 <= values[0] <= 8 * (len(values) - 1) < values[0] + 8:
        raise ProtocolError(f"{name}: packed length {values[:1]} does not match "
                            f"{len(values) - 1} words")
    raw = torch.tensor(values[1:], dtype=torch.int64).numpy().tobytes()
    return raw[: values[0]]


def unpack_text(values: list[int], name: str) -> str:
    try:
        return unpack_bytes(values, name).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProtocolError(f"{name}: not UTF-8 ({e})") from None


def kv_op(msg: Message) -> int:
    """The op id of a KV message (its result is reported under it)."""
    op = msg.fields["op"]
    if len(op) != 1 or op[0] < 0:
        raise ProtocolError(f"{msg.kind.name.lower()}.op: expected one id >= 0, got {op}")
    return op[0]


def budget_s(msg: Message) -> float:
    """A KV message's time budget in seconds (its deadline, relative to its arrival)."""
    b = msg.fields["budget_ms"]
    if len(b) != 1 or b[0] < 0:
        raise ProtocolError(f"{msg.kind.name.lower()}.budget_ms: expected one value >= 0, "
                            f"got {b}")
    return b[0] / 1000.0

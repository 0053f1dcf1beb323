"""Lockstep step messages (engine/dist/protocol.py): int64 header + payload, no pickle; bad
headers refused naming the field; ParallelConfig validation."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine.core.config import ConfigError
from pdserve.engine.dist import protocol as proto
from pdserve.engine.dist.config import GRAPH_ALL_REDUCE_BYTES, ParallelConfig
from pdserve.engine.model.attention import HostBatch
from pdserve.engine.spec.mtp_plan import MTPPlan


def _batch() -> HostBatch:
    return HostBatch([5, 6, 7, 9], [0, 1, 2, 7], [40, 41, 42, 19], [3, 1], [3, 8],
                     [[10], [3, 4]], 16)


def _roundtrip(kind, seq, fields, flags=0) -> proto.Message:
    header, payload = proto.encode(kind, seq, fields, flags)
    assert header.dtype == payload.dtype == torch.int64 and header.shape == (proto.HEADER_LEN,)
    k, f, lens = proto.read_header(header.clone(), seq)
    return proto.decode(k, seq, f, lens, payload.clone())


def test_forward_message_carries_the_host_batch_and_logits_rows() -> None:
    b = _batch()
    msg = _roundtrip(proto.Kind.FORWARD, 7, proto.forward_fields(b, [2, 3]), proto.RETURN_PRENORM)
    assert msg.kind == proto.Kind.FORWARD and msg.seq == 7 and msg.flags == proto.RETURN_PRENORM
    assert proto.batch_of(msg) == b
    assert msg.fields["logits_rows"] == [2, 3]
    assert _roundtrip(proto.Kind.STOP, 8, {}).kind == proto.Kind.STOP
    copy = _roundtrip(proto.Kind.COPY_BLOCKS, 9, {"src": [1, 2], "dst": [3, 4]})
    assert copy.fields == {"src": [1, 2], "dst": [3, 4]}


@pytest.mark.parametrize("index,value,field", [
    (0, 123, "header.magic"), (1, 99, "header.version"), (2, 42, "header.kind"),
    (3, 5, "header.seq"), (5, 3, "header.nfields"), (6, -1, "header.lengths"),
    (proto.HEADER_LEN - 1, 1, "header.lengths"),
])
def test_bad_headers_are_refused_naming_the_field(index: int, value: int, field: str) -> None:
    header, _ = proto.encode(proto.Kind.FORWARD, 0, proto.forward_fields(_batch(), []))
    header[index] = value
    with pytest.raises(proto.ProtocolError, match=f"^{field}"):
        proto.read_header(header, 0)


def test_forward_carries_verify_rows_after_the_sampled_rows() -> None:
    msg = _roundtrip(proto.Kind.FORWARD, 0, proto.forward_fields(_batch(), [3], [0, 1, 2]))
    assert msg.fields["logits_rows"] == [3] and msg.fields["verify_rows"] == [0, 1, 2]
    with pytest.raises(proto.ProtocolError, match="^forward.verify_rows"):
        proto.batch_of(_roundtrip(proto.Kind.FORWARD, 0,
                                  proto.forward_fields(_batch(), [], [4])))


def test_forward_carries_the_prompt_logprob_calls() -> None:
    msg = _roundtrip(proto.Kind.FORWARD, 0,
                     proto.forward_fields(_batch(), [3], (), [[0, 1], [2]]))
    assert msg.fields["prompt_rows"] == [0, 1, 2] and msg.fields["prompt_slices"] == [2, 1]
    proto.batch_of(msg)
    for rows, slices, field in (([0, 4], [2], "forward.prompt_rows"),
                                ([0, 1], [1], "forward.prompt_slices"),
                                ([0, 1], [2, 0], "forward.prompt_slices")):
        fields = {**proto.forward_fields(_batch(), []), "prompt_rows": rows,
                  "prompt_slices": slices}
        with pytest.raises(proto.ProtocolError, match=f"^{field}"):
            proto.batch_of(_roundtrip(proto.Kind.FORWARD, 0, fields))


def test_a_launched_forward_carries_only_its_rows() -> None:
    """USE_LAUNCHED: the batch is the one the follower launched ahead; the message carries the
    logit rows only, checked against that batch's tokens (a batch field is refused)."""
    fields = proto.launched_fields([1, 3], (), [[0]])
    msg = _roundtrip(proto.Kind.FORWARD, 2, fields, proto.USE_LAUNCHED)
    assert msg.fields["logits_rows"] == [1, 3] and msg.fields["input_ids"] == []
    _, payload = proto.encode(proto.Kind.FORWARD, 2, fields)
    assert payload.numel() == 4  # logits_rows, prompt_rows, prompt_slices: nothing else
    proto.launched_of(msg, 4)
    with pytest.raises(proto.ProtocolError, match="^forward.logits_rows: rows outside"):
        proto.launched_of(msg, 3)
    with pytest.raises(proto.ProtocolError, match="^forward.positions: a USE_LAUNCHED"):
        proto.launched_of(_roundtrip(proto.Kind.FORWARD, 0, {**fields, "positions": [4]}), 4)


def test_a_follower_refuses_a_launched_forward_it_never_launched() -> None:
    from pdserve.engine.dist.lockstep import Follower

    follower = Follower(None, None, torch.zeros(1), graphs=None)  # type: ignore[arg-type]
    msg = _roundtrip(proto.Kind.FORWARD, 0, proto.launched_fields([0]), proto.USE_LAUNCHED)
    with pytest.raises(proto.ProtocolError, match="^forward.flags: no forward launched ahead"):
        follower.forward(msg)


def test_encode_takes_bools_and_large_ids() -> None:
    fields = {"src": [True, 2**40], "dst": [0, -1]}
    assert _roundtrip(proto.Kind.COPY_BLOCKS, 0, fields).fields == {"src": [1, 2**40],
                                                                    "dst": [0, -1]}


def _plan() -> MTPPlan:
    # job 0: a verify's 2 accepted rows then 2 drafts; job 1: a prefill chunk's 3 rows, no
    # drafts (only the MTP KV), a sampled request
    return MTPPlan([7, 8, 1, 2, 3], [1, 2, 4, 5, 6], [10, 0], [2, 3], [[4, 5, 6], [9]],
                   [2, 0], [True, False], 4)


def test_mtp_message_carries_the_drafting_plan() -> None:
    msg = _roundtrip(proto.Kind.MTP, 3, proto.mtp_fields(_plan()), proto.SHARED_HIDDEN)
    assert msg.kind == proto.Kind.MTP and msg.flags == proto.SHARED_HIDDEN
    assert proto.plan_of(msg) == _plan()
    assert _plan().positions() == [10, 11, 0, 1, 2]


@pytest.mark.parametrize("name,value,field", [
    ("rows", [1, 2, 4, 5], "mtp.rows"), ("lens", [2, 2], "mtp.lens"),
    ("ks", [2], "mtp.ks"), ("greedy", [1], "mtp.greedy"), ("table_lens", [3, 2], "mtp.block_tables"),
    ("starts", [], "mtp.lens"), ("rows", [1, 2, -4, 5, 6], "mtp.rows"),
])
def test_inconsistent_mtp_fields_are_refused_naming_the_field(name: str, value: list[int],
                                                              field: str) -> None:
    fields = {**proto.mtp_fields(_plan()), name: value}
    with pytest.raises(proto.ProtocolError, match=f"^{field}"):
        proto.plan_of(_roundtrip(proto.Kind.MTP, 0, fields))


def test_inconsistent_forward_fields_are_refused() -> None:
    fields = proto.forward_fields(_batch(), [])
    fields["positions"] = fields["positions"][:-1]
    msg = _roundtrip(proto.Kind.FORWARD, 0, fields)
    with pytest.raises(proto.ProtocolError, match="^forward.positions: 3 values, expected 4"):
        proto.batch_of(msg)
    fields = proto.forward_fields(_batch(), [4])
    with pytest.raises(proto.ProtocolError, match="^forward.logits_rows"):
        proto.batch_of(_roundtrip(proto.Kind.FORWARD, 0, fields))
    with pytest.raises(proto.ProtocolError, match="^fields: STOP takes"):
        proto.encode(proto.Kind.STOP, 0, {"src": []})
    header, payload = proto.encode(proto.Kind.COPY_BLOCKS, 0, {"src": [1], "dst": [2]})
    k, f, lens = proto.read_header(header, 0)
    with pytest.raises(proto.ProtocolError, match="^payload: 1 values"):
        proto.decode(k, 0, f, lens, payload[:1])


def test_parallel_config_names_the_bad_field() -> None:
    ok = ParallelConfig(2, 1, "gloo", "tcp://127.0.0.1:29500")
    assert not ok.is_leader and ok.with_rank(0).is_leader
    assert ParallelConfig.for_device(2, 0, "tcp://h:1", "cuda:0").backend == "nccl"
    # the peer all-reduce: NCCL groups that capture graphs, every rank from the same setting
    cuda = ParallelConfig.for_device(2, 1, "tcp://h:1", "cuda:1")
    assert cuda.with_graphs(True).peer_all_reduce_bytes == GRAPH_ALL_REDUCE_BYTES
    assert cuda.with_graphs(True).with_graphs(False).peer_all_reduce_bytes == 0
    assert ok.with_graphs(True).peer_all_reduce_bytes == 0  # gloo: none
    for kw, field in (({"tp_size": 0}, "tensor_parallel_size"), ({"rank": 2}, "rank"),
                      ({"backend": "mpi"}, "backend"), ({"init_address": "h:1"}, "init_address"),
                      ({"timeout_s": 0}, "timeout_s"), ({"backend": "nccl"}, "backend"),
                      ({"peer_all_reduce_bytes": -1}, "peer_all_reduce_bytes"),
                      ({"peer_all_reduce_bytes": 1.5}, "peer_all_reduce_bytes")):
        args = {"tp_size": 2, "rank": 0, "backend": "gloo", "init_address": "tcp://h:1", **kw}
        with pytest.raises(ConfigError, match=f"^{field}:"):
            ParallelConfig(**args)


@pytest.mark.parametrize("data", [b"", b"a", b"12345678", "décodé-0/ünïcode".encode(), bytes(range(256)) * 3])
def test_bytes_pack_into_int64_words_and_back(data: bytes) -> None:
    packed = proto.pack_bytes(data)
    assert packed[0] == len(data) and len(packed) == 1 + -(-len(data) // 8)
    assert proto.unpack_bytes(packed, "x") == data


def test_kv_messages_round_trip_and_bad_fields_are_refused_by_name() -> None:
    fields = {"op": [7], "worker_id": proto.pack_bytes(b"prefill-0"),
              "incarnation": proto.pack_bytes(b"ab12"), "remote_ids": [3, 4],
              "local_ids": [9, 10], "budget_ms": [2500]}
    msg = _roundtrip(proto.Kind.KV_PULL, 3, fields)
    assert proto.kv_op(msg) == 7 and proto.budget_s(msg) == 2.5
    assert proto.unpack_text(msg.fields["worker_id"], "kv_pull.worker_id") == "prefill-0"
    assert msg.fields["local_ids"] == [9, 10]
    for kind in proto.KV_KINDS:
        assert set(proto.FIELDS[kind]) >= {"op"}
    with pytest.raises(proto.ProtocolError, match="^kv_pull.worker_id: packed length"):
        proto.unpack_text([20, 1], "kv_pull.worker_id")  # 20 bytes claimed, 8 carried
    with pytest.raises(proto.ProtocolError, match="^add_peer.info: packed length"):
        proto.unpack_bytes([], "add_peer.info")
    with pytest.raises(proto.ProtocolError, match="^x: not UTF-8"):
        proto.unpack_text(proto.pack_bytes(b"\xff\xfe"), "x")
    bad = _roundtrip(proto.Kind.KV_PULL, 0, {**fields, "op": [1, 2], "budget_ms": [-1]})
    with pytest.raises(proto.ProtocolError, match="^kv_pull.op:"):
        proto.kv_op(bad)
    with pytest.raises(proto.ProtocolError, match="^kv_pull.budget_ms:"):
        proto.budget_s(bad)
    with pytest.raises(proto.ProtocolError, match="^fields: REMOVE_PEER takes"):
        proto.encode(proto.Kind.REMOVE_PEER, 0, {"op": [1]})


@pytest.mark.parametrize("query_lens, drafts", [([1, 1], 0), ([3, 3], 2)])
def test_a_graphed_forward_needs_the_followers_graphs(query_lens: list[int], drafts: int) -> None:
    """GRAPHED: rank 0 replays a decode graph (or an MTP verify graph of k drafts), whose
    collectives are padded to its bucket; a follower without that graph would all-reduce
    other sizes, so it refuses by the field instead (the real replays on two GPUs:
    tests/dist/test_tp_graphs_gpu.py)."""
    from pdserve.engine.dist.lockstep import Follower

    q = query_lens[0]
    batch = HostBatch(list(range(2 * q)), [7 + i for i in range(q)] * 2, list(range(2 * q)),
                      query_lens, [8, 8], [[10], [3, 4]], 16)
    flags = proto.GRAPHED | proto.RETURN_PRENORM
    msg = _roundtrip(proto.Kind.FORWARD, 0, proto.forward_fields(batch, [0]), flags)
    assert msg.flags == flags
    follower = Follower(None, None, torch.zeros(1), graphs=None)  # type: ignore[arg-type]
    with pytest.raises(proto.ProtocolError, match=f"^forward.flags: rank 0 replays a graph "
                                                  f"this rank has none for \\({drafts} drafts"):
        follower.forward(msg)

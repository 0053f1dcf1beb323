"""Lockstep step messages (engine/dist/protocol.py): int64 header + payload, no pickle; bad
headers refused naming the field; ParallelConfig validation."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine.core.config import ConfigError
from pdserve.engine.dist import protocol as proto
from pdserve.engine.dist.config import ParallelConfig
from pdserve.engine.model.attention import HostBatch


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
    (15, 1, "header.lengths"),
])
def test_bad_headers_are_refused_naming_the_field(index: int, value: int, field: str) -> None:
    header, _ = proto.encode(proto.Kind.FORWARD, 0, proto.forward_fields(_batch(), []))
    header[index] = value
    with pytest.raises(proto.ProtocolError, match=f"^{field}"):
        proto.read_header(header, 0)


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
    for kw, field in (({"tp_size": 0}, "tensor_parallel_size"), ({"rank": 2}, "rank"),
                      ({"backend": "mpi"}, "backend"), ({"init_address": "h:1"}, "init_address"),
                      ({"timeout_s": 0}, "timeout_s"), ({"backend": "nccl"}, "backend")):
        args = {"tp_size": 2, "rank": 0, "backend": "gloo", "init_address": "tcp://h:1", **kw}
        with pytest.raises(ConfigError, match=f"^{field}:"):
            ParallelConfig(**args)

"""PeerInfo wire format (JSON, no pickle) and compatibility checks that name the field."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from pdserve.engine.core.config import CacheConfig, ModelConfig, compat_payload, compatibility_hash
from pdserve.kv_transfer.handshake import (
    HandshakeError,
    IncompatiblePeerError,
    PeerInfo,
    check_compatible,
    check_layout_matches_compat,
    compat_hash,
)
from pdserve.kv_transfer.layout import KVLayout

MODEL = ModelConfig(arch="llama", vocab_size=128, hidden_size=32, num_layers=3, num_heads=4,
                    num_kv_heads=2, head_dim=8, intermediate_size=64, eos_token_ids=(1, 2))
CACHE = CacheConfig(block_size=4, num_blocks=64, kv_dtype="float32")


def make_info(worker_id="p0", model=MODEL, cache=CACHE, extra=None, **over) -> PeerInfo:
    kv = torch.zeros(cache.num_blocks, model.num_kv_heads, model.num_layers
                     + model.num_mtp_layers, 2, cache.block_size, model.head_dim)
    cfg = compat_payload(model, cache, extra)
    info = PeerInfo(worker_id=worker_id, incarnation="abc123", agent_name=f"{worker_id}#abc123",
                    agent_metadata=bytes(range(256)) * 3, kv_base_addr=0x7F0000001000,
                    kv_device_id=0, kv_mem_type="DRAM", layout=KVLayout.from_cache(kv, heads_outer=True),
                    compat_hash=compat_hash(cfg), compat_config=cfg)
    return dataclasses.replace(info, **over)


def test_compat_hash_matches_engine_recipe():
    extra = {"mtp": {"k": 2}, "ids": (1, 2)}
    assert compat_hash(compat_payload(MODEL, CACHE, extra)) == compatibility_hash(MODEL, CACHE,
                                                                                 extra)
    assert compat_hash(compat_payload(MODEL, CACHE)) == compatibility_hash(MODEL, CACHE)


def test_round_trip_is_json_and_exact():
    info = make_info()
    blob = info.to_bytes()
    assert json.loads(blob)["worker_id"] == "p0"  # plain JSON on the wire
    assert PeerInfo.from_bytes(blob) == info


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d.pop("incarnation"), "peer_info.incarnation: missing"),
    (lambda d: d.update(kv_base_addr="12"), "peer_info.kv_base_addr: expected int"),
    (lambda d: d.update(kv_mem_type="GPU"), "peer_info.kv_mem_type"),
    (lambda d: d.update(agent_metadata="!!notb64"), "peer_info.agent_metadata"),
    (lambda d: d["layout"].update(block_size=0), "block_size"),
    (lambda d: d.update(version=99), "peer_info.version"),
    (lambda d: d.update(worker_id=""), "peer_info.worker_id: empty"),
])
def test_from_bytes_names_bad_field(mutate, field):
    d = json.loads(make_info().to_bytes())
    mutate(d)
    with pytest.raises(HandshakeError, match=field):
        PeerInfo.from_bytes(json.dumps(d).encode())


def test_from_bytes_refuses_garbage():
    for blob in (b"\x80\x04pickle", b"[1, 2]", "str"):
        with pytest.raises(HandshakeError, match="peer_info"):
            PeerInfo.from_bytes(blob)


def test_compatible_pair_passes_even_with_different_pool_sizes():
    other = make_info("d0", cache=dataclasses.replace(CACHE, num_blocks=10))
    check_compatible(make_info(), other)


def test_block_size_mismatch_is_named():
    other = make_info("d0", cache=dataclasses.replace(CACHE, block_size=8))
    with pytest.raises(IncompatiblePeerError, match="block_size: 4 != 8") as e:
        check_compatible(make_info(), other)
    assert "layout.block_size: 4 != 8" in str(e.value)


def test_model_mismatch_is_named():
    other = make_info("d0", model=dataclasses.replace(MODEL, rope_theta=1e6))
    with pytest.raises(IncompatiblePeerError, match=r"model\.rope_theta: 10000\.0 != 1000000\.0"):
        check_compatible(make_info(), other)


def test_extra_mismatch_is_named():
    with pytest.raises(IncompatiblePeerError, match=r"extra\.mtp_k: 1 != 2"):
        check_compatible(make_info(extra={"mtp_k": 1}), make_info("d0", extra={"mtp_k": 2}))


def test_hash_that_does_not_match_its_config_is_refused():
    with pytest.raises(IncompatiblePeerError, match="compat_hash"):
        check_compatible(make_info(), make_info("d0", compat_hash="0" * 16))


def test_local_tensor_must_match_claimed_config():
    cfg = compat_payload(MODEL, CACHE)
    check_layout_matches_compat(make_info().layout, cfg)
    wrong = KVLayout.from_cache(torch.zeros(8, 2, 3, 2, 16, 8), heads_outer=True)
    with pytest.raises(ValueError, match="block_size is 16 .* says 4"):
        check_layout_matches_compat(wrong, cfg)
    half = KVLayout.from_cache(torch.zeros(8, 2, 3, 2, 4, 8, dtype=torch.float16),
                               heads_outer=True)
    with pytest.raises(ValueError, match="dtype"):
        check_layout_matches_compat(half, cfg)

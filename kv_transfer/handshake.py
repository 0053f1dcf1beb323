"""What two workers exchange before KV moves between them, and the compatibility check.

A `PeerInfo` is published by every worker and carried by the lead's protobuf messages as
opaque bytes (`to_bytes` / `from_bytes`: JSON, never pickle). It names the peer by
(worker_id, incarnation): the incarnation is random per process start, so a restarted
worker is a new peer and handles to the old one go stale (ANCHORS #3).

Compatibility (ANCHORS #8): the hash covers everything that must agree for a KV block to
mean the same on both sides (engine/core/config.py compat_payload: model shape, block size,
KV dtype and, for an FP8 cache, its scale layout (kv_cache_dtype, kv_scales), layout
version, extra such as MTP config; built there only). The config dict it was computed from
travels along, so a refusal says WHAT differs ("block_size: 16 != 32"), not just "hash
mismatch". The KV tensor layouts are compared as well (all but num_blocks).

Security: a PeerInfo carries NIXL's remote keys for this worker's registered KV memory, so
whoever holds it can READ that memory. Hand it only to peers the router introduced.
"""
from __future__ import annotations

import base64
import binascii
import json
from dataclasses import asdict, dataclass, field

from pdserve.engine.core.config import describe_mismatch, payload_hash

from .layout import KVLayout

PEER_INFO_VERSION = 1
MAX_PEER_INFO_BYTES = 16 << 20  # NIXL metadata is KiBs; refuse anything absurd


class HandshakeError(ValueError):
    """A PeerInfo blob is malformed; the message names the field."""


class IncompatiblePeerError(ValueError):
    """The peer's KV blocks would not mean the same here; the message lists what differs."""


def normalize_config(config: dict) -> dict:
    """A deep copy of `config` as it reads back from JSON (hashing it gives the same hash)."""
    if not isinstance(config, dict):
        raise ValueError(f"compat: expected a dict, got {type(config).__name__}")
    return json.loads(json.dumps(config, sort_keys=True, default=str))


def compat_hash(config: dict) -> str:
    """The hash a peer's compat config must carry (engine.core.config.payload_hash)."""
    return payload_hash(config)


def check_layout_matches_compat(layout: KVLayout, config: dict) -> None:
    """A worker's own KV tensor must agree with the config it claims (catches wiring bugs)."""
    model = config.get("model") or {}
    expected = {
        "block_size": config.get("block_size"),
        "dtype": config.get("kv_dtype"),
        "num_kv_heads": model.get("num_kv_heads"),
        "head_dim": model.get("head_dim"),
    }
    if "num_layers" in model:  # an fp8 cache's blocks end in its scale layers
        scales = config.get("kv_scales") or {}
        expected["num_kv_layers"] = (model["num_layers"] + model.get("num_mtp_layers", 0)
                                     + scales.get("scale_layers", 0))
    for name, want in expected.items():
        if want is not None and getattr(layout, name) != want:
            raise ValueError(f"kv_cache: {name} is {getattr(layout, name)!r} but the "
                             f"compatibility config says {want!r}")


@dataclass(frozen=True)
class PeerInfo:
    worker_id: str
    incarnation: str  # random per process start
    agent_name: str  # NIXL agent name (unique per incarnation)
    agent_metadata: bytes  # NIXL's opaque agent metadata (get_agent_metadata)
    kv_base_addr: int  # address of kv_cache[0] in the peer's address space
    kv_device_id: int  # CUDA ordinal of the KV tensor (0 for host memory)
    kv_mem_type: str  # "DRAM" | "VRAM"
    layout: KVLayout
    compat_hash: str
    compat_config: dict = field(hash=False)
    version: int = PEER_INFO_VERSION

    def to_bytes(self) -> bytes:
        d = asdict(self)
        d["agent_metadata"] = base64.b64encode(self.agent_metadata).decode("ascii")
        return json.dumps(d, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, blob: bytes) -> PeerInfo:
        if not isinstance(blob, (bytes, bytearray)):
            raise HandshakeError(f"peer_info: expected bytes, got {type(blob).__name__}")
        if len(blob) > MAX_PEER_INFO_BYTES:
            raise HandshakeError(f"peer_info: {len(blob)} bytes exceeds {MAX_PEER_INFO_BYTES}")
        try:
            d = json.loads(bytes(blob).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise HandshakeError(f"peer_info: not UTF-8 JSON ({e})") from e
        if not isinstance(d, dict):
            raise HandshakeError("peer_info: expected a JSON object")
        return cls._from_dict(d)

    @classmethod
    def _from_dict(cls, d: dict) -> PeerInfo:
        types = {"worker_id": str, "incarnation": str, "agent_name": str, "agent_metadata": str,
                 "kv_base_addr": int, "kv_device_id": int, "kv_mem_type": str,
                 "layout": dict, "compat_hash": str, "compat_config": dict, "version": int}
        for name, typ in types.items():
            if name not in d:
                raise HandshakeError(f"peer_info.{name}: missing")
            if not isinstance(d[name], typ) or isinstance(d[name], bool):
                raise HandshakeError(f"peer_info.{name}: expected {typ.__name__}, "
                                     f"got {type(d[name]).__name__}")
        if d["version"] != PEER_INFO_VERSION:
            raise HandshakeError(f"peer_info.version: {d['version']} != {PEER_INFO_VERSION}")
        if d["kv_mem_type"] not in ("DRAM", "VRAM"):
            raise HandshakeError(f"peer_info.kv_mem_type: unknown {d['kv_mem_type']!r}")
        for name in ("worker_id", "incarnation", "agent_name"):
            if not d[name]:
                raise HandshakeError(f"peer_info.{name}: empty")
        try:
            metadata = base64.b64decode(d["agent_metadata"], validate=True)
        except (binascii.Error, ValueError) as e:
            raise HandshakeError(f"peer_info.agent_metadata: not base64 ({e})") from e
        try:
            layout = KVLayout.from_dict(d["layout"])
        except (TypeError, ValueError) as e:
            raise HandshakeError(f"peer_info.layout: {e}") from e
        return cls(worker_id=d["worker_id"], incarnation=d["incarnation"],
                   agent_name=d["agent_name"], agent_metadata=metadata,
                   kv_base_addr=d["kv_base_addr"], kv_device_id=d["kv_device_id"],
                   kv_mem_type=d["kv_mem_type"], layout=layout, compat_hash=d["compat_hash"],
                   compat_config=d["compat_config"], version=d["version"])


def check_new_peer(local: PeerInfo, remote: PeerInfo) -> None:
    """What every transport checks before trusting a peer: not itself, and compatible."""
    if remote.worker_id == local.worker_id:
        raise ValueError(f"peer_info.worker_id: {remote.worker_id!r} is this worker itself")
    check_compatible(local, remote)


def check_compatible(local: PeerInfo, remote: PeerInfo) -> None:
    """Raise IncompatiblePeerError naming every field that differs; return if compatible."""
    problems: list[str] = []
    if compat_hash(remote.compat_config) != remote.compat_hash:
        problems.append(f"compat_hash: {remote.compat_hash!r} does not match the peer's own "
                        f"config (hash {compat_hash(remote.compat_config)!r})")
    if remote.compat_hash != local.compat_hash:
        diffs = describe_mismatch(local.compat_config, remote.compat_config)
        problems += diffs or [f"compat_hash: {local.compat_hash!r} != {remote.compat_hash!r}"]
    problems += local.layout.mismatch(remote.layout)
    if problems:
        raise IncompatiblePeerError(
            f"peer {remote.worker_id!r} (incarnation {remote.incarnation}) is incompatible "
            f"with {local.worker_id!r} (local != peer): " + "; ".join(problems))

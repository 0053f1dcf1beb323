"""What two workers exchange before KV moves between them, and the compatibility check.

A `PeerInfo` is published by every worker and carried by the lead's protobuf messages as
opaque bytes (`to_bytes` / `from_bytes`: JSON, never pickle). It names the peer by
(worker_id, incarnation): the incarnation is random per process start, so a restarted
worker is a new peer and handles to the old one go stale (ANCHORS #3).

Compatibility (ANCHORS #8): the hash covers everything that must agree for a KV block to
mean the same on both sides (engine/core/config.py compat_payload: model shape, the model's
identity (which weights, tokenizer and load-time quantization: ModelIdentity), block size,
KV dtype and, for an FP8 cache, its scale layout (kv_cache_dtype, kv_scales), layout
version, extra such as MTP config; built there only). The config dict it was computed from
travels along, so a refusal says WHAT differs ("block_size: 16 != 32"), not just "hash
mismatch". The KV tensor layouts are compared as well (all but num_blocks).

Tensor parallelism (PeerInfo version 2): a worker of TP size N is N ranks, each with its own
KV tensor (its KV heads) and its own NIXL agent. Its PeerInfo says how KV heads lie over the
ranks (`tp`, engine/core/tp.py TPKVInfo) and where each rank's memory is (`ranks`, one
RankEndpoint per rank, rank order; the top-level agent/address fields are rank 0's). A TP-1
worker's PeerInfo has one rank. Two workers are compatible when, besides the hash, every
decode rank can pull its heads (tp_pair_problems, refusals name `tp.<field>`).

Security: a PeerInfo carries NIXL's remote keys for this worker's registered KV memory, so
whoever holds it can READ that memory. Hand it only to peers the router introduced.
"""
from __future__ import annotations

import base64
import binascii
import json
from dataclasses import asdict, dataclass, field, replace

from pdserve.engine.core.config import ConfigError, describe_mismatch, payload_hash
from pdserve.engine.core.tp import HeadSplit, TPKVInfo, tp_pair_problems

from .layout import KVLayout

PEER_INFO_VERSION = 2
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


def check_layout_matches_compat(layout: KVLayout, config: dict,
                                num_kv_heads: int | None = None) -> None:
    """A worker's own KV tensor must agree with the config it claims (catches wiring bugs).
    `num_kv_heads`: the KV heads of this rank's cache (a TP rank's count); None: the model's."""
    model = config.get("model") or {}
    expected = {
        "block_size": config.get("block_size"),
        "dtype": config.get("kv_dtype"),
        "num_kv_heads": model.get("num_kv_heads") if num_kv_heads is None else num_kv_heads,
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


def local_tp_info(layout: KVLayout, compat: dict, tp: TPKVInfo | None, rank: int) -> TPKVInfo:
    """The TP map a transport publishes, checked against its own KV tensor: rank `rank` of
    `tp` (None: TP 1, this tensor holds every KV head). ValueError names the argument."""
    if tp is None:
        if rank != 0:
            raise ValueError(f"rank: {rank!r} without a tp map (TP 1 has rank 0 only)")
        tp = TPKVInfo(1, layout.num_kv_heads, ((0, layout.num_kv_heads),), layout.heads_outer)
    if not isinstance(tp, TPKVInfo):
        raise ValueError(f"tp: expected a TPKVInfo, got {type(tp).__name__}")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < tp.tp_size:
        raise ValueError(f"rank: must be in [0, {tp.tp_size}), got {rank!r}")
    model_heads = (compat.get("model") or {}).get("num_kv_heads", tp.num_kv_heads)
    if tp.num_kv_heads != model_heads:
        raise ValueError(f"tp.num_kv_heads: {tp.num_kv_heads} but the model has {model_heads}")
    try:
        want = HeadSplit(tp.num_kv_heads * tp.tp_size, tp.num_kv_heads, tp.tp_size).head_map()
    except ConfigError as e:
        raise ValueError(f"tp.tp_size: {e}") from e
    if list(tp.head_map) != want:
        raise ValueError(f"tp.head_map: {list(tp.head_map)} is not the split {want}")
    if tp.heads_outer != layout.heads_outer:
        raise ValueError(f"tp.heads_outer: {tp.heads_outer} but the KV tensor's layout has "
                         f"heads_outer={layout.heads_outer}")
    check_layout_matches_compat(layout, compat, num_kv_heads=tp.head_map[rank][1])
    return tp


def _check_fields(d: dict, types: dict[str, type], where: str) -> None:
    for name, typ in types.items():
        if name not in d:
            raise HandshakeError(f"{where}.{name}: missing")
        if not isinstance(d[name], typ) or isinstance(d[name], bool):
            raise HandshakeError(f"{where}.{name}: expected {typ.__name__}, "
                                 f"got {type(d[name]).__name__}")


def _b64(value: str, where: str) -> bytes:
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as e:
        raise HandshakeError(f"{where}: not base64 ({e})") from e


@dataclass(frozen=True)
class RankEndpoint:
    """Where one rank's KV memory is: its NIXL agent and registered KV tensor. Ranks > 0 send
    theirs to rank 0 (to_bytes), which publishes them all in its PeerInfo (group_peer_info)."""

    agent_name: str
    agent_metadata: bytes  # NIXL's opaque agent metadata
    kv_base_addr: int  # address of this rank's kv_cache[0]
    kv_device_id: int  # CUDA ordinal (0 for host memory)
    kv_mem_type: str  # "DRAM" | "VRAM"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["agent_metadata"] = base64.b64encode(self.agent_metadata).decode("ascii")
        return d

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True).encode()

    @classmethod
    def from_dict(cls, d: object, where: str = "rank_endpoint") -> RankEndpoint:
        """Strict: every problem names its field (`where`.<name>)."""
        if not isinstance(d, dict):
            raise HandshakeError(f"{where}: expected an object, got {type(d).__name__}")
        _check_fields(d, {"agent_name": str, "agent_metadata": str, "kv_base_addr": int,
                          "kv_device_id": int, "kv_mem_type": str}, where)
        if not d["agent_name"]:
            raise HandshakeError(f"{where}.agent_name: empty")
        if d["kv_mem_type"] not in ("DRAM", "VRAM"):
            raise HandshakeError(f"{where}.kv_mem_type: unknown {d['kv_mem_type']!r}")
        for name in ("kv_base_addr", "kv_device_id"):
            if d[name] < 0:
                raise HandshakeError(f"{where}.{name}: negative")
        return cls(d["agent_name"], _b64(d["agent_metadata"], f"{where}.agent_metadata"),
                   d["kv_base_addr"], d["kv_device_id"], d["kv_mem_type"])

    @classmethod
    def from_bytes(cls, blob: bytes) -> RankEndpoint:
        return cls.from_dict(_json_object(blob, "rank_endpoint"))


def _json_object(blob: object, where: str) -> dict:
    if not isinstance(blob, (bytes, bytearray)):
        raise HandshakeError(f"{where}: expected bytes, got {type(blob).__name__}")
    if len(blob) > MAX_PEER_INFO_BYTES:
        raise HandshakeError(f"{where}: {len(blob)} bytes exceeds {MAX_PEER_INFO_BYTES}")
    try:
        d = json.loads(bytes(blob).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HandshakeError(f"{where}: not UTF-8 JSON ({e})") from e
    if not isinstance(d, dict):
        raise HandshakeError(f"{where}: expected a JSON object")
    return d


@dataclass(frozen=True)
class PeerInfo:
    """One worker's handshake. The top-level agent / kv_* fields are rank 0's endpoint; `tp`
    (None: TP 1 over `layout`) and `ranks` (empty: just rank 0; ranks[0] is always the
    top-level endpoint) are filled in on construction."""

    worker_id: str
    incarnation: str  # random per process start (rank 0's, for a TP group)
    agent_name: str  # NIXL agent name (unique per incarnation)
    agent_metadata: bytes  # NIXL's opaque agent metadata (get_agent_metadata)
    kv_base_addr: int  # address of kv_cache[0] in the peer's address space
    kv_device_id: int  # CUDA ordinal of the KV tensor (0 for host memory)
    kv_mem_type: str  # "DRAM" | "VRAM"
    layout: KVLayout  # rank 0's KV tensor (every rank's but for num_blocks is the same)
    compat_hash: str
    compat_config: dict = field(hash=False)
    version: int = PEER_INFO_VERSION
    tp: TPKVInfo | None = None
    ranks: tuple[RankEndpoint, ...] = ()

    def __post_init__(self) -> None:
        if self.tp is None:
            heads = self.layout.num_kv_heads
            object.__setattr__(self, "tp", TPKVInfo(1, heads, ((0, heads),),
                                                    self.layout.heads_outer))
        # the top-level fields are rank 0's endpoint: they win (dataclasses.replace of them
        # moves rank 0); a PeerInfo read from bytes has checked that both agreed
        object.__setattr__(self, "ranks", (self.endpoint, *tuple(self.ranks)[1:]))

    @property
    def endpoint(self) -> RankEndpoint:
        """Rank 0's endpoint (the top-level fields)."""
        return RankEndpoint(self.agent_name, self.agent_metadata, self.kv_base_addr,
                            self.kv_device_id, self.kv_mem_type)

    @property
    def tp_info(self) -> TPKVInfo:
        assert self.tp is not None  # filled in by __post_init__
        return self.tp

    def to_bytes(self) -> bytes:
        d = {f: getattr(self, f) for f in ("worker_id", "incarnation", "agent_name",
                                           "kv_base_addr", "kv_device_id", "kv_mem_type",
                                           "compat_hash", "compat_config", "version")}
        d["agent_metadata"] = base64.b64encode(self.agent_metadata).decode("ascii")
        d["layout"] = self.layout.to_dict()
        d["tp"] = self.tp_info.to_dict()
        d["ranks"] = [r.to_dict() for r in self.ranks]
        return json.dumps(d, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, blob: bytes) -> PeerInfo:
        return cls._from_dict(_json_object(blob, "peer_info"))

    @classmethod
    def _from_dict(cls, d: dict) -> PeerInfo:
        _check_fields(d, {"worker_id": str, "incarnation": str, "agent_name": str,
                          "agent_metadata": str, "kv_base_addr": int, "kv_device_id": int,
                          "kv_mem_type": str, "layout": dict, "compat_hash": str,
                          "compat_config": dict, "version": int, "tp": dict, "ranks": list},
                      "peer_info")
        if d["version"] != PEER_INFO_VERSION:
            raise HandshakeError(f"peer_info.version: {d['version']} != {PEER_INFO_VERSION}")
        if d["kv_mem_type"] not in ("DRAM", "VRAM"):
            raise HandshakeError(f"peer_info.kv_mem_type: unknown {d['kv_mem_type']!r}")
        for name in ("worker_id", "incarnation", "agent_name"):
            if not d[name]:
                raise HandshakeError(f"peer_info.{name}: empty")
        metadata = _b64(d["agent_metadata"], "peer_info.agent_metadata")
        try:
            layout = KVLayout.from_dict(d["layout"])
        except (TypeError, ValueError) as e:
            raise HandshakeError(f"peer_info.layout: {e}") from e
        try:
            tp = TPKVInfo.from_dict(d["tp"])
        except ConfigError as e:
            raise HandshakeError(f"peer_info.{e}") from e
        ranks = tuple(RankEndpoint.from_dict(r, f"peer_info.ranks[{i}]")
                      for i, r in enumerate(d["ranks"]))
        if ranks and ranks[0] != RankEndpoint(d["agent_name"], metadata, d["kv_base_addr"],
                                              d["kv_device_id"], d["kv_mem_type"]):
            raise HandshakeError("peer_info.ranks[0]: differs from the top-level agent/kv fields")
        info = cls(worker_id=d["worker_id"], incarnation=d["incarnation"],
                   agent_name=d["agent_name"], agent_metadata=metadata,
                   kv_base_addr=d["kv_base_addr"], kv_device_id=d["kv_device_id"],
                   kv_mem_type=d["kv_mem_type"], layout=layout, compat_hash=d["compat_hash"],
                   compat_config=d["compat_config"], version=d["version"], tp=tp, ranks=ranks)
        _check_ranks(info)
        return info


def _check_ranks(info: PeerInfo) -> None:
    """A whole group's PeerInfo: one endpoint per rank, rank 0's = the top-level fields."""
    tp = info.tp_info
    if len(info.ranks) != tp.tp_size or len(tp.head_map) != tp.tp_size:
        raise HandshakeError(f"peer_info.ranks: {len(info.ranks)} endpoints and "
                             f"{len(tp.head_map)} head_map entries for tp.tp_size={tp.tp_size}")
    if len({r.agent_name for r in info.ranks}) != len(info.ranks):
        raise HandshakeError("peer_info.ranks: two ranks share an agent_name")


def group_peer_info(leader: PeerInfo, endpoints: list[RankEndpoint]) -> PeerInfo:
    """The PeerInfo rank 0 of a TP worker publishes: its own (`leader`, from its transport)
    with every rank's endpoint (rank order; endpoints[0] is rank 0's own)."""
    eps = tuple(endpoints)
    if not all(isinstance(e, RankEndpoint) for e in eps):
        raise ValueError("endpoints: expected RankEndpoint items")
    if eps and eps[0] != leader.endpoint:
        raise ValueError("endpoints[0]: is not the leader's own endpoint (rank 0 first)")
    info = replace(leader, ranks=eps)
    try:
        _check_ranks(info)
    except HandshakeError as e:
        raise ValueError(f"endpoints: {e}") from e
    return info


def check_new_peer(local: PeerInfo, remote: PeerInfo) -> None:
    """What every transport checks before trusting a peer: not itself, and compatible."""
    if remote.worker_id == local.worker_id:
        raise ValueError(f"peer_info.worker_id: {remote.worker_id!r} is this worker itself")
    _check_ranks(remote)
    check_compatible(local, remote)


def check_compatible(local: PeerInfo, remote: PeerInfo) -> None:
    """Raise IncompatiblePeerError naming every field that differs; return if compatible.
    `remote` is the peer this worker pulls from (its prefill side); with TP on either side
    the layouts' num_kv_heads are per rank and the TP maps decide (tp_pair_problems)."""
    problems: list[str] = []
    if compat_hash(remote.compat_config) != remote.compat_hash:
        problems.append(f"compat_hash: {remote.compat_hash!r} does not match the peer's own "
                        f"config (hash {compat_hash(remote.compat_config)!r})")
    if remote.compat_hash != local.compat_hash:
        diffs = describe_mismatch(local.compat_config, remote.compat_config)
        problems += diffs or [f"compat_hash: {local.compat_hash!r} != {remote.compat_hash!r}"]
    lt, rt = local.tp_info, remote.tp_info
    if lt.tp_size == 1 and rt.tp_size == 1:
        problems += local.layout.mismatch(remote.layout)
    else:
        problems += local.layout.mismatch(remote.layout, ignore=("num_kv_heads",))
        if rt.heads_outer != remote.layout.heads_outer:
            problems.append(f"tp.heads_outer: {rt.heads_outer} but the peer's layout has "
                            f"heads_outer={remote.layout.heads_outer}")
        if remote.layout.num_kv_heads != rt.head_map[0][1]:
            problems.append(f"tp.head_map: rank 0 holds {rt.head_map[0][1]} KV heads but its "
                            f"layout has {remote.layout.num_kv_heads}")
    problems += tp_pair_problems(rt, lt)
    if problems:
        raise IncompatiblePeerError(
            f"peer {remote.worker_id!r} (incarnation {remote.incarnation}) is incompatible "
            f"with {local.worker_id!r} (local != peer): " + "; ".join(problems))


def cache_layout(kv_cache: object, compat: dict) -> KVLayout:
    """A worker's KV tensor read the way its compat config's layout_version says (2: heads
    outermost inside a block; 1: heads inner)."""
    version = compat.get("layout_version", 1)
    return KVLayout.from_cache(kv_cache, heads_outer=version >= 2)  # type: ignore[arg-type]

"""How a model splits over tensor-parallel ranks, and which prefill rank each decode rank pulls
its KV heads from when prefill and decode run at different TP sizes. Torch-free (plain ints),
so kv_transfer/ can use it too: engine/core is the one place both engine/ and kv_transfer/
may import (engine/dist/heads.py re-exports it for the engine's TP code).

Splits (errors name the field and the TP size):
  * attention heads: num_heads % tp == 0; rank r owns q heads [r * Hq/tp, (r + 1) * Hq/tp).
  * KV heads: num_kv_heads >= tp: sharded, num_kv_heads % tp == 0, rank r owns
    [r * Hkv/tp, (r + 1) * Hkv/tp). num_kv_heads < tp: replicated, tp % num_kv_heads == 0,
    rank r holds the one KV head its q heads use, r // (tp / Hkv); tp / Hkv ranks hold each.
    Either way a rank's q heads read only the KV heads it holds (GQA groups never straddle).
  * MLP (dense, shared expert, each routed expert): intermediate % tp == 0, contiguous.
  * vocabulary: ceil(V / tp) rows per rank, the last rank padded (V % tp may be != 0).

KV pulls: a decode rank owns a range of global KV heads (one replicated head, or its shard);
for each it picks a prefill rank that holds it (spread over replicas by rank), and runs of
consecutive heads from one prefill rank become one HeadPull. With the block layout of phase 2
(inside a block the heads are outermost: [Hkv_local, layers, 2, block_size, head_dim]) a
HeadPull of one block is one contiguous byte range on both sides, and whole-block pulls of a
run of blocks still coalesce into one descriptor (slice_ranges).
"""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.core.config import ConfigError, ModelConfig

TP_MAP_VERSION = 1


def _positive_int(value: object, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name}: must be an int >= 1, got {value!r}")
    return value


def even_split(n: int, tp: int, rank: int, field: str) -> range:
    """Rank `rank`'s contiguous 1/tp of n items; ConfigError naming `field` when tp does not
    divide n (an uneven split would give ranks different shapes, which the kernels and the
    lockstep batch shapes do not allow)."""
    if n % tp:
        raise ConfigError(f"{field}: {n} does not split evenly over tensor_parallel_size={tp}")
    per = n // tp
    return range(rank * per, (rank + 1) * per)


@dataclass(frozen=True)
class HeadSplit:
    """Attention and KV heads of one model over `tp` ranks (checked on construction)."""

    num_heads: int
    num_kv_heads: int
    tp: int

    def __post_init__(self) -> None:
        _positive_int(self.tp, "tensor_parallel_size")
        _positive_int(self.num_heads, "num_heads")
        _positive_int(self.num_kv_heads, "num_kv_heads")
        if self.num_heads % self.tp:
            raise ConfigError(f"num_heads: {self.num_heads} attention heads do not split over "
                              f"tensor_parallel_size={self.tp} (use a TP size that divides it)")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_kv_heads: {self.num_heads} heads are not a multiple of "
                              f"{self.num_kv_heads} KV heads")
        if self.num_kv_heads >= self.tp and self.num_kv_heads % self.tp:
            raise ConfigError(f"num_kv_heads: {self.num_kv_heads} KV heads do not split over "
                              f"tensor_parallel_size={self.tp}")
        if self.num_kv_heads < self.tp and self.tp % self.num_kv_heads:
            raise ConfigError(f"num_kv_heads: {self.num_kv_heads} KV heads cannot be replicated "
                              f"evenly over tensor_parallel_size={self.tp} (need tp % "
                              f"num_kv_heads == 0)")

    @property
    def replicated(self) -> bool:
        """Whether ranks hold copies of a KV head (num_kv_heads < tp)."""
        return self.num_kv_heads < self.tp

    @property
    def q_per_rank(self) -> int:
        return self.num_heads // self.tp

    @property
    def kv_per_rank(self) -> int:
        """KV heads in each rank's cache: its shard, or the 1 replicated head."""
        return 1 if self.replicated else self.num_kv_heads // self.tp

    def _rank(self, rank: int) -> int:
        if not isinstance(rank, int) or not 0 <= rank < self.tp:
            raise ConfigError(f"rank: must be in [0, {self.tp}), got {rank!r}")
        return rank

    def q_heads(self, rank: int) -> range:
        per = self.q_per_rank
        return range(self._rank(rank) * per, (rank + 1) * per)

    def kv_heads(self, rank: int) -> range:
        """Global KV heads in rank's cache, in cache order."""
        self._rank(rank)
        if self.replicated:
            h = rank // (self.tp // self.num_kv_heads)
            return range(h, h + 1)
        per = self.kv_per_rank
        return range(rank * per, (rank + 1) * per)

    def ranks_holding(self, kv_head: int) -> list[int]:
        """Ranks whose cache holds global KV head `kv_head` (several when replicated)."""
        if not 0 <= kv_head < self.num_kv_heads:
            raise ConfigError(f"kv_head: must be in [0, {self.num_kv_heads}), got {kv_head}")
        return [r for r in range(self.tp) if kv_head in self.kv_heads(r)]

    def head_map(self) -> list[tuple[int, int]]:
        """(first global KV head, count) per rank: what a worker publishes at handshake."""
        return [(self.kv_heads(r).start, len(self.kv_heads(r))) for r in range(self.tp)]


def vocab_shard(vocab_size: int, tp: int, rank: int) -> tuple[int, int, int]:
    """(start, valid, rows): rank's rows of the vocabulary-parallel embedding / LM head.
    Every rank holds rows = ceil(V / tp) rows starting at start = rank * rows; the first
    `valid` are real tokens, the rest padding (zero rows; -inf logits in a cross-rank argmax)."""
    _positive_int(vocab_size, "vocab_size")
    _positive_int(tp, "tensor_parallel_size")
    rows = -(-vocab_size // tp)
    start = rank * rows
    return start, max(0, min(rows, vocab_size - start)), rows


def check_model_split(cfg: ModelConfig, tp: int) -> HeadSplit:
    """Every shape of `cfg` that TP=tp splits, checked; ConfigError names the first that
    does not split (num_heads, num_kv_heads, intermediate_size, moe_intermediate_size)."""
    heads = HeadSplit(cfg.num_heads, cfg.num_kv_heads, tp)
    even_split(cfg.intermediate_size, tp, 0, "intermediate_size")
    if cfg.moe is not None:
        even_split(cfg.moe.intermediate_size, tp, 0, "moe_intermediate_size")
    return heads


def local_shapes(cfg: ModelConfig, tp: int) -> dict[str, int]:
    """The per-rank values of the ModelConfig fields TP changes (a rank's Model is built from
    dataclasses.replace(cfg, **local_shapes(cfg, tp)) plus its MoE's intermediate size)."""
    heads = check_model_split(cfg, tp)
    return {"num_heads": heads.q_per_rank, "num_kv_heads": heads.kv_per_rank,
            "intermediate_size": cfg.intermediate_size // tp,
            "vocab_size": vocab_shard(cfg.vocab_size, tp, 0)[2]}


# -- KV transfer between TP sizes -----------------------------------------------------------

@dataclass(frozen=True)
class HeadPull:
    """`count` KV heads a decode rank reads from prefill rank `src_rank`: from local head
    `src_head` of that rank's cache into local head `dst_head` of its own."""

    src_rank: int
    src_head: int
    dst_head: int
    count: int


def pull_plan(num_kv_heads: int, prefill_tp: int, decode_tp: int) -> list[list[HeadPull]]:
    """Per decode rank, the head slices it pulls (in its cache order). Replicated heads on
    the prefill side are read from the replica at decode_rank % replicas, so D ranks spread
    their reads over P ranks; replicated heads on the decode side are read by every replica."""
    # num_heads only matters for the q split, not for where KV lives: num_kv_heads * tp
    # heads is a valid stand-in for both splits
    p = HeadSplit(num_kv_heads * prefill_tp, num_kv_heads, prefill_tp)
    d = HeadSplit(num_kv_heads * decode_tp, num_kv_heads, decode_tp)
    plan: list[list[HeadPull]] = []
    for rank in range(decode_tp):
        pulls: list[HeadPull] = []
        for dst, g in enumerate(d.kv_heads(rank)):
            holders = p.ranks_holding(g)
            src_rank = holders[rank % len(holders)]
            src = g - p.kv_heads(src_rank).start
            last = pulls[-1] if pulls else None
            if last and last.src_rank == src_rank and last.src_head + last.count == src \
                    and last.dst_head + last.count == dst:
                pulls[-1] = HeadPull(src_rank, last.src_head, last.dst_head, last.count + 1)
            else:
                pulls.append(HeadPull(src_rank, src, dst, 1))
        plan.append(pulls)
    return plan


@dataclass(frozen=True)
class TPKVInfo:
    """What a TP worker's handshake adds to its PeerInfo: its TP size, the KV heads of each
    rank's cache, and whether heads are outermost inside a block (slices need it)."""

    tp_size: int
    num_kv_heads: int
    head_map: tuple[tuple[int, int], ...]  # per rank: (first global KV head, count)
    heads_outer: bool  # block layout [Hkv_local, layers, 2, block_size, head_dim]
    version: int = TP_MAP_VERSION

    @classmethod
    def of(cls, num_heads: int, num_kv_heads: int, tp: int, heads_outer: bool = True) -> TPKVInfo:
        split = HeadSplit(num_heads, num_kv_heads, tp)
        return cls(tp, num_kv_heads, tuple(split.head_map()), heads_outer)

    def to_dict(self) -> dict:
        return {"tp_size": self.tp_size, "num_kv_heads": self.num_kv_heads,
                "head_map": [list(h) for h in self.head_map], "heads_outer": self.heads_outer,
                "version": self.version}

    @classmethod
    def from_dict(cls, d: object) -> TPKVInfo:
        """Strict: every problem names its field (tp.<name>)."""
        if not isinstance(d, dict):
            raise ConfigError(f"tp: expected an object, got {type(d).__name__}")
        for name, typ in (("tp_size", int), ("num_kv_heads", int), ("head_map", list),
                          ("heads_outer", bool), ("version", int)):
            if name not in d:
                raise ConfigError(f"tp.{name}: missing")
            if not isinstance(d[name], typ) or (typ is int and isinstance(d[name], bool)):
                raise ConfigError(f"tp.{name}: expected {typ.__name__}, got {d[name]!r}")
        if d["version"] != TP_MAP_VERSION:
            raise ConfigError(f"tp.version: {d['version']} != {TP_MAP_VERSION}")
        pairs = []
        for i, h in enumerate(d["head_map"]):
            if not (isinstance(h, list) and len(h) == 2 and all(
                    isinstance(v, int) and not isinstance(v, bool) for v in h)):
                raise ConfigError(f"tp.head_map[{i}]: expected [first, count], got {h!r}")
            pairs.append((h[0], h[1]))
        return cls(d["tp_size"], d["num_kv_heads"], tuple(pairs), d["heads_outer"], d["version"])


def tp_pair_problems(prefill: TPKVInfo, decode: TPKVInfo) -> list[str]:
    """Why decode ranks cannot pull their heads from these prefill ranks ([] = they can).
    Each problem names its field; the handshake raises them as one refusal."""
    problems: list[str] = []
    if prefill.num_kv_heads != decode.num_kv_heads:
        return [f"tp.num_kv_heads: {decode.num_kv_heads} != {prefill.num_kv_heads}"]
    for side, info in (("prefill", prefill), ("decode", decode)):
        try:
            want = HeadSplit(info.num_kv_heads * info.tp_size, info.num_kv_heads,
                             info.tp_size).head_map()
        except ConfigError as e:
            problems.append(f"tp.tp_size ({side}): {e}")
            continue
        if list(info.head_map) != want:
            problems.append(f"tp.head_map ({side}): {list(info.head_map)} is not the split of "
                            f"{info.num_kv_heads} KV heads over {info.tp_size} ranks {want}")
    if problems:
        return problems
    whole = all(len(pulls) == 1 and pulls[0].count == decode.head_map[r][1]
                == prefill.head_map[pulls[0].src_rank][1]
                for r, pulls in enumerate(pull_plan(decode.num_kv_heads, prefill.tp_size,
                                                    decode.tp_size)))
    if not whole:
        for side, info in (("prefill", prefill), ("decode", decode)):
            if not info.heads_outer:
                problems.append(f"tp.heads_outer ({side}): head slices of a block need the "
                                f"heads-outer block layout, this side keeps heads inner")
    return problems


def slice_ranges(pull: HeadPull, pairs: list[tuple[int, int]], src_heads: int, dst_heads: int,
                 head_bytes: int) -> list[tuple[int, int, int]]:
    """Byte ranges (src offset, dst offset, length) of one HeadPull over (remote block, local
    block) pairs, in heads-outer layout (a block = heads x head_bytes, head_bytes covering
    all layers, K and V of one head, plus its FP8 scales). Adjacent ranges that continue on
    both sides merge: whole-block pulls of a run of consecutive blocks are one range, a head
    slice is one range per block."""
    src_block, dst_block = src_heads * head_bytes, dst_heads * head_bytes
    length = pull.count * head_bytes
    out: list[tuple[int, int, int]] = []
    for remote, local in pairs:
        s = remote * src_block + pull.src_head * head_bytes
        d = local * dst_block + pull.dst_head * head_bytes
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + length)
        else:
            out.append((s, d, length))
    return out

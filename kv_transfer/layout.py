"""KV block layout as the transfer layer sees it, and coalescing of block runs.

The engine keeps one KV tensor per worker (per TP rank), engine/exec/kv_cache.py. Layout
version 2 (heads outermost inside a block, `heads_outer`):
    kv_cache: [num_blocks, num_kv_heads, num_kv_layers, 2, block_size, head_dim]
version 1 (heads inner): [num_blocks, num_kv_layers, 2, block_size, num_kv_heads, head_dim].
An FP8 cache has e4m3 values and trailing layers that hold the scales, counted in
num_kv_layers (in version 2 each head's own scales, inside that head's region). Block b (all
layers, K and V, scales) is the single contiguous byte range
    [base + b * block_bytes, base + (b + 1) * block_bytes),
and with heads outer, head h of block b is the range of head_bytes at
b * block_bytes + h * head_bytes (what a decode rank of another TP size pulls).
A transfer is a list of (local block, remote block) pairs. Pairs in which BOTH ids advance
by one form a run that moves as one NIXL descriptor; the measured cost is ~8 us per
descriptor (DESIGN.md), so fewer, larger descriptors are what make transfers fast.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import NamedTuple

import numpy as np
import torch

KV_CACHE_NDIM = 6


@dataclass(frozen=True)
class KVLayout:
    """Shape of one worker's KV cache tensor; `num_blocks` may differ between peers."""

    num_blocks: int
    num_kv_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    element_size: int  # bytes per element
    heads_outer: bool = False  # [NB, heads, layers, 2, BS, D] (layout version 2)

    def __post_init__(self) -> None:
        for name in ("num_blocks", "num_kv_layers", "block_size", "num_kv_heads", "head_dim",
                     "element_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}: must be a positive int, got {value!r}")
        if not isinstance(self.dtype, str) or not self.dtype:
            raise ValueError(f"dtype: must be a non-empty str, got {self.dtype!r}")
        if not isinstance(self.heads_outer, bool):
            raise ValueError(f"heads_outer: must be a bool, got {self.heads_outer!r}")

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: all layers, K and V."""
        return (self.num_kv_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
                * self.element_size)

    @property
    def head_bytes(self) -> int:
        """Bytes of one KV head of a block (all layers, K and V, its scales): one contiguous
        range only with heads outer."""
        return self.block_bytes // self.num_kv_heads

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @classmethod
    def from_cache(cls, kv_cache: torch.Tensor, heads_outer: bool = False) -> KVLayout:
        """Layout of an engine KV tensor; refuses shapes whose blocks are not contiguous."""
        dims = ("num_blocks, num_kv_heads, num_kv_layers, 2, block_size, head_dim" if heads_outer
                else "num_blocks, num_kv_layers, 2, block_size, num_kv_heads, head_dim")
        if kv_cache.dim() != KV_CACHE_NDIM:
            raise ValueError(f"kv_cache: expected {KV_CACHE_NDIM} dims [{dims}], got shape "
                             f"{tuple(kv_cache.shape)}")
        kv_dim = 3 if heads_outer else 2
        if kv_cache.shape[kv_dim] != 2:
            raise ValueError(f"kv_cache: dim {kv_dim} (K/V) must be 2 in [{dims}], got "
                             f"{kv_cache.shape[kv_dim]}")
        if not kv_cache.is_contiguous():
            raise ValueError("kv_cache: must be contiguous (one block = one byte range)")
        if heads_outer:
            nb, nh, nl, _, bs, hd = (int(s) for s in kv_cache.shape)
        else:
            nb, nl, _, bs, nh, hd = (int(s) for s in kv_cache.shape)
        return cls(num_blocks=nb, num_kv_layers=nl, block_size=bs, num_kv_heads=nh,
                   head_dim=hd, dtype=str(kv_cache.dtype).removeprefix("torch."),
                   element_size=int(kv_cache.element_size()), heads_outer=heads_outer)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> KVLayout:
        if not isinstance(d, dict):
            raise ValueError(f"layout: expected an object, got {type(d).__name__}")
        missing = [f for f in cls.__dataclass_fields__ if f not in d]
        if missing:
            raise ValueError(f"layout.{missing[0]}: missing")
        return cls(**{f: d[f] for f in cls.__dataclass_fields__})

    def mismatch(self, other: KVLayout, ignore: tuple[str, ...] = ()) -> list[str]:
        """Fields (other than num_blocks and `ignore`) that differ: such blocks mean different
        things (a TP pair ignores num_kv_heads, which is per rank: its TP maps decide)."""
        out = []
        for name in self.__dataclass_fields__:
            if name == "num_blocks" or name in ignore:
                continue
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                out.append(f"layout.{name}: {a!r} != {b!r}")
        return out


class Run(NamedTuple):
    """`count` blocks starting at `local_start` here and `remote_start` on the peer."""

    local_start: int
    remote_start: int
    count: int


def _run_cap(max_blocks: int | None) -> int:
    if max_blocks is None:
        return 1 << 62
    if max_blocks < 1:
        raise ValueError(f"max_blocks: must be >= 1, got {max_blocks}")
    return max_blocks


def coalesce(block_ids: Sequence[int], max_blocks: int | None = None) -> list[tuple[int, int]]:
    """Runs of consecutive ids, in order: [3, 4, 5, 9, 10] -> [(3, 3), (9, 2)]."""
    return [(r.local_start, r.count) for r in coalesce_pairs(block_ids, block_ids, max_blocks)]


def coalesce_pairs(local_ids: Sequence[int], remote_ids: Sequence[int],
                   max_blocks: int | None = None) -> list[Run]:
    """Group (local_i, remote_i) pairs into runs where both sides advance by exactly one.

    Order is kept (pair i lands in run k before pair i+1), so a run is one descriptor pair.
    `max_blocks` caps a run's length (a descriptor-size cap); None = unbounded.
    """
    if len(local_ids) != len(remote_ids):
        raise ValueError(f"local_block_ids: {len(local_ids)} ids but remote_block_ids has "
                         f"{len(remote_ids)}")
    cap = _run_cap(max_blocks)
    runs: list[Run] = []
    for loc, rem in zip(local_ids, remote_ids):
        if runs:
            last = runs[-1]
            if (last.count < cap and loc == last.local_start + last.count
                    and rem == last.remote_start + last.count):
                runs[-1] = Run(last.local_start, last.remote_start, last.count + 1)
                continue
        runs.append(Run(int(loc), int(rem), 1))
    return runs


def run_descriptors(base_addr: int, block_bytes: int, starts: Sequence[int],
                    counts: Sequence[int], device_id: int) -> np.ndarray:
    """NIXL Nx3 descriptor array (address, length, device id), uint64, one row per run."""
    starts_a = np.asarray(starts, dtype=np.uint64)
    out = np.empty((len(starts_a), 3), dtype=np.uint64)
    out[:, 0] = np.uint64(base_addr) + starts_a * np.uint64(block_bytes)
    out[:, 1] = np.asarray(counts, dtype=np.uint64) * np.uint64(block_bytes)
    out[:, 2] = np.uint64(device_id)
    return out


def block_descriptors(base_addr: int, layout: KVLayout, device_id: int) -> np.ndarray:
    """One descriptor per block of the whole pool (for NIXL's prepared descriptor lists)."""
    n = layout.num_blocks
    return run_descriptors(base_addr, layout.block_bytes, np.arange(n), np.ones(n), device_id)


def blocks_per_descriptor(layout: KVLayout, mode: str, max_bytes: int | None) -> int | None:
    """The most whole blocks one descriptor may cover under `max_bytes` (None: no cap)."""
    if max_bytes is None:
        return None
    if mode == "prepped":
        raise ValueError("max_descriptor_bytes: only supported with descriptor_mode="
                         "'coalesced' (NIXL merges prepped descriptors itself)")
    if max_bytes < layout.block_bytes:
        raise ValueError(f"max_descriptor_bytes: {max_bytes} is below one block "
                         f"({layout.block_bytes} bytes)")
    return max_bytes // layout.block_bytes


def check_block_ids(local: Sequence[int], remote: Sequence[int], local_num_blocks: int,
                    remote_num_blocks: int) -> tuple[list[int], list[int]]:
    """The (local, remote) id pairs of one read as ints, checked: same length, inside each
    pool, no local block twice (two writes into one block). ValueError names the argument."""
    local_ids, remote_ids = [int(b) for b in local], [int(b) for b in remote]
    if len(local_ids) != len(remote_ids):
        raise ValueError(f"local_block_ids: {len(local_ids)} ids for "
                         f"{len(remote_ids)} remote_block_ids")
    for name, ids, n in (("local_block_ids", local_ids, local_num_blocks),
                         ("remote_block_ids", remote_ids, remote_num_blocks)):
        for i, b in enumerate(ids):
            if not 0 <= b < n:
                raise ValueError(f"{name}[{i}]: block {b} outside [0, {n})")
    if len(set(local_ids)) != len(local_ids):
        raise ValueError("local_block_ids: a local block appears twice")
    return local_ids, remote_ids

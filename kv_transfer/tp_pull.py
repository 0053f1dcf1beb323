"""What one rank of a decode worker reads from a prefill worker's ranks, as byte ranges.

pull_plan (engine/core/tp.py) gives, per decode rank, the head slices it reads and from which
prefill rank. For one read (remote block ids -> local block ids) each source rank's slices
become (remote offset, local offset, length) byte ranges from the two KV tensors' bases:
  * whole blocks (same heads on both sides, rank r <- rank r at equal TP): runs of blocks
    where both ids advance by one, one range per run (coalesce_pairs), as at TP 1;
  * head slices (heads-outer layouts only): one range per block per HeadPull (slice_ranges),
    merged where consecutive on both sides.
One source rank = one NIXL transfer handle; a read posts them all, then waits.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdserve.engine.core.tp import HeadPull, TPKVInfo, pull_plan, slice_ranges

from .handshake import PeerInfo, RankEndpoint
from .layout import KVLayout, coalesce_pairs


@dataclass(frozen=True)
class SourcePull:
    """The head slices this rank reads from prefill rank `src_rank` (at `endpoint`)."""

    src_rank: int
    endpoint: RankEndpoint
    pulls: tuple[HeadPull, ...]
    src_heads: int  # KV heads in the source rank's blocks
    whole: bool  # all heads of both blocks: whole-block runs

    @property
    def agent_name(self) -> str:
        return self.endpoint.agent_name


def rank_sources(remote: PeerInfo, local_tp: TPKVInfo, rank: int) -> list[SourcePull]:
    """This decode rank's row of the pull plan, grouped by source rank (ascending). The pair
    must have passed check_compatible (tp_pair_problems) first."""
    rtp = remote.tp_info
    row = pull_plan(local_tp.num_kv_heads, rtp.tp_size, local_tp.tp_size)[rank]
    local_heads = local_tp.head_map[rank][1]
    by_src: dict[int, list[HeadPull]] = {}
    for p in row:
        by_src.setdefault(p.src_rank, []).append(p)
    out = []
    for src, pulls in sorted(by_src.items()):
        src_heads = rtp.head_map[src][1]
        whole = (len(pulls) == 1 and pulls[0].count == local_heads == src_heads)
        out.append(SourcePull(src, remote.ranks[src], tuple(pulls), src_heads, whole))
    return out


def byte_ranges(src: SourcePull, local_ids: list[int], remote_ids: list[int],
                layout: KVLayout, max_blocks: int | None = None) -> np.ndarray:
    """[n, 3] int64 (remote offset, local offset, length) of one source rank's part of a read.
    `layout` is this rank's (head_bytes is the same on both sides: layouts agree but for the
    head count). max_blocks caps whole-block runs (a descriptor-size cap)."""
    if src.whole:
        bb = layout.block_bytes
        runs = coalesce_pairs(local_ids, remote_ids, max_blocks)
        return np.array([(r.remote_start * bb, r.local_start * bb, r.count * bb) for r in runs],
                        dtype=np.int64).reshape(-1, 3)
    pairs = list(zip(remote_ids, local_ids))
    ranges = [r for p in src.pulls
              for r in slice_ranges(p, pairs, src.src_heads, layout.num_kv_heads,
                                    layout.head_bytes)]
    return np.array(ranges, dtype=np.int64).reshape(-1, 3)


def descriptors(base_addr: int, offsets: np.ndarray, lengths: np.ndarray,
                device_id: int) -> np.ndarray:
    """NIXL Nx3 descriptor array (address, length, device id), uint64."""
    out = np.empty((len(offsets), 3), dtype=np.uint64)
    out[:, 0] = np.uint64(base_addr) + offsets.astype(np.uint64)
    out[:, 1] = lengths.astype(np.uint64)
    out[:, 2] = np.uint64(device_id)
    return out

"""Errors and per-read statistics of the KV transfer layer (no NIXL import here)."""
from __future__ import annotations

from dataclasses import dataclass


class KVTransferError(RuntimeError):
    """A KV read failed; `__cause__` holds the underlying error."""


class KVTransferTimeout(KVTransferError):
    """A KV read did not complete by its deadline.

    local_blocks_safe is False when NIXL could not abort the transfer: the destination
    blocks may still be written later, so the caller must not reuse them until close().
    """

    def __init__(self, message: str, local_blocks_safe: bool = True) -> None:
        super().__init__(message)
        self.local_blocks_safe = local_blocks_safe


class StalePeerError(KVTransferError):
    """The handle names an incarnation of the peer that has been replaced or removed."""


class UnknownPeerError(KVTransferError):
    """No peer with this worker id was added."""


@dataclass(frozen=True)
class TransferStats:
    bytes: int
    seconds: float
    descriptors: int  # as NIXL counted them (telemetry), else the number of runs
    blocks: int

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

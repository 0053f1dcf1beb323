"""Fault injection for KV transfer and lease release, switched on from worker config.

Faults exercise the paths real deployments hit (ANCHORS #1, #2, #6): a transfer that fails,
a transfer slower than its deadline, a release message that never arrives. The config is
frozen; the injector keeps thread-safe counters so tests can assert exactly what fired.

    FaultInjector(FaultConfig(fail_nth=3))         # the 3rd transfer fails, no other
    FaultInjector(FaultConfig(fail_every=2))       # transfers 2, 4, 6, ... fail
    FaultInjector(FaultConfig(fail_prob=0.1, seed=7))
    FaultInjector(FaultConfig(delay_s=0.5))        # every transfer completes >= 0.5 s late
    FaultInjector(FaultConfig(drop_release_prob=1.0))  # every lease release is swallowed
    FaultInjector(FaultConfig(stall_loop_s=30))    # the engine loop stops once for 30 s
                                                   # with requests in it (a hung device)
"""
from __future__ import annotations

import math
import random
import threading
from dataclasses import dataclass, fields


class InjectedFault(RuntimeError):
    """The cause attached to an error that a FaultInjector produced on purpose."""


@dataclass(frozen=True)
class FaultConfig:
    fail_nth: int = 0  # fail exactly the Nth transfer (1-based); 0 = off
    fail_every: int = 0  # fail every Nth transfer; 0 = off
    fail_prob: float = 0.0  # fail each transfer with this probability (seeded)
    seed: int = 0
    delay_s: float = 0.0  # each transfer completes no earlier than this after it is posted
    drop_release_prob: float = 0.0  # swallow lease releases with this probability
    stall_loop_s: float = 0.0  # the worker's engine loop stops once this long, with work in it

    def __post_init__(self) -> None:
        for name in ("fail_nth", "fail_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}: must be an int >= 0, got {value!r}")
        for name in ("fail_prob", "drop_release_prob"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ValueError(f"{name}: must be in [0, 1], got {value!r}")
        for name in ("delay_s", "stall_loop_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) \
                    or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")

    @classmethod
    def from_dict(cls, d: dict | None) -> FaultConfig:
        """From a worker config section; unknown keys are errors that name the key."""
        d = d or {}
        known = {f.name for f in fields(cls)}
        for key in d:
            if key not in known:
                raise ValueError(f"faults.{key}: unknown fault switch (known: {sorted(known)})")
        return cls(**d)

    @property
    def enabled(self) -> bool:
        return bool(self.fail_nth or self.fail_every or self.fail_prob or self.delay_s
                    or self.drop_release_prob or self.stall_loop_s)


@dataclass(frozen=True)
class TransferFault:
    """What to do to one transfer: `number` is its 1-based sequence number."""

    number: int
    fail: bool
    delay_s: float


class FaultInjector:
    """Decides, per call and thread-safely, which fault hits a transfer or a release."""

    def __init__(self, config: FaultConfig | None = None) -> None:
        self.config = config or FaultConfig()
        self._lock = threading.Lock()
        self._rng = random.Random(self.config.seed)
        self.transfers = 0  # transfers seen
        self.failed = 0  # transfers failed on purpose
        self.delayed = 0  # transfers delayed
        self.releases = 0  # releases seen
        self.dropped_releases = 0  # releases swallowed
        self.loop_stalls = 0  # engine-loop stalls taken (stall_loop_s; at most one)

    def on_transfer(self) -> TransferFault:
        c = self.config
        with self._lock:
            self.transfers += 1
            n = self.transfers
            fail = (n == c.fail_nth) or (c.fail_every > 0 and n % c.fail_every == 0)
            if c.fail_prob > 0 and self._rng.random() < c.fail_prob:
                fail = True
            self.failed += fail
            self.delayed += c.delay_s > 0
        return TransferFault(number=n, fail=fail, delay_s=float(c.delay_s))

    def drop_release(self) -> bool:
        """True when this release must be swallowed (as if the message were lost)."""
        with self._lock:
            self.releases += 1
            drop = (self.config.drop_release_prob > 0
                    and self._rng.random() < self.config.drop_release_prob)
            self.dropped_releases += drop
        return drop

    def take_loop_stall(self) -> float:
        """Seconds the engine loop must stop now: stall_loop_s the first time, then 0."""
        with self._lock:
            if not self.config.stall_loop_s or self.loop_stalls:
                return 0.0
            self.loop_stalls += 1
        return float(self.config.stall_loop_s)

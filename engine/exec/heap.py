"""The start-up heap out of the garbage collector's way, in the processes pdserve owns.

A serving process holds millions of long-lived objects once it is up: torch, Triton's
compiled kernels, the model's modules, the CUDA graphs' Python side. Python's oldest
generation is collected by scanning all of them: in bench_tp's batch-1 decode of a Qwen3-8B
shape on an H200 the collector spent 190-215 ms in 15-32 collections of 128 steps
(bench/results/tp_h200x2_2026-11-29_peer.json, decode_batch1.gc), and a full collection's
pause lands in whichever decode step triggers it: one likely source of the 236-435 ms worst
inter-token gaps of the disaggregated decode worker (payoff_h200x2_2026-11-29.json).
gc.freeze() moves every object alive now to a permanent generation the collector never
scans; objects made later are collected as before (vLLM freezes its engine process alike).

Only entry points of processes pdserve owns call it (worker actors, follower ranks), once
serving: in a user's process (the offline LLM) it would keep that process's own cyclic
garbage of the moment forever.
"""
from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect what is garbage now, then freeze the rest; returns the frozen objects' count."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("start-up heap frozen: %d objects out of the garbage collector's scans", frozen)
    return frozen

"""Run a function on N real ranks: N spawned processes joined by a gloo TPGroup on loopback,
each with a deadline; a paged-KV greedy driver for the sharded model tests."""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import queue
import socket
import time
import traceback
from collections.abc import Callable

import torch

from pdserve.engine.core.config import ModelConfig
from pdserve.engine.dist.config import GRAPH_ALL_REDUCE_BYTES, ParallelConfig
from pdserve.engine.dist.group import TPGroup
from pdserve.engine.dist.steps import greedy_batch, host_batch
from pdserve.engine.exec.kv_cache import allocate_kv_cache
from pdserve.engine.model.attention import HostBatch
from pdserve.kernels.triton_mode import select_triton_mode

BLOCK = 4
BLOCKS_PER_SEQ = 12


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable, rank: int, tp: int, port: int, timeout_s: float, args: tuple,
           out: mp.Queue, cuda: bool, late_s: float) -> None:
    torch.set_num_threads(1)
    if rank == tp - 1:
        time.sleep(late_s)  # a rank that loads slower joins later
    select_triton_mode()  # an entry point: kernels interpreted on CPU (the GEMV path)
    try:
        address = f"tcp://127.0.0.1:{port}"
        # on CUDA the group captures graphs' all-reduces through peer memory, as the offline
        # engine's with use_cuda_graphs
        cfg = dataclasses.replace(ParallelConfig.for_device(tp, rank, address, f"cuda:{rank}",
                                                            timeout_s),
                                  peer_all_reduce_bytes=GRAPH_ALL_REDUCE_BYTES) if cuda \
            else ParallelConfig(tp, rank, "gloo", address, timeout_s)
        group = TPGroup(cfg)
        try:
            out.put((rank, "ok", fn(group, *args)))
        finally:
            group.close()
    except BaseException as e:  # noqa: BLE001 - reported to the test, which fails on it
        out.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_ranks(fn: Callable, tp: int, *args: object, timeout_s: float = 20.0,
              deadline_s: float = 240.0, cuda: bool = False,
              late_s: float = 0.0) -> dict[int, object]:
    """fn(group, *args) on ranks 0..tp-1 -> {rank: result or ("error", text)}. Every rank
    reports within deadline_s or the test fails; leftover processes are ended. cuda: rank r
    on cuda:r with NCCL (ParallelConfig.for_device), else gloo on CPU. late_s: the last rank
    starts joining that much later."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, tp, port, timeout_s, args, out, cuda,
                                              late_s), daemon=True) for r in range(tp)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    try:
        for _ in range(tp):
            rank, status, value = out.get(timeout=deadline_s)
            results[rank] = value if status == "ok" else ("error", value)
    except queue.Empty:
        raise AssertionError(f"ranks {sorted(set(range(tp)) - set(results))} did not report "
                             f"within {deadline_s} s") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return results


def batch(seqs: list[list[int]], starts: list[int]) -> HostBatch:
    return host_batch(seqs, starts, BLOCK, BLOCKS_PER_SEQ)


def kv_cache(cfg: ModelConfig, num_seqs: int) -> torch.Tensor:
    return allocate_kv_cache(cfg, num_seqs * BLOCKS_PER_SEQ, BLOCK, torch.float32, "cpu")


def greedy_loop(step: Callable[[HostBatch, list[int]], torch.Tensor],
                prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    return greedy_batch(step, prompts, new_tokens, BLOCK, BLOCKS_PER_SEQ)

"""A KV peer in its own process (multiprocessing "spawn"), driven over a Pipe by the tests.

The pipe is the test harness's private channel; KV bytes move over NIXL/UCX only.
"""
from __future__ import annotations

import multiprocessing as mp
from typing import Any

SHAPE = (64, 2, 3, 2, 4, 8)  # [num_blocks, kv_heads, num_kv_layers, 2, block_size, head_dim]


def serve(conn: Any, worker_id: str, shape: tuple, compat: dict, device: str) -> None:
    import torch
    from prometheus_client import CollectorRegistry

    from pdserve.kv_transfer import NixlKVTransport
    from pdserve.kv_transfer.metrics import kv_metrics

    def start() -> tuple[torch.Tensor, NixlKVTransport]:
        kv = torch.zeros(shape, dtype=torch.float32, device=device)
        metrics = kv_metrics(CollectorRegistry()).bind("prefill", worker_id)
        return kv, NixlKVTransport(kv, worker_id, compat, role="prefill", metrics=metrics)

    kv, transport = start()
    conn.send(transport.peer_info().to_bytes())
    while conn.poll(300):  # the parent vanished if nothing comes for this long
        cmd, args = conn.recv()
        if cmd == "fill":  # random data into blocks; reply with their bytes
            block_ids, seed = args
            gen = torch.Generator().manual_seed(seed)
            for b in block_ids:
                kv[b] = torch.randn(kv[b].shape, generator=gen).to(device)
            conn.send([kv[b].cpu().numpy().tobytes() for b in block_ids])
        elif cmd == "restart_transport":  # same process, new incarnation and memory
            transport.close()
            kv, transport = start()
            conn.send(transport.peer_info().to_bytes())
        elif cmd == "stop":
            transport.close()
            conn.send("stopped")
            return


class SpawnedProc:
    """A spawned process that answers commands over a pipe (its first message: the peer's
    PeerInfo bytes); every wait has a timeout."""

    what = "process"

    def __init__(self, target: Any, args: tuple, timeout_s: float) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()
        child.close()
        self.info_bytes: bytes = self._recv(timeout_s)

    def _recv(self, timeout_s: float) -> Any:
        if not self.conn.poll(timeout_s):
            self.kill()
            raise TimeoutError(f"{self.what} gave no answer in {timeout_s} s")
        return self.conn.recv()

    def call(self, cmd: str, *args: Any, timeout_s: float = 60) -> Any:
        self.conn.send((cmd, args))
        return self._recv(timeout_s)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("stop", timeout_s=30)
            except (TimeoutError, OSError, EOFError):
                pass
        self.kill()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=30)


class PeerProc(SpawnedProc):
    """Handle on a spawned peer (one transport over one cache)."""

    what = "peer process"

    def __init__(self, worker_id: str, compat: dict, shape: tuple = SHAPE,
                 timeout_s: float = 120, device: str = "cpu") -> None:
        super().__init__(serve, (worker_id, shape, compat, device), timeout_s)

"""Test helpers: run a router stack on a background event loop; start `pdserve serve`."""
from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import httpx

REPO = pathlib.Path(__file__).resolve().parents[2]


class RouterThread:
    """start_stack(...) on its own event loop in a daemon thread (real HTTP + gRPC ports)."""

    def __init__(self, refs: list, frontend, cfg, api_key: str | None = None,
                 max_body_bytes: int = 1 << 20) -> None:
        from pdserve.router.launch import start_stack

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.stack = self.call(start_stack(refs, frontend, cfg, port=0, grpc_port=0,
                                           api_key=api_key, capacity=32, startup_timeout_s=30,
                                           max_body_bytes=max_body_bytes))
        self.url = f"http://127.0.0.1:{self.stack.http_port}"
        self.grpc_address = f"127.0.0.1:{self.stack.grpc_port}"

    @property
    def core(self):
        return self.stack.core

    def call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        from pdserve.router.launch import stop_stack

        self.call(stop_stack(self.stack, drain_timeout_s=5, shutdown_workers=False))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(cond, timeout: float, what, interval: float = 0.1):
    """Poll cond() until truthy; `what` (a string or a callable giving one) explains a timeout."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what() if callable(what) else what}")


class ServeProcess:
    """`pdserve serve` as a subprocess (its own Ray instance), stopped with SIGTERM."""

    def __init__(self, args: Sequence[str], api_key: str | None = None,
                 startup_timeout: float = 900) -> None:
        self.port, self.grpc_port = free_port(), free_port()
        self.api_key = api_key
        cmd = [sys.executable, "-m", "pdserve.router.cli", "serve", "--port", str(self.port),
               "--grpc-port", str(self.grpc_port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        self.log_path = REPO / ".pytest_cache" / f"serve-{self.port}.log"
        self.log_path.parent.mkdir(exist_ok=True)
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        self.grpc_address = f"127.0.0.1:{self.grpc_port}"
        try:
            wait_until(self._ready, startup_timeout, "pdserve serve to print 'ready'", 0.5)
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"pdserve serve exited with {self.proc.returncode}:\n{self.output()}")
        return "pdserve: ready" in self.output()

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def stop(self, timeout: float = 90) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode

"""Test helpers: run a router stack on a background event loop (alone, or in front of real
in-process workers: inproc_stack); start `pdserve serve`."""
from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence

import httpx

REPO = pathlib.Path(__file__).resolve().parents[2]


class RouterThread:
    """start_stack(...) on its own event loop in a daemon thread (real HTTP + gRPC ports)."""

    def __init__(self, refs: list, frontend, cfg, api_key: str | None = None,
                 max_body_bytes: int = 1 << 20) -> None:
        from pdserve.router.launch import start_stack

        from tests.cluster_secret import SECRET

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.stack = self.call(start_stack(refs, frontend, cfg, cluster_secret=SECRET,
                                           port=0, grpc_port=0,
                                           api_key=api_key, capacity=32, startup_timeout_s=30,
                                           max_body_bytes=max_body_bytes))
        self.url = f"http://127.0.0.1:{self.stack.http_port}"
        self.grpc_address = f"127.0.0.1:{self.stack.grpc_port}"

    @property
    def core(self):
        return self.stack.core

    def call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call_soon(self, coro):
        """coro on the router's loop, without waiting: its concurrent.futures.Future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        from pdserve.router.launch import stop_stack

        self.call(stop_stack(self.stack, drain_timeout_s=5, shutdown_workers=False))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@contextlib.contextmanager
def inproc_stack(frontend, roles: dict[str, str], cfg, num_blocks: int,
                 faults: dict | None = None) -> Iterator[tuple[RouterThread, dict]]:
    """A real router (cfg: RouterConfig) in front of real workers in this process: tiny Qwen3
    engines on CPU with 4-token blocks, gRPC on loopback, the in-process KV transport.
    roles: worker id -> role; faults: worker id -> FaultConfig. Yields (router, {id: Worker});
    stops them all on exit."""
    from pdserve.engine.llm import build_engine
    from pdserve.router.worker_refs import StaticWorkerRef
    from pdserve.worker.config import WorkerConfig
    from pdserve.worker.server import Worker

    from tests.cluster_secret import SECRET

    extra = {wid: {"faults": f} for wid, f in (faults or {}).items()}
    workers = {wid: Worker(WorkerConfig(role=role, worker_id=wid, cluster_secret=SECRET,
                                        metrics_port=-1, kv_transport="inproc",
                                        **extra.get(wid, {})),
                           engine=build_engine("tiny-qwen3", device="cpu", block_size=4,
                                               num_blocks=num_blocks)).start()
               for wid, role in roles.items()}
    for w in workers.values():
        if w.cfg.role == "prefill":  # as build_worker_engine does for prefill
            w.rt.engine.keep_hidden = True
    refs = [StaticWorkerRef(wid, w.cfg.role, w.address, incarnation=w.rt.incarnation)
            for wid, w in workers.items()]
    rt = RouterThread(refs, frontend, cfg)
    try:
        yield rt, workers
    finally:
        rt.stop()
        for w in workers.values():
            w.stop()


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
    """`pdserve serve` as a subprocess (its own Ray instance), stopped with SIGTERM.

    Its ports are picked free here but bound by serve only after its workers start, and a
    worker's own servers (gRPC, metrics on port 0) may take one of them first: serve then
    exits with "address already in use", and it is started again on fresh ports."""

    ATTEMPTS = 3

    def __init__(self, args: Sequence[str], api_key: str | None = None,
                 startup_timeout: float = 900, cluster_secret: str | None = None) -> None:
        self.api_key = api_key
        for attempt in range(self.ATTEMPTS):
            self._start(args, cluster_secret)
            try:
                wait_until(self._ready, startup_timeout, "pdserve serve to print 'ready'", 0.5)
                return
            except BaseException:
                self.stop()
                # uvicorn says "address already in use", gRPC "Address already in use"
                if attempt + 1 == self.ATTEMPTS or \
                        "address already in use" not in self.output().lower():
                    raise

    def _start(self, args: Sequence[str], cluster_secret: str | None) -> None:
        self.port, self.grpc_port = free_port(), free_port()
        cmd = [sys.executable, "-m", "pdserve.router.cli", "serve", "--port", str(self.port),
               "--grpc-port", str(self.grpc_port), *args]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        if cluster_secret:  # else serve makes its own, which the test never learns
            path = REPO / ".pytest_cache" / f"secret-{self.port}"
            path.parent.mkdir(exist_ok=True)
            path.write_text(cluster_secret + "\n")
            path.chmod(0o600)
            cmd += ["--cluster-secret-file", str(path)]
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        self.log_path = REPO / ".pytest_cache" / f"serve-{self.port}.log"
        self.log_path.parent.mkdir(exist_ok=True)
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        self.grpc_address = f"127.0.0.1:{self.grpc_port}"

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


def pid_listening_on(address: str) -> int:
    """The process that listens on host:port (a worker's gRPC address, say)."""
    import psutil

    port = int(address.rsplit(":", 1)[1])
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return conn.pid
    raise AssertionError(f"no process listens on {address}")


def listeners_of(pid: int) -> list[str]:
    """Local addresses (host:port) of the TCP/UDP sockets `pid` listens on, as `ss` shows them."""
    out = subprocess.run(["ss", "-H", "-l", "-n", "-t", "-u", "-p"], capture_output=True,
                         text=True, timeout=30, check=True).stdout
    addrs = [line.split()[4] for line in out.splitlines() if f"pid={pid}," in line]
    # an IPv4 address on a dual-stack socket shows as [::ffff:a.b.c.d]:port
    return [re.sub(r"^\[::ffff:([\d.]+)\]", r"\1", a) for a in addrs]


def worker_rpcs_refused(address: str, metadata: tuple = ()) -> dict[str, str]:
    """Call every Worker RPC at `address` with `metadata` (no cluster secret); the status
    code name each one got."""
    import grpc

    from pdserve.proto import pdserve_pb2 as pb
    from pdserve.proto import pdserve_pb2_grpc as pbg
    from pdserve.proto.rpc import make_channel

    prompt = [1, 2, 3, 4]
    calls = {
        "Prefill": lambda s: s.Prefill(pb.PrefillRequest(request_id="x", prompt_token_ids=prompt),
                                       metadata=metadata, timeout=10),
        "Decode": lambda s: list(s.Decode(pb.DecodeRequest(request_id="x", prompt_token_ids=prompt),
                                          metadata=metadata, timeout=10)),
        "GetPeerInfo": lambda s: s.GetPeerInfo(pb.GetPeerInfoRequest(), metadata=metadata,
                                               timeout=10),
        "AddPeer": lambda s: s.AddPeer(pb.PeerInfo(worker_id="evil"), metadata=metadata, timeout=10),
        "Release": lambda s: s.Release(pb.ReleaseRequest(request_id="x"), metadata=metadata,
                                       timeout=10),
        "Abort": lambda s: s.Abort(pb.AbortRequest(request_id="x"), metadata=metadata, timeout=10),
        "Health": lambda s: s.Health(pb.HealthRequest(), metadata=metadata, timeout=10),
    }
    codes = {}
    with make_channel(address) as ch:
        stub = pbg.WorkerStub(ch)
        for name, call in calls.items():
            try:
                call(stub)
                codes[name] = "OK"
            except grpc.RpcError as e:
                codes[name] = e.code().name
    return codes


def sample_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples named exactly `name` in Prometheus text whose label sets carry
    `labels`."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.M):
        if all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def metric_sum(address: str, name: str) -> float:
    """Sum of pdserve:<name> over its label sets on a /metrics endpoint at host:port."""
    return sample_sum(httpx.get(f"http://{address}/metrics", timeout=10).text, f"pdserve:{name}")

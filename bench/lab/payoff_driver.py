"""bench_payoff's plumbing: the cluster subprocess, environment, run header and JSON writing.

The cluster (Ray + workers + router, bench/lab/payoff_cluster.py) runs in its own process so the
load generator's event loop never shares a GIL with the router it measures. It is started in
its own session; every wait on it has a deadline; close() always ends it (quit on stdin,
then SIGTERM, then SIGKILL of its process group), which also stops its local Ray.
"""
from __future__ import annotations

import datetime as dt
import json
import math
import os
import platform
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# multi-GPU hosts (offline-wheels README): no NVLink multicast in any process
MULTI_GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}
GPU_UCX_TLS = "cuda_ipc,cuda_copy,tcp"  # measured fastest for NIXL on 2 H200s
CLUSTER_KEYS = ("model", "device", "setups", "replicas", "block_size", "num_blocks",
                "max_num_seqs", "max_num_batched_tokens", "max_model_len", "disagg_threshold",
                "routing", "lease_ttl_s", "triton", "cuda_graphs", "worker_opts",
                "startup_timeout_s", "request_timeout_s")


def detect_device() -> str:
    try:
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def parse_worker_opts(items: list[str]) -> dict[str, dict]:
    """["prefill:max_num_batched_tokens=8192", "seed=1"] -> {"prefill": {...}, "all": {...}};
    keys must be WorkerConfig or EngineArgs fields (WorkerConfig.of splits them); values are
    JSON when they parse as JSON, else strings."""
    import dataclasses

    from pdserve.engine.core.engine_args import EngineArgs
    from pdserve.worker.config import ROLES, WorkerConfig

    fields = ({f.name for f in dataclasses.fields(WorkerConfig)} - {"role", "worker_id", "faults",
                                                                    "engine"}) | \
        {f.name for f in dataclasses.fields(EngineArgs)}
    out: dict[str, dict] = {}
    for item in items:
        scope, kv = item.split(":", 1) if ":" in item.split("=", 1)[0] else ("all", item)
        key, sep, raw = kv.partition("=")
        if not sep or key not in fields or (scope != "all" and scope not in ROLES):
            raise ValueError(f"--worker-opt: expected [ROLE:]KEY=VALUE with ROLE in {ROLES} and "
                             f"KEY a worker or engine field ({', '.join(sorted(fields))}), got {item!r}")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        out.setdefault(scope, {})[key] = value
    return out


def child_env(device: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **MULTI_GPU_ENV)
    env.setdefault("RAY_AUTH_MODE", "token")
    if device.startswith("cuda"):
        env.setdefault("UCX_TLS", GPU_UCX_TLS)
    # Ray workers inherit this: they import worker.actor from the checkout
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def _versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for dist in ("torch", "triton", "ray", "nixl", "grpcio", "protobuf", "prometheus-client",
                 "fastapi", "uvicorn", "matplotlib"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    try:
        import torch
        out["cuda"] = torch.version.cuda
    except ImportError:
        pass
    return out


def _git() -> dict:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}
    except (OSError, subprocess.SubprocessError):
        return {}


def device_names(device: str) -> list[str]:
    if not device.startswith("cuda"):
        return [f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"]
    import torch
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def header(plan: dict, argv: list[str]) -> dict:
    names = device_names(plan["device"])
    return {"benchmark": "payoff (issue #8): disaggregated vs colocated goodput under SLO",
            "device": f"{len(names)}x {names[0]}" if names and len(set(names)) == 1 else names,
            "devices": names, "host": platform.node(),
            "command": shlex.join([sys.executable, "-m", "bench.lab.bench_payoff", *argv]),
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "versions": _versions(), "git": _git(),
            "env": {k: os.environ.get(k) for k in (*MULTI_GPU_ENV, "UCX_TLS", "PYTHONPATH")},
            "plan": plan}


def _clean(x):
    """JSON has no infinity or NaN: write them as strings."""
    if isinstance(x, float) and not math.isfinite(x):
        return "inf" if x > 0 else "-inf" if x < 0 else "nan"
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_clean(payload), indent=1, allow_nan=False) + "\n")
    tmp.replace(path)


class ClusterProcess:
    """`python -m bench.lab.payoff_cluster CONFIG`; its output goes to log_path."""

    def __init__(self, plan: dict, log_path: Path) -> None:
        cfg = {k: plan[k] for k in CLUSTER_KEYS}
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(log_path, "w", encoding="utf-8")
        self.log_path = log_path
        self.tail: deque[str] = deque(maxlen=40)
        self.events: queue.Queue = queue.Queue()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.lab.payoff_cluster", json.dumps(cfg)], cwd=REPO,
            env=child_env(plan["device"]), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)
        self.reader = threading.Thread(target=self._read, name="cluster-log", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.write(line)
            self.log.flush()
            self.tail.append(line.rstrip())
            if line.startswith("PAYOFF_"):
                tag, _, rest = line.strip().partition(" ")
                self.events.put((tag, rest))
        self.events.put(("EOF", ""))

    def _fail(self, what: str) -> RuntimeError:
        tail = "\n".join(self.tail)
        return RuntimeError(f"cluster: {what} (log: {self.log_path})\n--- last lines ---\n{tail}")

    def _expect(self, tag: str, timeout_s: float, what: str) -> str:
        end = time.monotonic() + timeout_s
        while True:
            try:
                got, rest = self.events.get(timeout=max(0.1, end - time.monotonic()))
            except queue.Empty:
                raise self._fail(f"no {what} within {timeout_s:.0f} s") from None
            if got == tag:
                return rest
            if got == "PAYOFF_ERROR":
                raise self._fail(f"failed while waiting for {what}: {rest}")
            if got == "EOF":
                raise self._fail(f"exited (rc {self.proc.wait(30)}) before {what}")

    def wait_ready(self, setup: str, timeout_s: float) -> dict:
        info = json.loads(self._expect("PAYOFF_READY", timeout_s, f"{setup} ready"))
        if info["setup"] != setup:
            raise self._fail(f"expected {setup}, got {info['setup']}")
        return info

    def _send(self, line: str) -> None:
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            pass

    def next_setup(self, last: bool) -> None:
        """Tear the current setup down (and start the next unless last); waits for it."""
        self._send("quit" if last else "next")
        self._expect("PAYOFF_STOPPED", 120, "teardown")

    def close(self) -> None:
        """End the process whatever state it is in (quit, then SIGTERM, then SIGKILL)."""
        if self.proc.poll() is None:
            self._send("quit")
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            for sig, wait_s in ((None, 90), (signal.SIGTERM, 30), (signal.SIGKILL, 10)):
                if sig is not None:
                    try:
                        os.killpg(self.proc.pid, sig)  # the group we started (own session)
                    except ProcessLookupError:
                        break
                try:
                    self.proc.wait(wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self.reader.join(10)
        self.log.close()

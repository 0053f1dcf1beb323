"""Starting a local Ray instance (pdserve serve without --address, benchmarks, tests).

A Ray head must come up within Ray's fixed deadlines: its GCS publishes its port within 30 s,
its raylet registers with the GCS within 30 s. On a 2-core machine, in a test process that had
run ~10 minutes of other tests, each of these was missed once (pdserve's CI lost a test module
to it twice; the next start a minute later worked). Such a start is retried after a clean
shutdown: every process the failed attempt started is ended and its GCS's log is shown, so a
real fault still fails, with its cause.
"""
from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

log = logging.getLogger(__name__)


# Ray's messages for a head that missed a startup deadline (ray/_private/node.py)
_SLOW_START = ("gcs_server_port", "timed out during startup")


def start_local_ray(attempts: int = 3, backoff_s: float = 5.0, **init_kwargs: object) -> None:
    """ray.init(**init_kwargs) for a new local instance, up to `attempts` times when the head
    misses a startup deadline; any other error (and the last attempt's) is raised."""
    import psutil
    import ray

    for attempt in range(1, attempts + 1):
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        try:
            ray.init(**init_kwargs)
            return
        except Exception as e:  # Ray raises a bare Exception for the raylet's deadline
            if not any(m in str(e) for m in _SLOW_START):
                raise
            log.warning("Ray's head did not start (attempt %d of %d: %s); "
                        "GCS and raylet logs:\n%s", attempt, attempts, e, gcs_log_tail(str(e)))
            ray.shutdown()
            kill_new_children(before)  # the last attempt's too: nothing left behind
            if attempt == attempts:
                raise
            time.sleep(backoff_s * attempt)


def kill_new_children(before: set[int]) -> None:
    """End this process's children not in `before` (pids): what a failed ray.init started
    (GCS, raylet, helpers) and left running."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        if child.pid in before:
            continue
        try:
            child.kill()
            child.wait(10)
        except psutil.Error:
            pass


def gcs_log_tail(error: str, lines: int = 20) -> str:
    """The last lines of the GCS and raylet logs of the session that `error` names (else of
    the latest session)."""
    named = re.search(r"(/\S+/session_[^/\s]+)/", error)
    session = named.group(1) if named else os.path.realpath("/tmp/ray/session_latest")
    out: list[str] = []
    for pattern in ("gcs_server.*", "raylet.*"):
        for path in sorted(glob.glob(f"{session}/logs/{pattern}")):
            with open(path, errors="replace") as f:
                out += [f"{os.path.basename(path)}: {line.rstrip()}"
                        for line in f.readlines()[-lines:]]
    return "\n".join(out) or f"(no GCS or raylet log under {session}/logs)"


class RayHead:
    """A local Ray head (`ray start --head --block`) in its own session and process group.

    Why not `ray.init()`: the GCS and raylet it starts share pdserve's process group, so a stop
    signal sent to the group (systemd's default, `kill -- -PGID`) kills them before pdserve
    has drained its streams. Started here they never see that signal: pdserve drains, then
    calls stop(). If pdserve dies without stopping it, the kernel sends the head SIGTERM
    (PR_SET_PDEATHSIG, set in _head_main), and Ray's head ends everything it started.
    Token authentication is on (a fresh token per head, given to this process's Ray client
    through RAY_AUTH_TOKEN, which `pdserve serve` sets before Ray is imported).
    """

    def __init__(self, node_ip: str, log_path: str, num_cpus: int | None = None) -> None:
        self.node_ip, self.log_path, self.num_cpus = node_ip, log_path, num_cpus
        self.proc: subprocess.Popen | None = None
        self.address = ""
        self.temp_dir = ""

    def start(self, env: dict[str, str], timeout_s: float = 120.0) -> str:
        """Start the head; its GCS address once it says it runs (else raise with its log)."""
        port = _free_port(self.node_ip)
        # its own temp dir: `ray start` records its address in <temp dir>/ray_current_cluster,
        # which a later plain ray.init() on this machine would otherwise try to join
        self.temp_dir = tempfile.mkdtemp(prefix="pdserve-ray-")
        cmd = [sys.executable, "-m", "pdserve.worker.local_ray", "start", "--head", "--block",
               f"--port={port}", f"--temp-dir={self.temp_dir}", "--include-dashboard=false",
               "--disable-usage-stats"]
        if self.num_cpus is not None:
            cmd.append(f"--num-cpus={self.num_cpus}")
        # pdserve has drained before it stops the head: Ray's own drain on SIGTERM (30 s by
        # default, for Ray Serve) would only delay the exit
        env = {**env, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
        with open(self.log_path, "w") as log_file:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        end = time.monotonic() + timeout_s
        while "Ray runtime started" not in self._log():
            if self.proc.poll() is not None or time.monotonic() > end:
                tail = "\n".join(self._log().splitlines()[-20:])
                self.stop()
                raise RuntimeError(f"the Ray head did not start within {timeout_s:.0f} s "
                                   f"(log {self.log_path}):\n{tail}")
            time.sleep(0.2)
        self.address = f"{self.node_ip}:{port}"
        return self.address

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM to the head (Ray ends the processes it started), then SIGKILL to whatever
        of its process group is left."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the head leads its own group
        self.proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout_s)
        if not _group_gone(pgid, 1.0):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            _group_gone(pgid, 5.0)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        self.proc = None
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def _log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


def _group_gone(pgid: int, wait_s: float) -> bool:
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _head_main() -> None:
    """`python -m pdserve.worker.local_ray start --head ...`: Ray's own CLI, made to receive
    SIGTERM when the process that started it dies (Linux), so a crashed pdserve leaves no
    Ray head behind."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    from ray.scripts.scripts import main

    sys.argv = ["ray", *sys.argv[1:]]
    main()


if __name__ == "__main__":
    _head_main()

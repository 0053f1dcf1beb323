"""Starting a local Ray instance (pdserve serve without --address, benchmarks, tests).

A Ray head must come up within Ray's fixed deadlines: its GCS publishes its port within 30 s,
its raylet registers with the GCS within 30 s. On a 2-core machine, in a test process that had
run ~10 minutes of other tests, each of these was missed once (pdserve's CI lost a test module
to it twice; the next start a minute later worked). Such a start is retried after a clean
shutdown: every process the failed attempt started is ended and its GCS's log is shown, so a
real fault still fails, with its cause.
"""
from __future__ import annotations

import glob
import logging
import os
import re
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

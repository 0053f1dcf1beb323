"""Starting a local Ray instance (pdserve serve without --address, benchmarks, tests).

A Ray head's GCS must publish its port within Ray's deadline (30 s); on a loaded 2-core
machine it once did not (pdserve's CI lost a test module to it; the next start a minute later
worked). Such a start is retried after a clean shutdown: the failed attempt's orphaned GCS and
raylet are ended and that GCS's log is shown, so a real fault still fails, with its cause.
"""
from __future__ import annotations

import glob
import logging
import os
import re
import time

log = logging.getLogger(__name__)


def start_local_ray(attempts: int = 3, backoff_s: float = 5.0, **init_kwargs: object) -> None:
    """ray.init(**init_kwargs) for a new local instance, up to `attempts` times when its GCS
    misses the port deadline; any other error (and the last attempt's) is raised."""
    import ray

    for attempt in range(1, attempts + 1):
        try:
            ray.init(**init_kwargs)
            return
        except RuntimeError as e:
            if "gcs_server_port" not in str(e):
                raise
            log.warning("Ray's head did not start (attempt %d of %d: %s); GCS log:\n%s",
                        attempt, attempts, e, gcs_log_tail(str(e)))
            ray.shutdown()
            kill_orphan_ray_children()  # the last attempt's too: nothing left behind
            if attempt == attempts:
                raise
            time.sleep(backoff_s * attempt)


def kill_orphan_ray_children() -> None:
    """A failed ray.init leaves the processes it started (GCS, raylet) running: end them."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            if any(n in child.name() for n in ("gcs_server", "raylet")):
                child.kill()
                child.wait(10)
        except psutil.Error:
            pass


def gcs_log_tail(error: str, lines: int = 20) -> str:
    """The last lines of the GCS logs of the session that `error` names."""
    session = re.search(r"(/\S+/session_[^/\s]+)/", error)
    logs = sorted(glob.glob(f"{session.group(1)}/logs/gcs_server.*")) if session else []
    out: list[str] = []
    for path in logs:
        with open(path, errors="replace") as f:
            out += [f"{os.path.basename(path)}: {line.rstrip()}" for line in f.readlines()[-lines:]]
    return "\n".join(out) or "(no gcs_server log)"

"""worker.local_ray: a Ray head whose GCS misses the port deadline is retried cleanly."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO,
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=240)


def test_a_head_that_misses_the_port_deadline_is_retried_and_leaves_no_processes() -> None:
    """Ray's port wait set to 0 s makes every GCS start miss it: start_local_ray tries twice,
    shows the GCS log, ends each attempt's orphaned GCS, then raises Ray's error; the same
    process then starts Ray normally (deadline restored) and the instance works."""
    code = """
        import os, psutil, ray
        from pdserve.worker.local_ray import start_local_ray
        try:
            start_local_ray(attempts=2, backoff_s=0.1, num_cpus=1, include_dashboard=False)
        except RuntimeError as e:
            print("RAISED", "gcs_server_port" in str(e))
        left = [c.name() for c in psutil.Process().children(recursive=True)
                if "gcs_server" in c.name() or "raylet" in c.name()]
        print("LEFT", left)
        del os.environ["RAY_gcs_server_port_wait_time_s"]
        start_local_ray(num_cpus=1, include_dashboard=False)
        print("CPUS", ray.cluster_resources().get("CPU"))
        ray.shutdown()
    """
    out = _run(code, {"RAY_gcs_server_port_wait_time_s": "0"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RAISED True" in out.stdout
    assert "LEFT []" in out.stdout
    assert "CPUS 1.0" in out.stdout
    assert "attempt 1 of 2" in out.stderr  # the retry was logged, with the GCS log after it

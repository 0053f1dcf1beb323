"""How much CPU an idle cluster burns: start `pdserve serve` (default model, one prefill and
one decode worker on a local Ray), wait until it answers /v1/models, sample every process of
the cluster for --seconds, stop it, write JSON {device, command, date, results}.

An idle serving cluster should cost next to nothing: before nixl_agent.make_agent paced
NIXL's progress thread, each worker held a whole core while idle.

    python -m bench.lab.idle_cpu --out bench/results/idle_cpu_<date>.json
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import signal
import subprocess
import sys
import time
import urllib.request

import psutil

CLUSTER_MARKERS = ("pdserve", "ray::", "raylet", "gcs_server")


def wait_ready(port: int, proc: subprocess.Popen, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"pdserve serve exited with {proc.returncode} before it was ready")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).read()
            return
        except OSError:
            time.sleep(2)
    raise SystemExit(f"pdserve serve not ready within {timeout_s} s")


def cluster_processes() -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if any(m in cmd for m in CLUSTER_MARKERS) and p.pid != os.getpid():
            found.append(p)
    return found


def sample(seconds: float) -> list[dict]:
    """CPU % of a core per cluster process over `seconds` (psutil's interval measure)."""
    procs = cluster_processes()
    for p in procs:
        p.cpu_percent(None)
    time.sleep(seconds)
    rows = []
    for p in procs:
        try:
            rows.append({"pid": p.pid, "cpu_percent": p.cpu_percent(None),
                         "threads": p.num_threads(), "cmd": " ".join(p.cmdline())[:120]})
        except psutil.Error:
            pass  # exited meanwhile
    return sorted(rows, key=lambda r: -r["cpu_percent"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8127)
    ap.add_argument("--grpc-port", type=int, default=50127)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--out", default=f"bench/results/idle_cpu_{dt.date.today()}.json")
    args = ap.parse_args()
    cmd = ["pdserve", "serve", "--port", str(args.port), "--grpc-port", str(args.grpc_port)]
    print(f"[idle_cpu] starting: {' '.join(cmd)}", file=sys.stderr)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(args.port, proc, args.ready_timeout)
        print(f"[idle_cpu] ready; sampling {args.seconds} s", file=sys.stderr)
        time.sleep(3)  # let start-up work (warm-ups, first health checks) settle
        rows = sample(args.seconds)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    total = sum(r["cpu_percent"] for r in rows)
    print(f"[idle_cpu] idle cluster: {total:.1f}% of one core over {len(rows)} processes",
          file=sys.stderr)
    out = {"device": f"cpu: {platform.processor() or platform.machine()}, "
                     f"{psutil.cpu_count()} cores",
           "command": " ".join([sys.executable] + sys.argv),
           "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
           "results": {"total_cpu_percent": total, "seconds": args.seconds, "processes": rows}}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

"""What the router costs per streamed token: the router (HTTP + gRPC faces, dispatch, SSE) in a
process of its own, in front of fake workers in another (tests/router/fake_worker.py: real
gRPC, a "model" that answers at once, one token per decode message: the router's worst case,
MTP sends several), driven by bench.loadgen's streaming client from this process.

    python -m bench.lab.router_overhead [--concurrency 16,64,256] [--tokens 256] [--out F.json]

Per concurrency: tokens/s through the router, and the router process's CPU time per token
(user + system from /proc, so the load generator's and the workers' CPU are not counted).
At one core's worth of router CPU, 1e6 / (us per token) is the most tokens/s one router
process can stream, whatever the GPUs behind it do. Lab code: not installed, not a test.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KEY = "overhead-key"


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process pid (and its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _workers() -> None:
    """Child: a fake prefill and decode worker; prints their addresses, runs until stdin ends."""
    from tests.router.fake_worker import FakeWorker

    ws = [FakeWorker("p0", "prefill").start(), FakeWorker("d0", "decode").start()]
    print(json.dumps({w.worker_id: [w.role, w.address] for w in ws}), flush=True)
    sys.stdin.read()


def _router(addresses: str) -> None:
    """Child: the router over the fake workers; prints its HTTP port, runs until stdin ends."""
    from pdserve.router.core import RouterConfig
    from pdserve.router.frontend import load_frontend
    from pdserve.router.launch import start_stack
    from pdserve.router.worker_refs import StaticWorkerRef

    from tests.cluster_secret import SECRET

    refs = [StaticWorkerRef(wid, role, addr) for wid, (role, addr) in json.loads(addresses).items()]

    async def main() -> None:
        cfg = RouterConfig(block_size=16, router_id="router-overhead", max_inflight=1024)
        stack = await start_stack(refs, load_frontend(None), cfg, cluster_secret=SECRET, port=0,
                                  grpc_port=0, api_key=KEY, capacity=512, startup_timeout_s=60)
        print(json.dumps({"http_port": stack.http_port}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)

    asyncio.run(main())


def _child(*args: str) -> tuple[subprocess.Popen, dict]:
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-m", "bench.lab.router_overhead", *args], cwd=REPO,
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline() if proc.stdout else ""
    if not line:
        raise RuntimeError(f"{args[0]}: the child process ended before it was ready")
    return proc, json.loads(line)


def _measure(url: str, model: str, endpoint: str, concurrency: int, tokens: int,
             router_pid: int) -> dict:
    from pdserve.bench.loadgen import LoadConfig, run_load
    from pdserve.bench.workload import RequestSpec

    cfg = LoadConfig(url, model, endpoint=endpoint, api_key=KEY, max_concurrency=concurrency,
                     progress=False, ignore_eos=True)
    specs = [RequestSpec("Hello there, how are you today?", 8, tokens)] * (concurrency * 2)
    start: dict = {}

    def measured() -> None:
        start.update(cpu=_cpu_s(router_pid), t=time.perf_counter())

    run = run_load(specs, cfg, warmup=specs[:concurrency], measured=measured)
    cpu, wall = _cpu_s(router_pid) - start["cpu"], time.perf_counter() - start["t"]
    done = [r for r in run.results if r.success]
    n = sum(r.output_tokens for r in done)
    return {"endpoint": endpoint, "concurrency": concurrency, "requests": len(done),
            "failed": len(run.results) - len(done), "tokens": n,
            "tokens_per_s": round(n / wall), "router_cpu_s": round(cpu, 2),
            "router_cores_busy": round(cpu / wall, 2),
            "router_cpu_us_per_token": round(cpu / max(n, 1) * 1e6, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=("workers", "router"), help=argparse.SUPPRESS)
    ap.add_argument("--addresses", help=argparse.SUPPRESS)
    ap.add_argument("--concurrency", default="16,64,256")
    ap.add_argument("--tokens", type=int, default=256, help="output tokens per request")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.role == "workers":
        return _workers() or 0
    if args.role == "router":
        return _router(args.addresses) or 0
    workers, addresses = _child("--role", "workers")
    router, ports = _child("--role", "router", "--addresses", json.dumps(addresses))
    url = f"http://127.0.0.1:{ports['http_port']}"
    rows = []
    try:
        from pdserve.router.frontend import load_frontend
        model = load_frontend(None).model_id
        for c in (int(x) for x in args.concurrency.split(",")):
            for endpoint in ("/v1/completions", "/v1/chat/completions"):
                row = _measure(url, model, endpoint, c, args.tokens, router.pid)
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        for proc in (router, workers):
            proc.stdin.close()
            proc.wait(30)
    out = {"what": "router CPU per streamed token, fake workers answering at once, one token "
                   "per decode message", "device": f"cpu: {platform.machine()}, "
           f"{os.cpu_count()} cores", "date": dt.date.today().isoformat(),
           "command": "python -m bench.lab.router_overhead " + " ".join(sys.argv[1:]),
           "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

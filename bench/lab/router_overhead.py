"""What the router costs per streamed token: the router (HTTP + gRPC faces, dispatch, SSE) in a
process of its own, in front of fake workers in another (tests/router/fake_worker.py: real
gRPC, a "model" that answers at once, one token per decode message: the router's worst case,
MTP sends several), driven by bench.loadgen's streaming client from this process.

    python -m bench.lab.router_overhead [--concurrency 16,64,256] [--tokens 256] [--out F.json]

Per concurrency: tokens/s through the router, and the router process's CPU time per token
(user + system from /proc, so the load generator's and the workers' CPU are not counted). The
router runs alone on CPU 0, the workers and the load generator on the other CPUs.
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
    from tests.cluster_secret import SECRET
    from tests.router.fake_worker import FakeWorker

    ws = [FakeWorker("p0", "prefill").start(), FakeWorker("d0", "decode").start()]
    # the workers' cluster secret (one per process) goes to the router through pipes
    print(json.dumps({"secret": SECRET, "workers": {
        w.worker_id: [w.role, w.address, w.incarnation] for w in ws}}), flush=True)
    sys.stdin.read()


def _router() -> None:
    """Child: the router over the fake workers (their addresses and secret: stdin's first
    line); prints its HTTP port, runs until stdin ends."""
    from pdserve.router.core import RouterConfig
    from pdserve.router.frontend import load_frontend
    from pdserve.router.launch import start_stack
    from pdserve.router.worker_refs import StaticWorkerRef

    given = json.loads(sys.stdin.readline())
    refs = [StaticWorkerRef(wid, role, addr, inc)
            for wid, (role, addr, inc) in given["workers"].items()]

    async def main() -> None:
        cfg = RouterConfig(block_size=16, router_id="router-overhead", max_inflight=1024)
        stack = await start_stack(refs, load_frontend(given.get("model")), cfg,
                                  cluster_secret=given["secret"], port=0, grpc_port=0,
                                  api_key=KEY, capacity=512, startup_timeout_s=60)
        print(json.dumps({"http_port": stack.http_port}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)

    os.sched_setaffinity(0, {0})  # the router alone on CPU 0 (the rest elsewhere: main)
    if given.get("uvloop"):
        import uvloop
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    if not given.get("profile"):
        asyncio.run(main())
        return
    import cProfile

    with cProfile.Profile() as prof:  # the router's own time per function (--profile)
        asyncio.run(main())
    prof.dump_stats(given["profile"])


def _child(role: str, given: dict | None = None) -> tuple[subprocess.Popen, dict]:
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-m", "bench.lab.router_overhead", "--role", role],
                            cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    if given is not None and proc.stdin is not None:
        proc.stdin.write(json.dumps(given) + "\n")
        proc.stdin.flush()
    line = proc.stdout.readline() if proc.stdout else ""
    if not line:
        raise RuntimeError(f"{role}: the child process ended before it was ready")
    return proc, json.loads(line)


def _http_parser() -> str:
    """What uvicorn's "auto" picks: httptools when installed, else h11."""
    try:
        import httptools  # noqa: F401
    except ImportError:
        return "h11"
    return "httptools"


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
    ap.add_argument("--concurrency", default="16,64,256")
    ap.add_argument("--tokens", type=int, default=256, help="output tokens per request")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--model", help="the frontend's model (its tokenizer and chat template); "
                    "default: the embedded SmolLM2")
    ap.add_argument("--uvloop", action="store_true", help="the router on uvloop's event loop")
    ap.add_argument("--profile", type=Path, help="cProfile the router process into this file")
    args = ap.parse_args()
    if args.role == "workers":
        return _workers() or 0
    if args.role == "router":
        return _router() or 0
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs 2 CPUs: the router gets CPU 0 to itself")
    os.sched_setaffinity(0, os.sched_getaffinity(0) - {0})  # workers and load: not CPU 0
    workers, given = _child("workers")
    router, ports = _child("router", {**given, "profile": str(args.profile or ""),
                                      "uvloop": args.uvloop, "model": args.model})
    url = f"http://127.0.0.1:{ports['http_port']}"
    rows = []
    try:
        from pdserve.router.frontend import load_frontend
        model = load_frontend(args.model).model_id
        for c in (int(x) for x in args.concurrency.split(",")):
            for endpoint in ("/v1/completions", "/v1/chat/completions"):
                row = _measure(url, model, endpoint, c, args.tokens, router.pid)
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        for proc in (router, workers):
            proc.stdin.close()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:  # never left behind to skew the next run
                proc.kill()
                proc.wait(10)
    out = {"what": "router CPU per streamed token, fake workers answering at once, one token "
                   "per decode message", "device": f"cpu: {platform.machine()}, "
           f"{os.cpu_count()} cores", "date": dt.date.today().isoformat(),
           "command": "python -m bench.lab.router_overhead " + " ".join(sys.argv[1:]),
           "http_parser": _http_parser(), "python": platform.python_version(),
           "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

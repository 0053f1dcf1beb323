"""The serving side of bench_payoff: one process, one Ray instance, one setup at a time.

    python -m bench.lab.payoff_cluster CONFIG_JSON

For each setup in CONFIG_JSON["setups"] ("disagg": one prefill + one decode worker;
"colocated": `replicas` workers that prefill and decode) it launches the worker actors
exactly as `pdserve serve` does (worker.actor.launch_worker, one GPU each on GPU hosts) and
runs the real router stack (router.launch.start_stack: gRPC + HTTP, Ray worker refs, NIXL
peers), then prints one line

    PAYOFF_READY {"setup": ..., "grpc": "127.0.0.1:P", "http": ..., "workers": {...}}

and waits for a line on stdin: "next" tears the setup down (drain, workers shut down and
killed) and starts the next one; EOF or "quit" tears down and exits. Errors print
`PAYOFF_ERROR message` and exit 1. SIGTERM tears down too. The driver (bench_payoff.py)
owns the process; everything it started here (actors, the local Ray) is stopped in finally.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import secrets
import signal
import sys
import threading
import time
import traceback
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout

READY, STOPPED, ERROR = "PAYOFF_READY", "PAYOFF_STOPPED", "PAYOFF_ERROR"
SECRET = secrets.token_urlsafe(32)  # this run's cluster secret (workers and router)


def say(tag: str, payload: object = "") -> None:
    text = payload if isinstance(payload, str) else json.dumps(payload)
    print(f"{tag} {text}".rstrip(), flush=True)


def worker_configs(cfg: dict, setup: str) -> list:
    """WorkerConfigs of one setup; cfg["worker_opts"][role] overrides fields per role."""
    from pdserve.worker.config import WorkerConfig

    roles = [("colocated", cfg.get("replicas", 2))] if setup == "colocated" else \
        [("prefill", 1), ("decode", 1)]
    cuda = cfg["device"].startswith("cuda")
    base = dict(model=cfg["model"], device=cfg["device"], block_size=cfg["block_size"],
                num_blocks=cfg.get("num_blocks"), max_num_seqs=cfg["max_num_seqs"],
                max_num_batched_tokens=cfg["max_num_batched_tokens"],
                max_model_len=cfg["max_model_len"], enable_prefix_caching=True,
                use_triton=cuda and cfg.get("triton", True),
                use_cuda_graphs=cuda and cfg.get("triton", True) and cfg.get("cuda_graphs", True),
                lease_ttl_s=cfg["lease_ttl_s"], host="127.0.0.1")
    out = []
    for role, count in roles:
        opts = {**cfg.get("worker_opts", {}).get("all", {}),
                **cfg.get("worker_opts", {}).get(role, {})}
        for i in range(count):
            out.append(WorkerConfig.of(role, f"{role}-{i}", SECRET, **{**base, **opts}))
    return out


def launch(cfg: dict, setup: str) -> list:
    from pdserve.router.worker_refs import RayWorkerRef
    from pdserve.worker.actor import launch_worker

    num_gpus, num_cpus = (1, 1) if cfg["device"].startswith("cuda") else (0, 0.25)
    refs = []
    for wc in worker_configs(cfg, setup):
        # no restarts: a worker that dies must show as failed requests, not as a quiet retry
        actor = launch_worker(wc, num_gpus=num_gpus, num_cpus=num_cpus, max_restarts=0)
        refs.append(RayWorkerRef(actor, wc.worker_id, wc.role))
    return refs


async def start(cfg: dict, setup: str, frontend):
    """Workers + router stack of one setup (the stack owns the workers once it is up)."""
    from pdserve.router.core import RouterConfig
    from pdserve.router.launch import WORKER_STREAMS, start_stack

    refs = launch(cfg, setup)
    rcfg = RouterConfig(block_size=cfg["block_size"], routing=cfg["routing"],
                        disagg_threshold=cfg["disagg_threshold"], max_inflight=4096,
                        retry_budget=cfg.get("retry_budget", 2),
                        request_timeout_s=cfg["request_timeout_s"],
                        router_id=f"router-{setup}-{uuid.uuid4().hex[:4]}")
    t0 = time.monotonic()

    def progress(ready: int, total: int) -> None:
        print(f"payoff_cluster: {setup}: {ready}/{total} workers ready "
              f"({time.monotonic() - t0:.0f} s)", flush=True)
    starting = asyncio.ensure_future(start_stack(
        refs, frontend, rcfg, cluster_secret=SECRET, host="127.0.0.1", port=0, grpc_port=0,
        capacity=max(1, min(cfg["max_num_seqs"], WORKER_STREAMS)),
        startup_timeout_s=cfg["startup_timeout_s"], progress=progress))
    # an actor whose constructor raised (no restarts) fails its ping at once: stop waiting
    watch = asyncio.ensure_future(asyncio.gather(*(r.actor.ping.remote() for r in refs)))
    try:
        await asyncio.wait({starting, watch}, return_when=asyncio.FIRST_EXCEPTION)
        if watch.done() and watch.exception() is not None:
            raise RuntimeError(f"{setup}: a worker failed to start: {watch.exception()}")
        return await starting
    except BaseException:
        for t in (starting, watch):
            t.cancel()
        await asyncio.gather(starting, watch, return_exceptions=True)
        await shutdown_refs(refs)
        raise


def ready_info(setup: str, stack, started: float, cfg: dict) -> dict:
    workers = {w.worker_id: {"role": w.role,
                             "grpc": w.endpoints.get("grpc_address"),
                             "metrics": w.endpoints.get("metrics_address")}
               for w in stack.pool.workers.values()}
    # the results JSON and the log are published: the run's cluster secret stays out
    configs = {wc.worker_id: {k: "<redacted>" if k == "cluster_secret" else v
                              for k, v in dataclasses.asdict(wc).items() if k != "faults"}
               for wc in worker_configs(cfg, setup)}
    return {"setup": setup, "grpc": f"127.0.0.1:{stack.grpc_port}",
            "http": f"127.0.0.1:{stack.http_port}", "workers": workers,
            "worker_configs": configs, "startup_s": time.monotonic() - started,
            "model_id": stack.core.frontend.model_id,
            "vocab_size": stack.core.frontend.config.vocab_size}


def _actor_view(_self) -> dict:
    """Runs inside a worker actor: the environment it got and the GPU it sees."""
    import os

    import torch
    env = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "UCX_TLS", "NCCL_NVLS_ENABLE",
                                          "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")}
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"pid": os.getpid(), "env": env, "gpu": gpu}


async def actor_views(stack) -> dict:
    """What each worker process sees (env inherited from here, GPU placed by Ray)."""
    out = {}
    for w in stack.pool.workers.values():
        try:
            out[w.worker_id] = await asyncio.wait_for(
                w.ref.actor.__ray_call__.remote(_actor_view), 30)
        except Exception as e:  # noqa: BLE001 - informative only
            out[w.worker_id] = {"error": repr(e)}
    return out


async def shutdown_refs(refs: list) -> None:
    for ref in refs:
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(ref.shutdown(), 15)


def stdin_lines() -> asyncio.Queue:
    """Lines of stdin ("" at EOF), read by a daemon thread (never blocks interpreter exit)."""
    loop, q = asyncio.get_running_loop(), asyncio.Queue()

    def pump() -> None:
        while True:
            line = sys.stdin.readline()
            loop.call_soon_threadsafe(q.put_nowait, line.strip() if line else "quit")
            if not line:
                return
    threading.Thread(target=pump, name="stdin", daemon=True).start()
    return q


async def run(cfg: dict) -> int:
    import ray

    from pdserve.router.frontend import load_frontend
    from pdserve.router.launch import stop_stack
    from pdserve.worker.local_ray import start_local_ray

    frontend = load_frontend(cfg["model"], cfg["max_model_len"])
    start_local_ray(include_dashboard=False, namespace=f"payoff-{uuid.uuid4().hex[:6]}",
                    log_to_driver=True)
    stack, commands = None, stdin_lines()
    try:
        for setup in cfg["setups"]:
            started = time.monotonic()
            stack = await start(cfg, setup, frontend)
            info = ready_info(setup, stack, started, cfg)
            for wid, view in (await actor_views(stack)).items():
                info["workers"][wid]["process"] = view
            say(READY, info)
            command = await commands.get()
            current, stack = stack, None
            await stop_stack(current, drain_timeout_s=5.0, shutdown_workers=True)
            say(STOPPED, setup)
            if command != "next":
                break
        return 0
    finally:
        if stack is not None:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(stop_stack(stack, 2.0, shutdown_workers=True), 30)
        ray.shutdown()


async def main_async(cfg: dict) -> int:
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    return await run(cfg)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg = json.loads(argv[0])
    os.environ.setdefault("RAY_AUTH_MODE", "token")  # as pdserve serve: token auth on
    try:
        return asyncio.run(main_async(cfg))
    except (asyncio.CancelledError, KeyboardInterrupt):
        say(STOPPED, "signal")
        return 0
    except BaseException as e:  # noqa: BLE001 - reported to the driver, then exit 1
        traceback.print_exc()
        say(ERROR, f"{type(e).__name__}: {e}".replace("\n", " ")[:2000])
        return 1


if __name__ == "__main__":
    sys.exit(main())

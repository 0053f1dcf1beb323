"""`pdserve serve`: start (or join) Ray, launch the worker pools, run the router.

    pdserve serve                                  # embedded model, 1 prefill + 1 decode
    pdserve serve --prefill 2 --decode 2 --model /models/llama.gguf
    pdserve serve --colocated --replicas 2        # workers that do both (the baseline)
    pdserve serve --speculative mtp --num-speculative-tokens 2   # MTP drafting on every worker
    pdserve serve --prefill-tp 2 --decode-tp 4    # tensor-parallel workers (GPUs of one node)

HTTP (OpenAI-compatible) on 127.0.0.1:8000, gRPC (pdserve.v1.Pdserve) on 127.0.0.1:50051
unless told otherwise; both endpoints and each worker's metrics address are printed once
the pool is ready. A Ray instance started here has token authentication on and no
dashboard. SIGTERM/SIGINT drain: /health says draining, new requests get 503, requests in
flight finish (up to --drain-timeout), then the workers are shut down.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import secrets
import signal
import socket
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from pdserve.router.serve_args import add_serve_arguments, check_serve_args, gpu_shortfall
from pdserve.router.worker_refs import WorkerStartFailed

log = logging.getLogger("pdserve.serve")
# Streams the router keeps open on one worker at most: a worker serves gRPC from a pool of
# 64 threads (proto.rpc.make_server's default) and each Prefill/Decode holds one; the rest
# stay free for Health, Release, Abort and AddPeer. More would queue inside the worker, where
# a queued Decode can outlive its prefill lease.
WORKER_STREAMS = 56


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the router (HTTP + gRPC) over Ray-managed prefill/decode pools")
    add_serve_arguments(p)
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    problem = check_serve_args(args) or _taken_port(args)
    if problem:
        print(f"pdserve serve: {problem}", file=sys.stderr)
        return 2
    if not args.address and "ray" not in sys.modules:
        # token authentication for the Ray head we start, with a fresh token: the head gets
        # it through its environment (RayHead), this process's Ray client reads it here
        # (older Ray versions read these when ray is imported, so they are set before that)
        os.environ.setdefault("RAY_AUTH_MODE", "token")
        if os.environ["RAY_AUTH_MODE"] == "token":
            os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    try:
        return asyncio.run(_serve(args))
    except KeyboardInterrupt:
        return 130


def _taken_port(args: argparse.Namespace) -> str | None:
    """The router's first port that is already in use, as a message naming it and its flag:
    checked before Ray and the workers start, so a second `pdserve serve` fails at once."""
    for flag, port in (("--port", args.port), ("--grpc-port", args.grpc_port)):
        if port == 0:  # any free port
            continue
        try:  # SO_REUSEADDR like the real servers (a port in TIME_WAIT is free), no REUSEPORT
            socket.create_server((args.host, port)).close()
        except OSError as e:
            return f"{flag}: {args.host}:{port} is in use or cannot be bound ({e.strerror})"
    return None


def _say(msg: str) -> None:
    print(msg, flush=True)


def _start_ray(args: argparse.Namespace, namespace: str):
    """Join --address, or start a local head (token auth on, no dashboard) in its own process
    group and connect to it. Returns the head we started (stop it last), else None."""
    import ray

    from pdserve.worker.local_ray import RayHead

    if args.address:
        ray.init(address=args.address, namespace=namespace, log_to_driver=True)
        return None
    mode = os.environ.setdefault("RAY_AUTH_MODE", "token")
    if mode != "token":
        log.warning("RAY_AUTH_MODE=%s: the local Ray cluster runs WITHOUT token authentication", mode)
    elif not os.environ.get("RAY_AUTH_TOKEN"):
        # ray was imported before _cmd_serve could set one: the head still gets a token (a
        # client that cannot see it fails to connect, loudly, rather than the head run open)
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    head = RayHead("127.0.0.1", os.path.join(tempfile.gettempdir(), f"pdserve-{namespace}-ray.log"))
    _say("pdserve: starting Ray")
    address = head.start(dict(os.environ))
    try:
        ray.init(address=address, namespace=namespace, log_to_driver=True)
    except BaseException:
        head.stop()
        raise
    return head


def _cluster_secret(args: argparse.Namespace) -> str:
    """The workers' credential: read from --cluster-secret-file, else made for this run (the
    workers get it from us through Ray, never on a socket the cluster serves)."""
    from pdserve.proto.rpc import new_cluster_secret, read_secret_file

    return read_secret_file(args.cluster_secret_file) if args.cluster_secret_file \
        else new_cluster_secret()


class ModelRefused(Exception):
    """A model (or MTP head) that no worker could load, named with its flag (exit 2)."""


def _check_model(args: argparse.Namespace):
    """The router's frontend (config, tokenizer) for --model; ModelRefused when the model,
    its weight files (on this machine; a joined cluster may keep them on the worker nodes
    only) or the MTP head for --speculative cannot load."""
    from pdserve.engine.core.config import ConfigError
    from pdserve.engine.model.loader import resolve_model
    from pdserve.engine.model.weights import WeightsError, safetensors_files
    from pdserve.engine.spec.mtp_head import check_mtp_head
    from pdserve.router.frontend import load_frontend

    try:
        frontend = load_frontend(args.model, args.max_model_len, args.served_model_name,
                                 args.tool_call_parser)
        source = resolve_model(args.model)
        if source.kind == "hf" and not args.address:
            safetensors_files(Path(source.path))
    except (ConfigError, WeightsError) as e:
        raise ModelRefused(f"--model: {str(e).removeprefix('model: ')}") from e
    if args.speculative and not (args.address and args.mtp_head):
        try:  # a head that cannot load fails here, not in every worker
            check_mtp_head(source, frontend.config, args.mtp_head)
        except ConfigError as e:
            raise ModelRefused(f"--speculative: {str(e).removeprefix('speculative: ')}") from e
    return frontend


class LaunchRefused(Exception):
    """What the cluster cannot run, said before any worker starts (exit status 2)."""


def _launch_workers(args: argparse.Namespace, cluster_secret: str) -> list:
    import ray

    from pdserve.router.cli import engine_args, role_tp, worker_roles
    from pdserve.router.worker_refs import RayWorkerRef
    from pdserve.worker.actor import launch_worker
    from pdserve.worker.config import WorkerConfig
    from pdserve.worker.tp_group import remove_previous
    from pdserve.worker.tp_worker import launch_tp_worker

    gpus = ray.cluster_resources().get("GPU", 0)
    device = args.device or ("cuda" if gpus >= 1 else "cpu")
    short = gpu_shortfall(args, gpus) if device.startswith("cuda") else None
    if short:
        raise LaunchRefused(short)
    # one GPU each; CPU actors take a fraction of a core so small machines host several
    num_gpus, num_cpus = (1, 1) if device.startswith("cuda") else (0, 0.25)
    fast = device.startswith("cuda") and not args.eager  # Triton kernels + CUDA graphs
    roles = worker_roles(args)
    engine = engine_args(args, device=device, block_size=args.block_size,
                         num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs,
                         max_model_len=args.max_model_len,
                         max_num_batched_tokens=args.max_num_batched_tokens,
                         scheduling_policy=args.scheduling_policy,
                         use_triton=fast, use_cuda_graphs=fast)
    refs = []
    for role, count in roles:
        tp = role_tp(args)[role]
        # a TP worker's ranks each capture their decode graphs (docs/tensor_parallel.md);
        # the group's GPU watchdog bounds the collectives replayed inside them
        role_engine = engine if tp == 1 else engine.replace(tensor_parallel_size=tp)
        for i in range(count):
            cfg = WorkerConfig(role=role, worker_id=f"{role}-{i}", cluster_secret=cluster_secret,
                               engine=role_engine, host=args.worker_host,
                               lease_ttl_s=args.lease_ttl, tp_timeout_s=args.tp_timeout,
                               log_level=args.log_level)
            # restarts are the pool's (RayWorkerRef), with backoff and no limit by default; a
            # TP worker's launch returns its rank 0 and relaunches the whole group
            launch = functools.partial(launch_worker if tp == 1 else launch_tp_worker, cfg,
                                       num_gpus=num_gpus, num_cpus=num_cpus,
                                       node_labels={args.node_label: role}
                                       if args.node_label else None)
            release = functools.partial(remove_previous, cfg.worker_id) if tp > 1 else None
            refs.append(RayWorkerRef(launch(generation=0), cfg.worker_id, role, launch=launch,
                                     max_restarts=args.max_restarts, release=release))
    spec = "" if not args.speculative else \
        f", speculative {args.speculative} k={args.num_speculative_tokens or 1}"
    sizes = ", ".join(f"{n} {r}" + (f" x TP {role_tp(args)[r]}" if role_tp(args)[r] > 1 else "")
                      for r, n in roles)
    _say(f"pdserve: launched {len(refs)} workers on {device} ({sizes}{spec}); loading the model")
    return refs


@dataclass
class Stack:
    """A running router: core + pool + HTTP + gRPC servers."""

    core: object
    pool: object
    http: object
    http_task: asyncio.Task
    grpc_server: object
    http_port: int
    grpc_port: int
    # set by a second SIGINT/SIGTERM: the drain stops waiting for requests in flight
    hurry: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


async def start_stack(refs: list, frontend, cfg, *, cluster_secret: str, host: str = "127.0.0.1",
                      port: int = 8000,
                      grpc_port: int = 50051, api_key: str | None = None, tls=None,
                      capacity: int = 64, startup_timeout_s: float = 900.0, progress=None,
                      log_level: str = "warning", max_body_bytes: int = 8 << 20) -> Stack:
    """Connect to the workers behind `refs`, then serve HTTP and gRPC (port 0 = pick one)."""
    from pdserve.router.core import RouterCore
    from pdserve.router.grpc_server import start_grpc
    from pdserve.router.http_app import create_app
    from pdserve.router.metrics import RouterMetrics
    from pdserve.router.pool import WorkerPool

    metrics = RouterMetrics(cfg.router_id)
    pool = WorkerPool(refs, cluster_secret=cluster_secret, capacity=capacity,
                      on_health=lambda w: metrics.worker_seen(
                          w.role, w.worker_id, w.up, w.health.kv_cache_usage if w.health else None,
                          w.health.num_pinned_blocks if w.health else None,
                          w.stall.stuck_s),
                      stall_timeout_s=cfg.stall_timeout_s)
    core = RouterCore(pool, frontend, cfg, metrics)
    pool.on_change = lambda w: core.prefill_policy.forget(w.worker_id)
    await pool.start(startup_timeout_s, progress=progress)
    grpc_server, gport = start_grpc(core, asyncio.get_running_loop(), host, grpc_port,
                                    api_key=api_key, tls=tls)
    http = _uvicorn(create_app(core, api_key=api_key, max_body_bytes=max_body_bytes), host, port,
                    log_level)
    http_task = asyncio.create_task(http.serve())
    while not http.started and not http_task.done():
        await asyncio.sleep(0.05)
    if http_task.done():
        grpc_server.stop(0)
        await pool.close()
        raise OSError(f"--port: the HTTP server could not start on {host}:{port}")
    bound = http.servers[0].sockets[0].getsockname()[1]
    return Stack(core, pool, http, http_task, grpc_server, bound, gport)


async def stop_stack(stack: Stack, drain_timeout_s: float, shutdown_workers: bool) -> None:
    """Drain (new requests get 503; in-flight ones finish up to the timeout), then stop."""
    core = stack.core
    _say(f"pdserve: draining ({core.inflight} requests in flight, up to {drain_timeout_s:.0f} s;"
         " Ctrl-C again to stop now)")
    core.start_drain()
    hurry = asyncio.create_task(stack.hurry.wait())
    idle = asyncio.create_task(core.wait_idle(drain_timeout_s))
    await asyncio.wait({hurry, idle}, return_when=asyncio.FIRST_COMPLETED)
    hurry.cancel()
    if not (idle.done() and idle.result()):
        idle.cancel()
        cut = core.cut_all()
        why = "stopping now" if stack.hurry.is_set() else "drain timeout"
        _say(f"pdserve: {why}: {cut} requests still in flight end with an error")
        await core.wait_idle(5.0)  # each stream sends its error chunk and [DONE]
    stack.http.should_exit = True
    await asyncio.gather(stack.http_task, return_exceptions=True)
    stack.grpc_server.stop(2).wait(3)
    if shutdown_workers:
        _say("pdserve: shutting down workers")
    await stack.pool.close(shutdown_workers=shutdown_workers)


def _uvicorn(app, host: str, port: int, log_level: str):
    """uvicorn without its own signal handling: SIGTERM means drain, which we do."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            yield

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            lifespan="off", timeout_graceful_shutdown=5)
    return Server(config)


async def _serve(args: argparse.Namespace) -> int:
    import ray

    from pdserve.proto.rpc import TLSConfig
    from pdserve.router.core import RouterConfig

    try:  # what every worker would fail on, said once, before Ray and the workers start
        frontend = _check_model(args)
    except ModelRefused as e:
        print(f"pdserve serve: {e}", file=sys.stderr)
        return 2
    from pdserve.router.cli import check_tp

    problem = check_tp(args, frontend.config)
    if problem:
        print(f"pdserve serve: {problem}", file=sys.stderr)
        return 2
    router_id = f"router-{uuid.uuid4().hex[:6]}"
    head = _start_ray(args, namespace=f"pdserve-{router_id}")
    refs: list = []
    try:
        secret = _cluster_secret(args)
        try:
            refs = _launch_workers(args, secret)
        except LaunchRefused as e:
            print(f"pdserve serve: {e}", file=sys.stderr)
            return 2
        cfg = RouterConfig(block_size=args.block_size, routing=args.routing,
                           disagg_threshold=args.disagg_threshold, max_inflight=args.max_inflight,
                           retry_budget=args.retry_budget, request_timeout_s=args.request_timeout,
                           prefill_timeout_s=args.prefill_timeout,
                           stall_timeout_s=args.stall_timeout, router_id=router_id,
                           log_requests=args.log_requests,
                           scheduling_policy=args.scheduling_policy)
        tls = TLSConfig(args.tls_cert, args.tls_key) if args.tls_cert else None
        try:
            stack = await start_stack(refs, frontend, cfg, cluster_secret=secret,
                                      host=args.host, port=args.port,
                                      grpc_port=args.grpc_port, api_key=args.api_key, tls=tls,
                                      capacity=max(1, min(args.max_num_seqs, WORKER_STREAMS)),
                                      startup_timeout_s=args.startup_timeout,
                                      progress=_progress(), log_level=args.log_level)
        except WorkerStartFailed as e:
            print(f"pdserve serve: {e}", file=sys.stderr)
            return 1
        except TimeoutError as e:
            print(f"pdserve serve: {e} (--startup-timeout)", file=sys.stderr)
            return 1
        refs = []  # the stack owns them now
        _print_ready(args, frontend.model_id, stack, tls is not None)
        lost = await _until_signal(stack, args.exit_after_unavailable)
        await stop_stack(stack, args.drain_timeout, shutdown_workers=True)
        return 3 if lost else 0
    finally:
        # startup failed or was interrupted: no actor left behind, all at once (one still
        # loading gets a few seconds to stop, then is killed)
        await asyncio.gather(*(asyncio.wait_for(ref.shutdown(), 3) for ref in refs),
                             return_exceptions=True)
        ray.shutdown()
        if head is not None:
            _say("pdserve: stopping Ray")
            head.stop()


def _progress():
    start = time.monotonic()

    def report(ready: int, total: int) -> None:
        _say(f"pdserve: {ready}/{total} workers ready ({time.monotonic() - start:.0f} s)")
    return report


def _print_ready(args, model_id: str, stack: Stack, tls: bool) -> None:
    for w in stack.pool.workers.values():
        ep = w.endpoints
        _say(f"  worker {w.worker_id:<12} {w.role:<9} grpc {ep.get('grpc_address')}  "
             f"metrics http://{ep.get('metrics_address')}/metrics")
    _say(f"pdserve: serving {model_id!r}")
    _say(f"  HTTP  http://{args.host}:{stack.http_port}/v1   (OpenAI-compatible; /health, /metrics)")
    _say(f"  gRPC  {args.host}:{stack.grpc_port}   (pdserve.v1.Pdserve{', TLS' if tls else ''})")
    _say("pdserve: ready")


async def _until_signal(stack: Stack, exit_after_unavailable_s: float) -> bool:
    """Wait for SIGTERM/SIGINT (or the HTTP server's end). With exit_after_unavailable_s > 0,
    also end (returning True) once no decode-capable worker has been up for that long."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waiters = {asyncio.create_task(stop.wait()), stack.http_task}
    watchdog = None
    if exit_after_unavailable_s > 0:
        watchdog = asyncio.create_task(_unavailable_for(stack.pool, exit_after_unavailable_s))
        waiters.add(watchdog)
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for t in waiters - {stack.http_task}:
        t.cancel()
    for sig in (signal.SIGTERM, signal.SIGINT):  # a second one: stop draining now
        loop.add_signal_handler(sig, stack.hurry.set)
    return watchdog is not None and watchdog.done() and not watchdog.cancelled()


async def _unavailable_for(pool, grace_s: float) -> None:
    """Return once no decode or colocated worker has been up for `grace_s` seconds."""
    since: float | None = None
    while True:
        serving = any(w.up for w in pool.by_role("decode", "colocated"))
        since = None if serving else since or time.monotonic()
        if since is not None and time.monotonic() - since >= grace_s:
            _say(f"pdserve: no decode worker for {grace_s:.0f} s (--exit-after-unavailable): "
                 "exiting with status 3")
            return
        await asyncio.sleep(0.5)

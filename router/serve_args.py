"""`pdserve serve`'s flags and their check (router/launch.py runs the command): every flag is
defined here with its default, and check_serve_args names the first bad one before Ray or a
worker starts."""
from __future__ import annotations

import argparse
import os
import re

from pdserve.router.policies import ROUTING_POLICIES

# --stall-timeout's floor: a worker's "busy" Health comes after its own 2 s wait for the
# loop, and the pool polls every 0.5 s; below this a slow step could pass for a hung one
MIN_STALL_TIMEOUT_S = 10.0
LABEL_KEY = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--model", default=None,
      help="HF folder, .gguf file or preset (default: embedded SmolLM2-135M-Instruct)")
    a("--served-model-name", default=None, help="the model id clients use (default: from the model)")
    a("--prefill", type=int, default=1, help="prefill workers (default 1)")
    a("--decode", type=int, default=1, help="decode workers (default 1)")
    a("--prefill-tp", type=int, default=1, metavar="N",
      help="tensor-parallel size of each prefill worker: N ranks (GPUs) on one node (default 1)")
    a("--decode-tp", type=int, default=1, metavar="M",
      help="tensor-parallel size of each decode worker (and of --colocated workers) (default 1)")
    a("--tp-timeout", type=float, default=60.0, metavar="SECONDS",
      help="inside a tensor-parallel worker, every wait (joining, a collective, a rank's "
           "silence, a GPU stuck in a CUDA graph's collective) ends after this; a rank that "
           "dies or hangs fails its whole worker, which is relaunched (default 60)")
    a("--colocated", action="store_true", help="workers that prefill and decode (see --replicas)")
    a("--replicas", type=int, default=1, help="colocated workers (with --colocated)")
    a("--host", default="127.0.0.1", help="bind address of HTTP and gRPC (default 127.0.0.1)")
    a("--port", type=int, default=8000, help="HTTP port (default 8000)")
    a("--grpc-port", type=int, default=50051, help="gRPC port (default 50051)")
    a("--api-key", default=os.environ.get("PDSERVE_API_KEY"),
      help="require `Authorization: Bearer KEY` on every route but /health and /metrics "
           "(default: $PDSERVE_API_KEY)")
    a("--cluster-secret-file", default=None,
      help="file holding the credential every worker RPC must carry (a mounted Kubernetes "
           "secret, say; at least 16 characters). Default: a fresh random secret per run")
    a("--tls-cert", default=None, help="gRPC TLS certificate (PEM)")
    a("--tls-key", default=None, help="gRPC TLS private key (PEM)")
    a("--address", default=None, help="join this Ray cluster instead of starting one")
    a("--worker-host", default="127.0.0.1",
      help="address workers bind their gRPC/metrics/KV transfer on; 'node': each worker its "
           "own Ray node's address (multi-node clusters; default 127.0.0.1, one node)")
    a("--node-label", default=None, metavar="KEY",
      help="place each pool's workers only on Ray nodes whose label KEY names the pool "
           "(prefill / decode / colocated): the deploy configs label their node groups "
           "pdserve-role. Default: any node with a free GPU")
    a("--device", default=None, help="cpu | cuda (default: cuda when the cluster has GPUs)")
    a("--block-size", type=int, default=16)
    a("--num-blocks", type=int, default=None, help="KV blocks per worker (default: sized by the engine)")
    a("--max-model-len", type=int, default=None)
    a("--max-num-seqs", type=int, default=64, help="sequences per worker batch; also the router's "
                                                  "per-worker request cap")
    a("--max-num-batched-tokens", type=int, default=2048,
      help="tokens per engine step (the prefill chunk size; default 2048)")
    a("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
      help="fcfs: first come, first served; priority: requests' vLLM priority field (lower "
           "first) orders the router's queue and every worker's, and picks who is preempted")
    a("--eager", action="store_true",
      help="on CUDA, run the torch reference ops without Triton kernels or CUDA graphs")
    a("--lease-ttl", type=float, default=30.0, help="seconds a prefill worker pins KV for a reader")
    a("--disagg-threshold", type=int, default=0,
      help="prompts with fewer uncached tokens prefill on the decode worker (0 = never)")
    a("--routing", choices=ROUTING_POLICIES, default="prefix_aware")
    a("--max-inflight", type=int, default=1024,
      help="completions in flight (prompts x n of each request) before 429; a request may "
           "ask for at most 256, and requests take turns at the workers (router/admission.py)")
    a("--retry-budget", type=int, default=2, help="re-dispatches per request after worker failures")
    a("--request-timeout", type=float, default=600.0, help="default deadline of a request (s)")
    a("--prefill-timeout", type=float, default=60.0,
      help="one prefill attempt's limit (s) before it is retried on another prefill worker "
           "(with no other one up, an attempt has the request's whole deadline)")
    a("--stall-timeout", type=float, default=120.0, metavar="SECONDS",
      help="a worker whose engine loop has been in one step this long (s; a hung GPU or "
           "collective) is marked down and its requests go to other workers; twice this "
           "long, it is restarted")
    a("--max-restarts", type=int, default=-1,
      help="restarts of a worker that dies, after a backoff doubling from 0.5 s to 30 s "
           "(-1, the default: no limit)")
    a("--exit-after-unavailable", type=float, default=0.0, metavar="SECONDS",
      help="exit with status 3 once no decode-capable worker has served for this long, so a "
           "supervisor restarts the whole server (default 0: never; the pool keeps restarting)")
    a("--startup-timeout", type=float, default=900.0, help="wait this long for workers (s)")
    a("--drain-timeout", type=float, default=30.0, help="on SIGTERM, wait this long for requests (s)")
    a("--log-level", default="warning", choices=("debug", "info", "warning", "error", "critical"),
      help="the router's and the workers' logging (default warning)")
    a("--log-requests", action="store_true",
      help="log one JSON line per finished completion (logger pdserve.trace, at any --log-level): "
           "its prefill and decode workers, retries, and the time of each stage across the split")
    a("--tool-call-parser", choices=("auto", "hermes", "llama3_json"), default="auto",
      help="the model's tool-call format (default: from its chat template)")
    from pdserve.router.cli import add_speculative_args

    add_speculative_args(p)  # --speculative, --num-speculative-tokens, --mtp-head


def check_serve_args(args: argparse.Namespace) -> str | None:
    """The first bad flag, as a message naming it."""
    mins = [("--replicas", args.replicas, 1)] if args.colocated else \
        [("--prefill", args.prefill, 0), ("--decode", args.decode, 1)]
    mins += [("--prefill-tp", args.prefill_tp, 1), ("--decode-tp", args.decode_tp, 1)]
    for flag, v, least in mins:
        if v < least:
            return f"{flag}: must be >= {least}, got {v}"
    for flag, v in (("--port", args.port), ("--grpc-port", args.grpc_port)):
        if not 0 <= v <= 65535:
            return f"{flag}: must be a port number, got {v}"
    if args.port == args.grpc_port != 0:
        return f"--grpc-port: {args.grpc_port} is --port's too (HTTP and gRPC need one each)"
    if args.device is not None and args.device not in ("cpu", "cuda"):
        return f"--device: must be cpu or cuda, got {args.device!r}"
    for flag, v in (("--max-model-len", args.max_model_len), ("--num-blocks", args.num_blocks),
                    ("--max-num-batched-tokens", args.max_num_batched_tokens)):
        if v is not None and v < 1:
            return f"{flag}: must be >= 1, got {v}"
    if bool(args.tls_cert) != bool(args.tls_key):
        return "--tls-cert/--tls-key: give both or neither"
    for flag, v in (("--max-inflight", args.max_inflight), ("--max-num-seqs", args.max_num_seqs),
                    ("--block-size", args.block_size)):
        if v < 1:
            return f"{flag}: must be >= 1, got {v}"
    if args.retry_budget < 0 or args.disagg_threshold < 0:
        return "--retry-budget/--disagg-threshold: must be >= 0"
    if args.colocated and args.prefill_tp != 1:
        return "--prefill-tp: --colocated runs no prefill workers (--decode-tp sets their size)"
    if not args.prefill_timeout > 0:
        return f"--prefill-timeout: must be > 0 seconds, got {args.prefill_timeout}"
    if not args.stall_timeout >= MIN_STALL_TIMEOUT_S:  # a worker's busy Health takes 2 s
        return (f"--stall-timeout: must be >= {MIN_STALL_TIMEOUT_S:g} seconds (a slow step "
                f"must not pass for a hung one), got {args.stall_timeout}")
    if not args.tp_timeout > 0:
        return f"--tp-timeout: must be > 0 seconds, got {args.tp_timeout}"
    if args.node_label is not None and not LABEL_KEY.fullmatch(args.node_label):
        return (f"--node-label: a Ray node label key (letters, digits, '-', '_', '.', at "
                f"most 63), got {args.node_label!r}")
    if args.max_restarts < -1:
        return f"--max-restarts: must be >= -1 (-1 = no limit), got {args.max_restarts}"
    if not args.exit_after_unavailable >= 0:
        return f"--exit-after-unavailable: must be >= 0 seconds, got {args.exit_after_unavailable}"
    if args.cluster_secret_file:
        from pdserve.proto.rpc import read_secret_file

        try:
            read_secret_file(args.cluster_secret_file)
        except ValueError as e:
            return str(e)
    from pdserve.router.cli import check_speculative

    # a joined cluster (--address) may keep the head file on the worker nodes only
    return check_speculative(args, check_files=not args.address)


def gpu_shortfall(args: argparse.Namespace, gpus: float) -> str | None:
    """On CUDA every worker rank takes a whole GPU: a cluster with fewer GPUs than the flags
    ask for would leave workers pending in Ray until --startup-timeout. The message names the
    flags and the way out."""
    from pdserve.router.cli import role_tp, worker_roles

    roles, tps = worker_roles(args), role_tp(args)
    need = sum(n * tps[role] for role, n in roles)
    asked = " ".join(f"--{'replicas' if role == 'colocated' else role} {n}" for role, n in roles)
    if any(tps[role] > 1 for role, _ in roles):
        asked += f" (TP {' and '.join(str(tps[role]) for role, _ in roles)})"
    if gpus >= need:
        return None
    if gpus < 1:
        return (f"--device cuda: this Ray cluster has no GPU ({asked} needs {need}); run on "
                "CPU (--device cpu) or join a cluster with GPUs (--address)")
    return (f"{asked}: needs {need} GPUs, one per worker rank, and this Ray cluster has "
            f"{gpus:g}. On one GPU serve with --colocated; or join a larger cluster "
            "(--address), or run on CPU (--device cpu)")


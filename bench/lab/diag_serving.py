"""The serving tax: inter-token latency through a real worker's gRPC streams vs its engine steps.

    python -m bench.lab.diag_serving [--streams 1,24] [--prompt-len 5120] [--out F.json]

One colocated Worker in this process (engine loop thread + gRPC server on loopback),
N client threads each with one Decode stream (random prompt, ignore_eos). For each N it
records, over the window in which all N streams decode at once: the clients' mean ITL, the
engine's mean step interval (EngineStats.steps over the same window) and, if --py-spy is
given, a sampled profile of the worker's threads (py-spy record --nonblocking, raw folded
stacks; without --nonblocking py-spy stops the process for every sample, which on an H100
made a 13 ms step look like 27-40 ms). If
client ITL is well above the step interval, the host side of serving (stream threads, gRPC,
metrics) is what delays tokens; if the step interval itself grows with N beyond what the
engine alone does (bench/lab/diag_batch.py), serving work is stealing the engine thread's time.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import torch

from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pbg
from pdserve.proto.rpc import make_channel, new_cluster_secret
from pdserve.worker.config import WorkerConfig
from pdserve.worker.server import Worker

from bench.lab.engine_probes import log, random_prompts
from bench.lab.kernel_bench import emit


def stream_times(stub, rid: str, prompt: list[int], max_tokens: int, out: dict) -> None:
    params = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    req = pb.DecodeRequest(request_id=rid, prompt_token_ids=prompt, params=params,
                           timeout_s=600)
    times = []
    for msg in stub.Decode(req, timeout=620):
        now = time.monotonic()
        times += [now] * len(msg.token_ids)
    out[rid] = times


def client_main(address: str, n: int, prompt_len: int, vocab: int, max_tokens: int,
                out_path: str) -> None:
    """The clients, in their own process (as in a deployment: the router is another process),
    so their threads do not compete for the worker's GIL."""
    # the worker process hands its cluster secret to this client through the environment
    stub = pbg.WorkerStub(make_channel(address, cluster_secret=os.environ["PDSERVE_DIAG_SECRET"]))
    results: dict = {}
    threads = [threading.Thread(target=stream_times, args=(stub, f"s{n}-{i}", p, max_tokens,
                                                           results))
               for i, p in enumerate(random_prompts(n, prompt_len, vocab, 11 + n))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with open(out_path, "w") as f:
        json.dump(results, f)


def one_run(rt: Worker, n: int, prompt_len: int, max_tokens: int,
            py_spy: str | None, out_dir: str) -> dict:
    vocab = rt.engine.config.model.vocab_size
    path = os.path.join(out_dir, f"client_{n}.json")
    client = subprocess.Popen([sys.executable, "-m", "bench.lab.diag_serving", "--client",
                               rt.address, "--n", str(n), "--prompt-len", str(prompt_len),
                               "--max-tokens", str(max_tokens), "--vocab", str(vocab),
                               "--out", path],
                              env={**os.environ, "PDSERVE_DIAG_SECRET": rt.cfg.cluster_secret})
    ahead = rt.engine.runner.ahead
    hits0 = (ahead.hits, ahead.discards) if ahead is not None else (0, 0)
    steps: list[tuple[float, int, dict]] = []
    prof = None
    while client.poll() is None:
        steps.append((time.monotonic(), rt.engine.stats.steps, dict(rt.engine.stats.host_s)))
        if py_spy and prof is None and _all_started(rt, n):
            prof = subprocess.Popen([py_spy, "record", "-p", str(os.getpid()), "-d", "6",
                                     "-r", "200", "-f", "raw", "--idle", "--threads", "--nonblocking",
                                     "-o", os.path.join(out_dir, f"pyspy_{n}.txt")],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(0.005)
    if prof is not None:
        prof.wait(30)
    with open(path) as f:
        results = json.load(f)
    lo = max(ts[0] for ts in results.values())  # every stream has its first token
    hi = min(ts[-1] for ts in results.values())  # none has finished
    itl = [b - a for ts in results.values() for a, b in zip(ts, ts[1:]) if lo <= a and b <= hi]
    inside = [(t, s, h) for t, s, h in steps if lo <= t <= hi]
    step_ms, phases = None, {}
    if len(inside) > 1:
        n_steps = max(1, inside[-1][1] - inside[0][1])
        step_ms = 1e3 * (inside[-1][0] - inside[0][0]) / n_steps
        phases = {k: round(1e3 * (v - inside[0][2].get(k, 0.0)) / n_steps, 3)
                  for k, v in inside[-1][2].items()}
    row = {"streams": n, "prompt_len": prompt_len, "window_s": hi - lo,
           "client_itl_ms_mean": 1e3 * statistics.mean(itl) if itl else None,
           "client_itl_ms_p50": 1e3 * statistics.median(itl) if itl else None,
           "engine_step_ms_mean": step_ms, "engine_phase_ms_per_step": phases,
           "overlap_hits_discards": [ahead.hits - hits0[0], ahead.discards - hits0[1]]
           if ahead is not None else None}
    log(f"{n} streams: client ITL {row['client_itl_ms_mean']} ms, engine step {step_ms} ms, "
        f"overlap {row['overlap_hits_discards']}, phases {phases}")
    return row


def _all_started(rt: Worker, n: int) -> bool:
    return rt.engine.scheduler.num_running >= n and rt.engine.scheduler.num_waiting == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--streams", default="1,24")
    ap.add_argument("--prompt-len", type=int, default=5120)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--py-spy", default=None, help="path of a py-spy binary: profile each run")
    ap.add_argument("--out", default=None)
    ap.add_argument("--switch-interval-ms", type=float, default=None,
                    help="sys.setswitchinterval for this (worker) process")
    ap.add_argument("--client", default=None, help=argparse.SUPPRESS)  # internal: client side
    ap.add_argument("--n", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        return client_main(args.client, args.n, args.prompt_len, args.vocab, args.max_tokens,
                           args.out)
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    cuda = torch.cuda.is_available()
    streams = [int(s) for s in args.streams.split(",")]
    need = max(streams) * (args.prompt_len + args.max_tokens + 32)
    cfg = WorkerConfig.of("colocated", "diag", new_cluster_secret(), model=args.model or
                       ("qwen3-8b" if cuda else "tiny-qwen3"), device="cuda" if cuda else "cpu",
                       dtype="bfloat16" if cuda else None, num_blocks=need // 16 + 64,
                       max_num_seqs=max(64, max(streams)), max_num_batched_tokens=8192,
                       max_model_len=args.prompt_len + args.max_tokens + 16,
                       enable_prefix_caching=False, use_triton=cuda, use_cuda_graphs=cuda,
                       metrics_port=-1)
    rt = Worker(cfg).start()
    out_dir = os.path.dirname(os.path.abspath(args.out)) if args.out else "."
    try:
        one_run(rt, 2, 64, 8, None, out_dir)  # warm-up
        rows = [one_run(rt, n, args.prompt_len, args.max_tokens, args.py_spy, out_dir)
                for n in streams]
    finally:
        rt.stop()
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu",
           "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "model": cfg.engine.model, "switch_interval_s": sys.getswitchinterval(), "runs": rows}
    emit(res, args.out)


if __name__ == "__main__":
    main()

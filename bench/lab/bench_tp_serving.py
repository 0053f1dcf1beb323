"""A serving tensor-parallel worker's decode speed with and without CUDA graphs (GPU).

    python -m bench.lab.bench_tp_serving [--model qwen3-8b] [--tp 2] [--streams 1,8]
        [--max-tokens 256] [--out F.json]

One decode worker of --tp ranks (worker/tp_worker.py launch_tp_worker: Ray actors, one GPU
each, NCCL between them, NIXL transports), launched as `pdserve serve --decode-tp N` launches
it, once eager and once with CUDA graphs. For each stream count N, N gRPC Decode streams
(random prompts, greedy, ignore_eos) run at once; the result is each stream's inter-token
time over the window in which all N decode, and the aggregate tokens/s. Start-up time
(load, capture, warm-up) is recorded too. Writes JSON naming the device, command and date.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout


def log(msg: str) -> None:
    print(f"[bench_tp_serving {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def stream(stub, rid: str, prompt: list[int], max_tokens: int, out: dict) -> None:
    """One greedy Decode stream: the arrival time of each token."""
    from pdserve.proto import pdserve_pb2 as pb

    params = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    req = pb.DecodeRequest(request_id=rid, prompt_token_ids=prompt, params=params,
                           timeout_s=600)
    times: list[float] = []
    for msg in stub.Decode(req, timeout=620):
        times += [time.monotonic()] * len(msg.token_ids)
    out[rid] = times


def measure(stub, n: int, prompt_len: int, vocab: int, max_tokens: int, tag: str) -> dict:
    """N streams at once: ITL over the window where all N decode, aggregate tok/s there."""
    import torch

    g = torch.Generator().manual_seed(n)
    prompts = [torch.randint(10, vocab - 10, (prompt_len,), generator=g).tolist()
               for _ in range(n)]
    out: dict = {}
    threads = [threading.Thread(target=stream, args=(stub, f"{tag}-{n}-{i}", p, max_tokens, out))
               for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=900)
    lo = max(ts[0] for ts in out.values())  # every stream has its first token
    hi = min(ts[-1] for ts in out.values())  # none has finished
    itl = [b - a for ts in out.values() for a, b in zip(ts, ts[1:]) if lo <= a and b <= hi]
    tokens = sum(1 for ts in out.values() for t in ts if lo < t <= hi)
    row = {"streams": n, "prompt_len": prompt_len, "max_tokens": max_tokens,
           "window_s": round(hi - lo, 4),
           "itl_ms_p50": round(1e3 * statistics.median(itl), 3) if itl else None,
           "itl_ms_mean": round(1e3 * statistics.mean(itl), 3) if itl else None,
           "tok_s_per_stream": round(1 / statistics.mean(itl), 1) if itl else None,
           "tok_s_total": round(tokens / (hi - lo), 1) if hi > lo else None}
    log(f"{tag}: {n} streams: ITL p50 {row['itl_ms_p50']} ms, {row['tok_s_total']} tok/s total")
    return row


def run_worker(args: argparse.Namespace, graphs: bool) -> dict:
    """Launch the TP worker (eager or with graphs), measure each stream count, shut down."""
    import ray

    from pdserve.proto import pdserve_pb2_grpc as pbg
    from pdserve.proto.rpc import make_channel, new_cluster_secret
    from pdserve.worker.config import WorkerConfig
    from pdserve.worker.tp_group import remove_previous
    from pdserve.worker.tp_worker import launch_tp_worker

    tag = "graphs" if graphs else "eager"
    secret = new_cluster_secret()
    cfg = WorkerConfig.of("decode", f"tp-{tag}", secret, metrics_port=0, model=args.model,
                          device="cuda", dtype="bfloat16", tensor_parallel_size=args.tp,
                          block_size=16, num_blocks=args.num_blocks,
                          max_num_seqs=max(args.streams), max_model_len=args.max_model_len,
                          use_triton=True, use_cuda_graphs=graphs, host="127.0.0.1",
                          tp_timeout_s=120.0)
    start = time.monotonic()
    actor = launch_tp_worker(cfg, num_gpus=1, num_cpus=1)
    try:
        ep = ray.get(actor.endpoints.remote(), timeout=900)
        startup_s = time.monotonic() - start
        log(f"{tag}: worker up in {startup_s:.1f} s")
        stub = pbg.WorkerStub(make_channel(ep["grpc_address"], cluster_secret=secret))
        measure(stub, 1, 16, args.vocab, 16, f"{tag}-warm")  # first requests: not timed
        rows = [measure(stub, n, args.prompt_len, args.vocab, args.max_tokens, tag)
                for n in args.streams]
        replays = ray.get(actor.graph_replays.remote(), timeout=60)
        peer = ray.get(actor.peer_all_reduce.remote(), timeout=60)
        return {"cuda_graphs": graphs, "startup_s": round(startup_s, 1),
                "rank0_graph_replays": replays, "peer_all_reduce": peer, "runs": rows}
    finally:
        try:
            ray.get(actor.shutdown.remote(), timeout=60)
        except Exception as e:  # noqa: BLE001 - killed below either way
            log(f"{tag}: shutdown: {e!r}")
        ray.kill(actor, no_restart=True)
        # the placement group too, now: shutdown() removes it on a timer that the kill above
        # can cut short, and the next worker's group would wait for its GPUs
        remove_previous(cfg.worker_id, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--num-blocks", type=int, default=2048)
    ap.add_argument("--modes", default="eager,graphs")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.streams = [int(s) for s in args.streams.split(",")]
    import torch

    from pdserve.engine.model.loader import load_tokenizer_and_config
    from pdserve.worker.local_ray import start_local_ray

    args.vocab = load_tokenizer_and_config(args.model)[1].vocab_size
    start_local_ray(include_dashboard=False, log_to_driver=False, configure_logging=False)
    results = {mode: run_worker(args, mode == "graphs") for mode in args.modes.split(",")}
    out = {"what": "a serving TP decode worker's batch-1 and batched decode, eager vs CUDA "
                   "graphs on every rank (worker/tp_worker.py through gRPC)",
           "device": f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}",
           "command": " ".join(["python", "-m", "bench.lab.bench_tp_serving", *sys.argv[1:]]),
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "model": args.model, "tp": args.tp,
           "results": results}
    print(json.dumps(out, indent=1), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

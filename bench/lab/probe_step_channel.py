"""What one lockstep step message costs (CPU): the step channel's TCP streams against the gloo
broadcasts it replaced (engine/dist/step_channel.py says why).

    python -m bench.lab.probe_step_channel --out bench/results/step_channel_cpu_X.json

Two processes joined as a TP 2 group on loopback. Each sends (rank 0) or receives (rank 1)
500 step messages the size of a batch-1 decode FORWARD (a 20-value header and a 300-value
payload, int64), back to back after 50 warm-ups, once over the group's step channel and once
over its gloo control group, and reports the microseconds per message on each rank: rank 0's
is what the leader's host spends before it can launch its own forward.
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import socket
import sys
import time

import torch

MESSAGES, WARMUP, HEADER, PAYLOAD = 500, 50, 20, 300


def _gloo_broadcast(group, t: torch.Tensor) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.control.broadcast([t], opts).wait(group.timeout)


def _rank(rank: int, port: int, out: mp.Queue) -> None:
    from pdserve.engine.dist.config import ParallelConfig
    from pdserve.engine.dist.group import TPGroup

    torch.set_num_threads(1)
    group = TPGroup(ParallelConfig(2, rank, "gloo", f"tcp://127.0.0.1:{port}", 30.0))
    header = torch.zeros(HEADER, dtype=torch.int64)
    payload = torch.zeros(PAYLOAD, dtype=torch.int64)
    res = {}
    for name, send in (("step_channel", group.broadcast_control),
                       ("gloo_broadcast", lambda t: _gloo_broadcast(group, t))):
        for _ in range(WARMUP):
            send(header), send(payload)
        group.barrier()
        t0 = time.perf_counter()
        for _ in range(MESSAGES):
            send(header), send(payload)
        res[name] = 1e6 * (time.perf_counter() - t0) / MESSAGES
        group.barrier()
    out.put((rank, res))
    group.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    result = {
        "benchmark": "lockstep step message, step channel (TCP) vs gloo broadcast",
        "device": f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "command": " ".join([sys.executable, "-m", "bench.lab.probe_step_channel"]
                            + sys.argv[1:]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__, "messages": MESSAGES,
        "message_int64": [HEADER, PAYLOAD],
        "us_per_message": {f"rank{r}": v for r, v in sorted(got.items())},
        "reading": "rank 0: the leader's host time per message (what delays its forward); "
                   "rank 1: the follower's receive loop, bounded by the leader's rate",
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result["us_per_message"], indent=2))


if __name__ == "__main__":
    main()

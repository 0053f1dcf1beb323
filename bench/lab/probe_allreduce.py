"""What one decode-step all-reduce costs between two GPUs (issue 26), apart from the model.

    python -m bench.lab.probe_allreduce --out $OUT/allreduce.json     # needs 2 GPUs
    python -m bench.lab.probe_allreduce --comm direct --no-symm --out $OUT/direct.json
    python -m bench.lab.probe_allreduce --comm none --out $OUT/symm.json   # symm_mem only
    python -m bench.lab.probe_allreduce --comm push --out $OUT/push.json   # our push kernel

Two processes, one GPU each. For hidden rows [T, 4096] bf16 (T = 1, 64, 256: a Qwen3-8B
decode step's all-reduce at those batch sizes), per all-reduce:
  * nccl_eager: TPGroup.all_reduce (the engine's path: ProcessGroupNCCL on the current
    stream), or with --comm direct NCCL called directly (bench/lab/nccl_direct.py), 200 back
    to back, timed by CUDA events on rank 0;
  * nccl_graph: 73 of them (a 36-layer step: the embedding + 2 per layer) captured in one
    CUDA graph, replayed 20 times: what a decode graph's collectives cost;
  * symm_mem_one_shot_graph: torch's symmetric-memory one-shot all-reduce (each GPU reads its
    peer's buffer over NVLink; no multicast), the same 73 per graph, when this torch has it.
Multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys

import torch

PER_STEP = 73  # Qwen3-8B: embedding + 36 layers x (after o_proj, after the MLP)
ROWS = (1, 64, 256)
HIDDEN = 4096
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}


def _time(fn, reps: int) -> float:
    """Milliseconds per call of fn (after 3 warm-ups), by CUDA events."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def _graph(body) -> torch.cuda.CUDAGraph:
    for _ in range(2):
        body()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    return g


def _group(rank: int, port: int, comm: str):
    """(all_reduce(x), close()) of this rank: the engine's TPGroup (torch's NCCL process
    group), or NCCL called directly (bench/lab/nccl_direct.py)."""
    from pdserve.engine.dist.config import ParallelConfig
    from pdserve.engine.dist.group import TPGroup, open_store

    cfg = ParallelConfig.for_device(2, rank, f"tcp://127.0.0.1:{port}", f"cuda:{rank}", 60.0)
    if comm in ("torch", "push"):  # push: graph captures take kernels/push_all_reduce.py
        if comm == "push":
            cfg = cfg.with_graphs(True)
        group = TPGroup(cfg)
        return group.all_reduce, group.close
    from bench.lab.nccl_direct import DirectComm

    store = open_store(cfg)
    direct = DirectComm.join(rank, 2, store, torch.device(f"cuda:{rank}"))
    return direct.all_reduce, direct.close


def _nccl(rank: int, port: int, rows: tuple[int, ...], comm: str = "torch") -> dict:
    all_reduce, close = _group(rank, port, comm)
    print(f"rank {rank}: joined ({comm})", flush=True)
    out = {}
    for t in rows:
        x = torch.ones(t, HIDDEN, dtype=torch.bfloat16, device=f"cuda:{rank}")
        all_reduce(x)
        torch.cuda.synchronize()
        print(f"rank {rank}: all-reduce of {t} rows gives {x[0, 0].item()}", flush=True)
        eager = _time(lambda: all_reduce(x), 200)
        print(f"rank {rank}: {t} rows eager {1e3 * eager:.1f} us", flush=True)

        def step() -> None:  # (pdl: TPGroup's push kernels chain, as behind the GEMVs)
            for i in range(PER_STEP):
                all_reduce(x, pdl=i > 0) if comm == "push" else all_reduce(x)
        g = _graph(step)
        graph = _time(g.replay, 20) / PER_STEP
        out[t] = {"nccl_eager_us": 1e3 * eager, "nccl_graph_us": 1e3 * graph}
        print(f"rank {rank}: {t} rows in a graph {1e3 * graph:.1f} us", flush=True)
    del g  # the graphs go before the communicator (pytorch/pytorch#115388)
    torch.cuda.synchronize()
    close()
    print(f"rank {rank}: closed", flush=True)
    return out


def _symm(rank: int, port: int, rows: tuple[int, ...]) -> dict:
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, device_id=torch.device(f"cuda:{rank}"))
    try:
        import torch.distributed._symmetric_memory as symm_mem

        name = dist.group.WORLD.group_name
        out = {}
        for t in rows:
            buf = symm_mem.empty(t, HIDDEN, dtype=torch.bfloat16, device=f"cuda:{rank}")
            symm_mem.rendezvous(buf, name)
            print(f"rank {rank}: symmetric buffer of {t} rows joined", flush=True)
            buf.fill_(1)
            y = torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", name)
            ok = bool((y == 2).all())
            print(f"rank {rank}: one-shot all-reduce sum correct: {ok}", flush=True)

            def step() -> None:
                for _ in range(PER_STEP):
                    torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", name)
            g = _graph(step)
            out[t] = {"symm_mem_one_shot_graph_us": 1e3 * _time(g.replay, 20) / PER_STEP,
                      "sum_correct": ok}
        return out
    except Exception as e:  # noqa: BLE001 - this torch or machine lacks it: say so
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    finally:
        dist.destroy_process_group()


def rank_main(rank: int, port: int, port2: int, out_path: str, rows: tuple[int, ...],
              symm: bool, comm: str) -> None:
    torch.cuda.set_device(rank)
    res = {"nccl": _nccl(rank, port, rows, comm) if comm != "none" else {}}
    # written after each part: a hang keeps the first
    for part in ("nccl", "symm_mem") if symm else ("nccl",):
        if part == "symm_mem":
            res[part] = _symm(rank, port2, rows)
        if rank == 0:
            print(f"rank 0: {part} {json.dumps(res[part])}", flush=True)
            with open(out_path, "w") as f:
                json.dump(res, f)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default=",".join(map(str, ROWS)),
                    help="hidden rows per all-reduce, comma-separated")
    ap.add_argument("--no-symm", action="store_true", help="NCCL only")
    ap.add_argument("--comm", choices=("torch", "push", "direct", "none"),
                    default="torch", help="torch's NCCL process group (the engine's TPGroup), "
                    "the same with its push kernel inside graphs (kernels/push_all_reduce.py), "
                    "NCCL called directly (bench/lab/nccl_direct.py), or none (symm_mem only)")
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ports", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank is not None:
        p1, p2 = map(int, args.ports.split(","))
        rank_main(args.rank, p1, p2, args.out + ".rank0",
                  tuple(int(r) for r in args.rows.split(",")), not args.no_symm, args.comm)
        return
    if torch.cuda.device_count() < 2:
        sys.exit("probe_allreduce: needs 2 CUDA devices")
    ports = f"{_port()},{_port()}"
    env = {**os.environ, **MULTICAST_OFF}
    extra = ["--rows", args.rows, "--comm", args.comm] + (["--no-symm"] if args.no_symm else [])
    procs = [subprocess.Popen([sys.executable, "-m", "bench.lab.probe_allreduce", "--out",
                               args.out, "--rank", str(r), "--ports", ports, *extra], env=env)
             for r in range(2)]
    try:
        codes = [p.wait(timeout=120) for p in procs]
    except subprocess.TimeoutExpired:
        codes = ["timed out after 120 s"]
    finally:
        for p in procs:
            p.kill()
    try:
        with open(args.out + ".rank0") as f:
            res = json.load(f)
        os.remove(args.out + ".rank0")
    except FileNotFoundError:
        res = {"error": "rank 0 wrote nothing (see its log)"}
    result = {"benchmark": "decode-step all-reduce between two GPUs (issue 26)",
              "device": f"2x {torch.cuda.get_device_name(0)}",
              "command": " ".join([sys.executable, "-m", "bench.lab.probe_allreduce"]
                                  + sys.argv[1:]),
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "torch": torch.__version__, "env": MULTICAST_OFF, "hidden": HIDDEN,
              "comm": args.comm,
              "all_reduces_per_step": PER_STEP, "exit_codes": codes, "rows": res}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""Benchmark: move one prompt's KV cache between two processes with NixlKVTransport.

A prefill process holds the KV on cuda:0, a decode process pulls it into cuda:1 with
read_blocks (NIXL READ over UCX), exactly as the workers do (on a one-GPU host both live on
cuda:0: the read crosses processes, not GPUs). The same run records a torch peer copy
(cuda:0 -> cuda:1, same bytes) as the ceiling. Scenarios vary how the blocks lie
(one contiguous run, shuffled runs of --frag-run blocks, no coalescing at all) and the
descriptor mode, because descriptor count dominates transfer time (DESIGN.md).

    python bench/lab/bench_kv_transfer.py                      # Qwen3-8B shape, 10,000 tokens, GPUs
    python bench/lab/bench_kv_transfer.py --device cpu --tokens 512 --preset tiny

Writes JSON {device, command, date, env, config, results} to --out
(default bench/results/kv_transfer_<date>.json). UCX_TLS is set here explicitly
(cuda_ipc,cuda_copy,tcp on GPU, measured fastest) and recorded with every UCX_*/NIXL_* var.
"""
from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import math
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout

GPU_UCX_TLS = "cuda_ipc,cuda_copy,tcp"
TINY = dict(arch="llama", vocab_size=128, hidden_size=32, num_layers=3, num_heads=4,
            num_kv_heads=2, head_dim=8, intermediate_size=64)
SCENARIOS = {  # name -> (block placement, descriptor mode, max descriptor bytes)
    "contiguous": ("contiguous", "coalesced", None),
    "contiguous_prepped": ("contiguous", "prepped", None),
    "contiguous_cap16MiB": ("contiguous", "coalesced", 16 << 20),
    "fragmented": ("fragmented", "coalesced", None),
    "fragmented_prepped": ("fragmented", "prepped", None),
    "per_block": ("contiguous", "coalesced", "block"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--preset", default="qwen3-8b", help="engine preset name or 'tiny'")
    p.add_argument("--tokens", type=int, default=10_000)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default=None, help="KV dtype (default bfloat16 on GPU, "
                   "float32 on CPU)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--frag-run", type=int, default=4, help="blocks per run when fragmented")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--ucx-tls", default=None, help=f"UCX_TLS (default {GPU_UCX_TLS} on GPU, "
                   "UCX's own choice on CPU; '' leaves it unset)")
    p.add_argument("--timeout", type=float, default=600, help="seconds for any one step")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    for name in ("tokens", "block_size", "reps", "frag_run"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be >= 1")
    unknown = set(args.scenarios.split(",")) - set(SCENARIOS)
    if unknown:
        p.error(f"--scenarios: unknown {sorted(unknown)}; known {list(SCENARIOS)}")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    return args


def model_config(preset: str) -> Any:
    from pdserve.engine.core.config import ModelConfig
    if preset == "tiny":
        return ModelConfig(**TINY)
    from pdserve.engine.model.presets import get_preset
    return get_preset(preset)


def progress(msg: str) -> None:
    print(f"[bench_kv_transfer] {msg}", file=sys.stderr, flush=True)


# ---- worker processes ---------------------------------------------------------------------

def _kv_setup(args: argparse.Namespace, device: str) -> tuple[Any, dict]:
    import torch

    from pdserve.engine.core.config import CacheConfig, compat_payload
    from pdserve.engine.exec.kv_cache import allocate_kv_cache
    model = model_config(args.preset)
    num_blocks = math.ceil(args.tokens / args.block_size)
    cache = CacheConfig(block_size=args.block_size, num_blocks=num_blocks, kv_dtype=args.dtype)
    # the engine's own layout (heads outermost in a block), so the compat check applies
    kv = allocate_kv_cache(model, num_blocks, args.block_size, getattr(torch, args.dtype), device)
    return kv, compat_payload(model, cache)


def _digest(kv: Any, block_id: int) -> str:
    import torch
    return hashlib.sha256(kv[block_id].view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def devices(args: argparse.Namespace) -> tuple[str, str]:
    """(prefill device, decode device): two GPUs when there are two, else one for both."""
    if args.device != "cuda":
        return "cpu", "cpu"
    import torch
    return "cuda:0", "cuda:1" if torch.cuda.device_count() >= 2 else "cuda:0"


def sample_blocks(n: int) -> list[int]:
    return sorted({0, n // 3, n // 2, n - 1})


def prefill_main(conn: Any, args: argparse.Namespace) -> None:
    try:
        import torch

        from pdserve.kv_transfer import NixlKVTransport
        device = devices(args)[0]
        kv, compat = _kv_setup(args, device)
        gen = torch.Generator(device=device).manual_seed(0)
        for b in range(kv.shape[0]):  # block by block: no huge temporaries
            kv[b].normal_(generator=gen)
        transport = NixlKVTransport(kv, "bench-prefill", compat, role="prefill")
        digests = {b: _digest(kv, b) for b in sample_blocks(kv.shape[0])}
        conn.send(("ready", transport.peer_info().to_bytes(), digests))
        conn.poll(args.timeout * 10)  # until told to stop (or the parent is long gone)
        transport.close()
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def placement(kind: str, n: int, run: int) -> tuple[list[int], list[int]]:
    """(remote ids, local ids): remote is the prompt's blocks in order; local is contiguous
    or made of runs of `run` blocks laid out in reverse order (a fragmented free list on the
    decode side), so no two runs join: exactly ceil(n / run) descriptors."""
    remote = list(range(n))
    if kind == "contiguous":
        return remote, list(remote)
    local = []
    for start in range(0, n, run):  # run [start, end) lands at [n - end, n - start)
        end = min(start + run, n)
        local += range(n - end, n - start)
    return remote, local


def run_scenario(args: argparse.Namespace, kv: Any, compat: dict, info: Any, name: str,
                 digests: dict, send: Any) -> dict:
    from pdserve.kv_transfer import NixlKVTransport
    kind, mode, cap = SCENARIOS[name]
    block_bytes = kv[0].numel() * kv.element_size()
    cap_bytes = block_bytes if cap == "block" else cap
    if cap_bytes is not None:
        cap_bytes = max(cap_bytes, block_bytes)
    remote, local = placement(kind, kv.shape[0], args.frag_run)
    kv.zero_()
    t = NixlKVTransport(kv, "bench-decode", compat, role="decode", descriptor_mode=mode,
                        max_descriptor_bytes=cap_bytes)
    try:
        t.add_peer(info)
        warm_up_s = t.warm_up(info.worker_id, info.incarnation, time.monotonic() + args.timeout)
        times, stats = [], None
        for i in range(args.warmup + args.reps):
            stats = t.read_blocks(info.worker_id, info.incarnation, remote, local,
                                  time.monotonic() + args.timeout)
            if i >= args.warmup:
                times.append(stats.seconds)
            send(f"{name}: rep {i + 1}/{args.warmup + args.reps} "
                 f"{stats.seconds * 1e3:.2f} ms, {stats.gb_per_s:.1f} GB/s"
                 + (" (warm-up)" if i < args.warmup else ""))
    finally:
        t.close()
    where = dict(zip(remote, local))
    verified = all(_digest(kv, where[b]) == d for b, d in digests.items())
    median = statistics.median(times)
    return {"scenario": name, "placement": kind, "descriptor_mode": mode,
            "max_descriptor_bytes": cap_bytes, "descriptors": stats.descriptors,
            "blocks": stats.blocks, "bytes": stats.bytes, "median_s": median,
            "min_s": min(times), "max_s": max(times), "gb_per_s": stats.bytes / median / 1e9,
            "reps_s": times, "first_read_warm_up_s": warm_up_s, "verified": verified}


def peer_copy(args: argparse.Namespace, nbytes: int, send: Any) -> dict:
    """torch copy of the same bytes: cuda:0 -> cuda:1 on GPU, host memcpy on CPU."""
    import torch
    src_dev, dst_dev = devices(args)
    src = torch.ones(nbytes, dtype=torch.uint8, device=src_dev)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_dev)

    def sync() -> None:
        if args.device == "cuda":
            torch.cuda.synchronize(src_dev)
            torch.cuda.synchronize(dst_dev)

    times = []
    for i in range(args.warmup + args.reps):
        sync()
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    send(f"peer copy {src_dev} -> {dst_dev}: {nbytes / statistics.median(times) / 1e9:.1f} GB/s")
    return {"src": src_dev, "dst": dst_dev, "bytes": nbytes, "median_s": statistics.median(times),
            "gb_per_s": nbytes / statistics.median(times) / 1e9, "reps_s": times,
            "peer_access": (torch.cuda.can_device_access_peer(0, 1)
                            if src_dev != dst_dev else None)}


def decode_main(conn: Any, args: argparse.Namespace, info_bytes: bytes, digests: dict) -> None:
    def send(msg: str) -> None:
        conn.send(("progress", msg))

    try:
        from pdserve.kv_transfer import PeerInfo
        device = devices(args)[1]
        kv, compat = _kv_setup(args, device)
        info = PeerInfo.from_bytes(info_bytes)
        results = [run_scenario(args, kv, compat, info, name, digests, send)
                   for name in args.scenarios.split(",")]
        nbytes = kv.numel() * kv.element_size()
        copy = peer_copy(args, nbytes, send)
        conn.send(("result", {"scenarios": results, "peer_copy": copy}))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


# ---- orchestration ------------------------------------------------------------------------

def _expect(conn: Any, timeout: float, what: str) -> tuple:
    while True:
        if not conn.poll(timeout):
            raise TimeoutError(f"{what}: no answer in {timeout} s")
        msg = conn.recv()
        if msg[0] == "error":
            raise RuntimeError(f"{what} failed:\n{msg[1]}")
        if msg[0] != "progress":
            return msg
        progress(msg[1])


def configure_env(args: argparse.Namespace) -> dict:
    """UCX/NIXL settings, applied here so the spawned workers inherit them; returns all set."""
    tls = args.ucx_tls if args.ucx_tls is not None else (
        GPU_UCX_TLS if args.device == "cuda" else None)
    if tls:
        os.environ["UCX_TLS"] = tls
    elif tls == "":
        os.environ.pop("UCX_TLS", None)
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(("UCX_", "NIXL_"))}


def device_name(device: str) -> str:
    import torch
    if device == "cuda":
        return " + ".join(torch.cuda.get_device_name(i)
                          for i in range(min(2, torch.cuda.device_count())))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return "cpu: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu: " + (platform.processor() or platform.machine())


def run(args: argparse.Namespace) -> dict:
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here; use --device cpu")
    env = configure_env(args)
    ctx = mp.get_context("spawn")
    p_conn, p_child = ctx.Pipe()
    d_conn, d_child = ctx.Pipe()
    prefill = ctx.Process(target=prefill_main, args=(p_child, args), daemon=True)
    decode = None
    try:
        prefill.start()
        progress(f"prefill process: filling {args.tokens} tokens of KV on {devices(args)[0]}")
        _, info_bytes, digests = _expect(p_conn, args.timeout, "prefill process")
        decode = ctx.Process(target=decode_main, args=(d_child, args, info_bytes, digests),
                             daemon=True)
        decode.start()
        progress("decode process: pulling KV")
        _, results = _expect(d_conn, args.timeout, "decode process")
    finally:
        if prefill.is_alive():
            p_conn.send(("stop",))
        for proc in (decode, prefill):
            if proc is not None:
                proc.join(timeout=60)
                if proc.is_alive():
                    proc.kill()
    model = model_config(args.preset)
    return {"device": device_name(args.device), "command": " ".join([sys.executable] + sys.argv),
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "env": env, "versions": _versions(),
            "config": {"preset": args.preset, "tokens": args.tokens,
                       "block_size": args.block_size, "dtype": args.dtype,
                       "num_kv_layers": model.num_kv_layers, "num_kv_heads": model.num_kv_heads,
                       "head_dim": model.head_dim, "reps": args.reps, "warmup": args.warmup,
                       "frag_run": args.frag_run, "device": args.device},
            "results": results}


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for pkg in ("torch", "nixl"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    out = Path(args.out or f"bench/results/kv_transfer_{dt.date.today().isoformat()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    copy = report["results"]["peer_copy"]
    print(f"{'scenario':<22}{'descs':>7}{'median ms':>11}{'GB/s':>9}  verified")
    for r in report["results"]["scenarios"]:
        print(f"{r['scenario']:<22}{r['descriptors']:>7}{r['median_s'] * 1e3:>11.2f}"
              f"{r['gb_per_s']:>9.1f}  {r['verified']}")
    print(f"{'torch peer copy':<22}{'':>7}{copy['median_s'] * 1e3:>11.2f}{copy['gb_per_s']:>9.1f}")
    print(f"wrote {out}")
    return 0 if all(r["verified"] for r in report["results"]["scenarios"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())

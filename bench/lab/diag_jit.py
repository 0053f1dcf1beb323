"""Which Triton kernels compile after an engine has started, and how long each stalls a step.

A served request whose shapes the engine has not run before can make Triton compile a new
specialization of a kernel inside a step (integer arguments are specialized on == 1 and on
divisibility by 16). On a fresh machine that is a compile (~0.3-2 s each), later a load from
the disk cache. Both stall every request in the step. This drives an engine (offline, the
serving settings of bench/lab/bench_payoff.py) with a serving-like stream: random prompt
lengths, requests joining every few steps, so prefill chunks, mixed steps and decode batches
of many sizes, and logs every Triton cache miss (knobs.runtime.jit_cache_hook) with the step
it fell in.

    python -m bench.lab.diag_jit --model qwen3-8b --requests 48 --out /tmp/jit.json
    python -m bench.lab.diag_jit --device cpu --model tiny-qwen3 --requests 6 \\
        --input-len 20:80 --output-len 4:8 --max-num-batched-tokens 64   # smoke (interpreter)

JSON: device, command, date, plan, startup_s, startup_misses, after_startup (one record per
miss: step, seconds into the run, kernel, compile seconds, the specialization's argument
types), steps (ms per step: median, p99, max and the slowest with their misses).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout

from pdserve.kernels.triton_mode import select_triton_mode  # noqa: E402


class JitLog:
    """Every Triton in-memory cache miss of this process: (kernel, specialization, start,
    seconds to compile or load it)."""

    def __init__(self) -> None:
        self.misses: list[dict] = []
        self._open: dict[str, dict] = {}

    def install(self) -> None:
        from triton import knobs
        knobs.runtime.jit_cache_hook = self._before
        knobs.runtime.jit_post_compile_hook = self._after

    def _before(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled):
        rec = {"kernel": f"{fn.module}.{fn.name}", "t": time.perf_counter(), "s": None,
               **_specialization(compile["specialization_data"])}
        self._open[str(key)] = rec
        self.misses.append(rec)
        return False

    def _after(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled):
        rec = self._open.pop(str(key), None)
        if rec is not None:
            rec["s"] = round(time.perf_counter() - rec["t"], 3)
        return False


def _specialization(data: str) -> dict:
    """The constants (constexprs, and integers specialized to 1) and the arguments Triton
    assumed divisible by 16, by name, from a miss's serialized specialization."""
    try:
        obj = json.loads(data)
    except (TypeError, ValueError) as e:
        return {"constants": {}, "div16": [], "unparsed": f"{type(e).__name__}: {e}"}
    names = list(obj["signature"])
    consts = {names[k[0]]: v for k, v in zip(obj["constant_keys"], obj["constant_vals"])
              if len(k) == 1 and k[0] < len(names)}
    div16 = [names[k[0]] for k, v in zip(obj["attrs_keys"], obj["attrs_vals"])
             if len(k) == 1 and k[0] < len(names) and "tt.divisibility" in str(v)]
    return {"constants": {k: (v.get("constexpr") if isinstance(v, dict) else v)
                          for k, v in consts.items()}, "div16": div16}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--model", default="qwen3-8b")
    a("--device", default="cuda")
    a("--requests", type=int, default=48)
    a("--input-len", default="2048:8192")
    a("--output-len", default="128:512")
    a("--join-every", type=int, default=6, help="steps between arrivals")
    a("--max-num-batched-tokens", type=int, default=2048)
    a("--max-num-seqs", type=int, default=64)
    a("--max-model-len", type=int, default=8720)
    a("--seed", type=int, default=0)
    a("--time-limit", type=float, default=400.0)
    a("--sdpa-probe", action="store_true",
      help="also time SDPA (cuDNN first) on new vs repeated sequence lengths")
    a("--out", default=None)
    return p.parse_args(argv)


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def build(args: argparse.Namespace):
    from pdserve.engine.llm import build_engine
    return build_engine(args.model, device=args.device, use_triton=True,
                        use_cuda_graphs=args.device == "cuda",
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len)


def drive(engine, args: argparse.Namespace, log: JitLog, t0: float) -> list[dict]:
    """Requests join every --join-every steps until --requests have; steps until all end."""
    from pdserve.engine.core.sampling_params import SamplingParams
    rng = random.Random(args.seed)
    (ilo, ihi), (olo, ohi) = _range(args.input_len), _range(args.output_len)
    vocab = engine.config.model.vocab_size
    steps, added, k = [], 0, 0
    while (added < args.requests or engine.has_unfinished()) and \
            time.perf_counter() - t0 < args.time_limit:
        if added < args.requests and k % args.join_every == 0:
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(ilo, ihi))]
            params = SamplingParams(max_tokens=rng.randint(olo, ohi), temperature=0.0,
                                    ignore_eos=True)
            engine.add_request(prompt, params)
            added += 1
        n0, s0 = len(log.misses), time.perf_counter()
        engine.step()
        ms = 1e3 * (time.perf_counter() - s0)
        steps.append({"step": k, "ms": round(ms, 2), "misses": len(log.misses) - n0})
        for rec in log.misses[n0:]:
            rec["step"] = k
        k += 1
        if k % 200 == 0:
            print(f"  step {k}: {added} requests added, {len(log.misses)} misses", flush=True)
    return steps


def sdpa_probe(lengths: tuple[int, ...] = (1500, 1500, 1501, 1777, 1777, 1100, 2048, 2048)
               ) -> list[dict]:
    """ms of one fresh-prefill SDPA call (engine/model/sdpa_prefill.py's backends, Qwen3-8B
    heads) per length in order: a length's first call against its repeat shows the cost of
    a new shape (cuDNN builds an execution plan per shape)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    from pdserve.engine.model.sdpa_prefill import BACKENDS
    out = []
    for s in lengths:
        q = torch.randn(1, 32, s, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, 8, s, 128, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        t = time.perf_counter()
        with sdpa_kernel(BACKENDS):
            F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
        torch.cuda.synchronize()
        out.append({"len": s, "ms": round(1e3 * (time.perf_counter() - t), 2)})
    return out


def summarize(steps: list[dict], misses: list[dict]) -> dict:
    ms = sorted(s["ms"] for s in steps)
    slow = sorted(steps, key=lambda s: -s["ms"])[:15]
    return {"steps": len(steps), "median_ms": statistics.median(ms) if ms else None,
            "p99_ms": ms[int(0.99 * (len(ms) - 1))] if ms else None,
            "max_ms": ms[-1] if ms else None, "slowest": slow,
            "miss_seconds": round(sum(m["s"] or 0 for m in misses), 3)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    select_triton_mode()
    log = JitLog()
    log.install()
    t0 = time.perf_counter()
    engine = build(args)
    startup_s = time.perf_counter() - t0
    n_start = len(log.misses)
    print(f"diag_jit: engine ready in {startup_s:.1f} s, {n_start} Triton misses "
          f"({sum(m['s'] or 0 for m in log.misses):.1f} s)", flush=True)
    t1 = time.perf_counter()
    steps = drive(engine, args, log, t1)
    after = [{**m, "t": round(m["t"] - t1, 3)} for m in log.misses[n_start:]]
    for m in after:
        print(f"  step {m['step']:5d} +{m['t']:7.2f} s  {m['s']} s  {m['kernel']}  "
              f"{m['constants']}  div16 {m['div16']}")
    import torch
    out = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
           "command": " ".join(sys.argv), "date": dt.datetime.now(dt.UTC).isoformat(),
           "plan": vars(args), "startup_s": round(startup_s, 2),
           "startup_misses": [{**m, "t": round(m["t"] - t0, 3)} for m in log.misses[:n_start]],
           "after_startup": after, "summary": summarize(steps, after)}
    if args.sdpa_probe:
        out["sdpa_probe"] = sdpa_probe()
        print("sdpa probe:", out["sdpa_probe"])
    print(json.dumps(out["summary"], indent=1)[:2000])
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

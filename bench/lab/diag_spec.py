"""Where a batch-1 MTP speculative step's time goes (GPU): host profile and GPU idle time.

    python -m bench.lab.diag_spec [--k 1] [--out F.json]

Builds the Qwen3-8B-shaped engine with one random MTP layer and forced acceptance (as in
bench_mtp's ceiling case), decodes one request, then reports: ms per step, the host's
cProfile top functions over 60 steps, and from the torch profiler over 6 steps the GPU's busy
and idle time with the longest idle gaps and the kernels on either side of each.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch

from pdserve.engine.core.config import SpecConfig
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.llm import build_engine

from bench.lab.engine_probes import random_prompts


def gpu_gaps(engine, steps: int) -> dict:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    # device activity only: recording host ops slows the host enough to open gaps of its own
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                key=lambda e: e.time_range.start)
    gaps, end, prev = [], ev[0].time_range.start, ev[0].name
    busy = 0.0
    for e in ev:
        if e.time_range.start > end:
            gaps.append(((e.time_range.start - end) / 1e3, prev[:40], e.name[:40]))
        busy += max(0, e.time_range.end - max(end, e.time_range.start)) / 1e3
        if e.time_range.end > end:
            end, prev = e.time_range.end, e.name
    span = (ev[-1].time_range.end - ev[0].time_range.start) / 1e3
    gaps.sort(reverse=True)
    by_name: dict[str, list[float]] = {}  # kernel -> [count, ms] per step
    for e in ev:
        row = by_name.setdefault(e.name[:60], [0, 0.0])
        row[0] += 1 / steps
        row[1] += (e.time_range.end - e.time_range.start) / 1e3 / steps
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:25]
    # one step in order, outside the layers' repeated kernels: [gap before it (us), name, us]
    # (the profiler's times are in us)
    seq, t_prev = [], None
    for e in ev[len(ev) // 2:]:
        gap = 0.0 if t_prev is None else e.time_range.start - t_prev
        seq.append((round(gap, 1), e.name[:50], round(e.time_range.end - e.time_range.start, 1)))
        t_prev = e.time_range.end if t_prev is None else max(t_prev, e.time_range.end)
    n_per = len(ev) // steps
    seq = [r for r in seq[:n_per] if not r[1].startswith(("_gemv", "_decode_kernel",
                                                         "_add_rmsnorm", "_silu"))
           or r[0] > 3.0]
    return {"steps": steps, "span_ms": span, "busy_ms": busy, "idle_ms": sum(g[0] for g in gaps),
            "one_step_outside_layers": seq,
            "top_gaps": [{"ms": round(g, 3), "after": a, "before": b} for g, a, b in gaps[:15]],
            "per_step_by_kernel": {n: {"count": round(c, 2), "ms": round(t, 4)}
                                   for n, (c, t) in top}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=1, help="drafts per step (0: no speculation)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    spec = (SpecConfig(num_speculative_tokens=args.k, batch_k_caps=(), forced_acceptance=True)
            if args.k > 0 else None)  # --k 0: plain decode
    engine = build_engine("qwen3-8b", device="cuda", num_blocks=1024, block_size=16,
                          max_num_seqs=4, max_model_len=2048, use_triton=True,
                          use_cuda_graphs=True, speculative=spec)
    vocab = engine.config.model.vocab_size
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    engine.add_request(random_prompts(1, 512, vocab, 0)[0], params)
    for _ in range(10):  # prefill, first verifies, graph captures
        engine.step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(40):
        engine.step()
    torch.cuda.synchronize()  # the last step's device work, which may still be in flight
    ms = (time.perf_counter() - t) / 40 * 1e3
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(60):
        engine.step()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    gaps = gpu_gaps(engine, 12)
    out = {"k": args.k, "ms_per_step": ms, "gpu": gaps, "device": torch.cuda.get_device_name(),
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    print(json.dumps(out, indent=1))
    print(buf.getvalue()[:6000])
    if args.out:
        json.dump(out | {"host_profile": buf.getvalue()}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()

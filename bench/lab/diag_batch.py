"""Where a batched decode step's time goes at long contexts (GPU): engine vs graph vs kernels.

    python -m bench.lab.diag_batch [--cases 24x5120,32x5120,16x1024] [--out F.json]

The payoff run (#8) decodes ~24-32 sequences of 2K-8K-token contexts. For each case
(batch x context) this builds nothing new: one Qwen3-8B-shaped engine (random bf16 weights,
Triton, CUDA graphs, max_model_len as in bench_payoff), then
  - drives `batch` prompts of `context` tokens to completion of `--tokens` decode steps and
    records the engine's end-to-end step time and its host phases (EngineStats.host_s);
  - replays the captured decode graph for the same batch/context alone (graph + LM head +
    argmax) and its kernel time by group (critical path), as bench_engine does;
  - the bandwidth bound: (weight bytes + KV bytes of the batch) / measured copy bandwidth.
The gap engine - graph is host time the overlap does not hide; graph - bound is kernels.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from pdserve.engine.exec.cuda_graphs import DecodeGraphs
from pdserve.engine.llm import build_engine

from bench.lab.bench_engine import (
    Plan,
    device_rates,
    drive,
    gpu_step_ms,
    graph_for,
    kv_bytes_per_token,
    weight_bytes_per_token,
)
from bench.lab.engine_probes import kernel_times, log, random_prompts
from bench.lab.kernel_bench import emit


def parse_cases(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        b, _, c = item.partition("x")
        out.append((int(b), int(c)))
    return out


def one_case(engine, graphs, batch: int, context: int, tokens: int, bw: float, wbytes: int,
             kvb: int) -> dict:
    vocab = engine.config.model.vocab_size
    engine.stats.host_s.clear()
    steps0 = engine.stats.steps
    steps = drive(engine, random_prompts(batch, context, vocab, 7 + batch), tokens + 1)
    n_steps = max(1, engine.stats.steps - steps0)
    full = [s for s in steps if s["decode"] and s["tokens"] == batch]
    step_ms = 1e3 * statistics.median(s["s"] for s in full)
    ctx = context + tokens // 2
    gpu_ms, how = gpu_step_ms(engine, graphs, batch, ctx)
    captured = graph_for(graphs, batch, ctx)
    kt = kernel_times(captured[0].replay, graphs.device) if captured is not None else {}
    bound_ms = (wbytes + batch * ctx * kvb) / bw / 1e6
    row = {"batch": batch, "context": context, "engine_step_ms": step_ms,
           "graph_step_ms": gpu_ms, "graph_mode": how, "bound_ms": bound_ms,
           "engine_pct_of_bound": 100 * bound_ms / step_ms,
           "graph_pct_of_bound": 100 * bound_ms / gpu_ms,
           "host_phase_ms_per_step": {k: round(1e3 * v / n_steps, 3)
                                      for k, v in engine.stats.host_s.items()},
           "kernels": kt}
    log(f"{batch}x{context}: engine {step_ms:.2f} ms, graph {gpu_ms:.2f} ms, bound "
        f"{bound_ms:.2f} ms; critical {kt.get('critical_path_ms')}")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cases", default="24x5120,32x5120,16x1024")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--max-model-len", type=int, default=8720)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.lab.diag_batch needs a CUDA device")
    cases = parse_cases(args.cases)
    dev = torch.device("cuda")
    rates = device_rates(Plan(), dev)
    need = max(b * (c + args.tokens + 64) for b, c in cases)
    engine = build_engine("qwen3-8b", device="cuda", dtype="bfloat16", block_size=16,
                          num_blocks=need // 16 + 64, max_num_seqs=max(b for b, _ in cases),
                          max_num_batched_tokens=16384, max_model_len=args.max_model_len,
                          enable_prefix_caching=False, use_triton=True, use_cuda_graphs=True)
    runner = engine.runner
    graphs = runner.cuda_graphs or DecodeGraphs(engine.config, runner.model, runner.kv_cache)
    wbytes = weight_bytes_per_token(runner.model)
    kvb = kv_bytes_per_token(engine.config.model, runner.kv_cache.element_size())
    rows = [one_case(engine, graphs, b, c, args.tokens, rates["copy_GBps"], wbytes, kvb)
            for b, c in cases]
    out = {"device": torch.cuda.get_device_name(), "command": " ".join(sys.argv),
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rates": rates,
           "graph_buckets": sorted(graphs.graphs), "cases": rows}
    emit(out, args.out)


if __name__ == "__main__":
    main()

"""The timeline of the one-launch o_proj -> gate_up -> down kernel (kernels/fp8_chain_tc.py)
inside a batch-1 decode step, per CTA, from its global-timer probes (GPU).

    python -m bench.lab.trace_chain [--stages 12] [--nowait] [--out F.json]

Builds Qwen3-8B's shape in FP8 like bench/lab/diag_decode.py, captures the batch-1 graph
with the chain kernel writing its probes (each layer overwrites them: the last layer's
remain), replays it, and prints each probe's min / median / max over the CTAs in us after
the earliest PDL-wait return (about the attention's end). Probes: consumer 0 start, 1 PDL
wait returned, 2 o prologue done, 3 o done, 4 gate_up prologue done (after sync 1), 5
gate_up done, 6 down prologue done (after sync 2), 7 end; loader 8 start, 9 o's tiles
issued, 10 PDL wait returned, 11 gate_up's issued, 12 down's issued.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from pdserve.engine.llm import build_engine

from bench.lab.bench_engine import Plan, drive
from bench.lab.diag_decode import capture, variant
from bench.lab.engine_probes import random_prompts, time_ms

PROBES = ["start", "waited", "o_prologue", "o_done", "gu_prologue", "gu_done", "dn_prologue",
          "end", "ld_start", "ld_o_issued", "ld_waited", "ld_gu_issued", "ld_dn_issued"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", type=int, default=12)
    ap.add_argument("--nowait", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    plan = Plan()
    engine = build_engine("qwen3-8b", device="cuda", dtype="bfloat16", num_blocks=2048,
                          block_size=16, max_num_seqs=4, max_model_len=plan.max_model_len,
                          enable_prefix_caching=False, use_triton=True, use_cuda_graphs=True,
                          quantization="fp8")
    vocab = engine.config.model.vocab_size
    drive(engine, random_prompts(1, 700, vocab, 0), 4)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    trace = torch.zeros(2 * sms, 16, dtype=torch.int64, device="cuda")
    name, setup, splits = variant("trace", chain={"stages": args.stages, "trace": trace,
                                                  "wait_after_o": not args.nowait})
    step, _ = capture(engine, setup, splits, vocab)
    with torch.inference_mode():
        ms = time_ms(step, torch.device("cuda"), reps=30)
        runs = []
        for _ in range(9):
            step()
            torch.cuda.synchronize()
            t = trace[:, :13].double().cpu()
            runs.append((t - t[:, 1].min()) / 1e3)
    out = {"step_ms": ms, "probes_us": {}}
    stacked = torch.stack(runs)  # [runs, grid, 13]
    for i, p in enumerate(PROBES):
        v = stacked[:, :, i]
        q = [float(v.min(1).values.median()), float(v.median(1).values.median()),
             float(v.max(1).values.median())]
        out["probes_us"][p] = q
        print(f"{p:14s} min {q[0]:7.2f}  median {q[1]:7.2f}  max {q[2]:7.2f}", flush=True)
    print(f"step {ms:.4f} ms", flush=True)
    out.update(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               command="python -m bench.lab.trace_chain " + " ".join(
                   f"--{k} {v}" for k, v in vars(args).items() if v not in (None, False)))
    if args.out:
        json.dump(out, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()

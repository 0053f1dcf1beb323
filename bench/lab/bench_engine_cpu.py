"""CPU decode throughput: pdserve's engine vs transformers' generate(), same model, same run.

    python -m bench.lab.bench_engine_cpu [--out bench/results/engine_cpu.json]

SmolLM2-135M-Instruct (the embedded GGUF, float32), batch 1 and batch 16, greedy, a fixed
number of new tokens with EOS ignored. Decode tok/s = new tokens / (time - prefill time).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch

from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.llm import LLM
from pdserve.engine.model.loader import resolve_model


def _prompts(batch: int) -> list[str]:
    base = ["The history of the Roman empire", "A recipe for bread", "How rockets work",
            "The rules of chess", "Why the sky is blue", "A poem about the sea"]
    return [f"{base[i % len(base)]} (part {i}):" for i in range(batch)]


def bench_pdserve(llm: LLM, batch: int, new_tokens: int) -> dict:
    prompts = _prompts(batch)
    prefill_only = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    full = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts, prefill_only)  # warm-up
    t0 = time.perf_counter()
    llm.generate(prompts, prefill_only)
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate(prompts, full)
    total = time.perf_counter() - t0
    return {"batch": batch, "new_tokens": new_tokens, "seconds": total, "prefill_s": prefill_s,
            "decode_tok_s": batch * (new_tokens - 1) / max(total - prefill_s, 1e-9)}


@torch.no_grad()
def bench_transformers(hf, tok, batch: int, new_tokens: int) -> dict:
    ids = [tok.encode(p) for p in _prompts(batch)]
    width = max(map(len, ids))
    pad = tok.eos_token_ids[0]
    input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])  # left padding
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])

    def run(n: int) -> float:
        t0 = time.perf_counter()
        hf.generate(input_ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                    do_sample=False, pad_token_id=pad)
        return time.perf_counter() - t0

    run(2)  # warm-up
    prefill_s = run(1)
    total = run(new_tokens)
    return {"batch": batch, "new_tokens": new_tokens, "seconds": total, "prefill_s": prefill_s,
            "decode_tok_s": batch * (new_tokens - 1) / max(total - prefill_s, 1e-9)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--out", default=f"bench/results/engine_cpu_{datetime.date.today()}.json")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    src = resolve_model(None)
    print("loading pdserve engine ...", file=sys.stderr)
    llm = LLM(device="cpu", dtype="float32")
    print("loading transformers model ...", file=sys.stderr)
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(src.path),
                                              gguf_file=os.path.basename(src.path),
                                              dtype=torch.float32).eval()
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for name, fn in (("pdserve", lambda: bench_pdserve(llm, batch, args.new_tokens)),
                         ("transformers", lambda: bench_transformers(hf, llm.tokenizer, batch,
                                                                     args.new_tokens))):
            print(f"[{name}] batch {batch} ...", file=sys.stderr)
            row = {"engine": name, **fn()}
            print(json.dumps(row), file=sys.stderr)
            rows.append(row)
    result = {"benchmark": "engine_cpu_decode", "model": src.name,
              "device": f"CPU: {platform.processor() or platform.machine()}, "
                        f"{os.cpu_count()} cores, torch threads {torch.get_num_threads()}",
              "command": " ".join(["python", "-m", "bench.lab.bench_engine_cpu", *sys.argv[1:]]),
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "torch": torch.__version__, "results": rows}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What a reduced draft vocabulary costs in acceptance (CPU or GPU):

    python -m bench.lab.bench_draft_vocab [--sizes 0,8192,16384,32768] [--out F.json]

SmolLM2-135M-Instruct with its trained MTP head, k = 1, greedy decoding of the held-out chat
prompts of the CI acceptance test (tests/engine/test_spec_decode_smollm.py), once per
SpecConfig.draft_vocab size (0 = the full 49,152 ids): first-draft acceptance from the engine's
counters, and the share of the emitted tokens that lie inside the draft ids (a draft can only
be accepted there).
"""
from __future__ import annotations

import argparse
import datetime
import sys
import time

import torch

from pdserve.engine.core.config import SpecConfig
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.llm import LLM
from pdserve.engine.train_mtp import chat, heldout_prompts

from bench.lab.kernel_bench import emit


def measure(size: int, device: str, prompts: int, max_tokens: int) -> dict:
    start = time.perf_counter()
    spec = SpecConfig(num_speculative_tokens=1, batch_k_caps=(), draft_vocab=size)
    llm = LLM(speculative=spec, device=device, dtype="float32", num_blocks=512,
              max_num_batched_tokens=1024)
    msgs = heldout_prompts(prompts)
    res = llm.generate([chat(llm.tokenizer, m) for m in msgs],
                       SamplingParams(max_tokens=max_tokens, temperature=0.0))
    st = llm.engine.spec_stats
    out = [t for r in res for t in r.outputs[0].token_ids]
    ids = llm.engine.runner.spec.head.draft_ids
    inside = set(range(llm.engine.config.model.vocab_size)) if ids is None else set(ids.tolist())
    return {"draft_vocab": size, "first_draft_acceptance": st.num_accepted_tokens_per_pos[0] /
            max(st.num_drafts, 1), "num_drafts": st.num_drafts, "emitted_tokens": len(out),
            "emitted_share_inside_draft_ids": sum(t in inside for t in out) / max(len(out), 1),
            "seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="0,8192,16384,32768")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result: dict = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                    "command": " ".join([sys.executable] + sys.argv),
                    "date": datetime.datetime.now(datetime.UTC).isoformat(
                        timespec="seconds"), "runs": []}
    for size in (int(s) for s in args.sizes.split(",")):
        result["runs"].append(measure(size, args.device, args.prompts, args.max_tokens))
        print(result["runs"][-1], file=sys.stderr, flush=True)
    emit(result, args.out)


if __name__ == "__main__":
    main()

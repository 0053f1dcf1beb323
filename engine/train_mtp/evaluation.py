"""train-mtp step 5, evaluation: acceptance of a trained head's drafts on held-out prompts,
measured through the engine's spec-decode counters."""
from __future__ import annotations

import torch

from pdserve.engine.train_mtp.prompts import chat


def measure_acceptance(model_name: str | None, head_path: str, prompts: list[str], k: int,
                       max_tokens: int, device: str, dtype: str = "float32") -> dict:
    """Greedy decoding of `prompts` with k drafts per step; numbers from the engine counters.
    float32 by default, on any device: the CI acceptance test runs that way on CPU."""
    import gc

    from pdserve.engine.core.config import SpecConfig
    from pdserve.engine.core.sampling_params import SamplingParams
    from pdserve.engine.llm import LLM

    llm = LLM(model_name, device=device, dtype=dtype, speculative=SpecConfig(
        num_speculative_tokens=k, batch_k_caps=()), mtp_head=head_path,
        num_blocks=max(256, len(prompts) * (256 + max_tokens) // 16),
        max_num_seqs=max(1, len(prompts)))
    ids = [chat(llm.tokenizer, p) for p in prompts]
    llm.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    st = llm.engine.spec_stats
    per_pos = [n / max(1, st.num_drafts) for n in st.num_accepted_tokens_per_pos]
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"k": k, "num_drafts": st.num_drafts, "num_draft_tokens": st.num_draft_tokens,
            "num_accepted_tokens": st.num_accepted_tokens,
            "acceptance_rate": st.acceptance_rate,
            "first_draft_acceptance": per_pos[0] if per_pos else 0.0,
            "acceptance_per_pos": per_pos, "mean_accepted_length": st.mean_accepted_length}

"""The sampler's logits processors (engine/exec/sampler.py applies them in its pipeline's
order): pure functions of logits [B, V] and per-row parameter tensors [B], no state."""
from __future__ import annotations

import torch


def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor, counts: torch.Tensor,
                    repetition: torch.Tensor, presence: torch.Tensor,
                    frequency: torch.Tensor) -> torch.Tensor:
    """Penalised copy of logits [B, V].

    prompt_mask [B, V] bool, counts [B, V] output-token counts, the three penalties [B].
    Repetition (vLLM/HF): tokens seen in prompt or output get logit / r if positive, * r
    otherwise. Then OpenAI's: logit -= frequency * count + presence * (count > 0).
    """
    counts_f = counts.to(logits.dtype)
    in_output = counts > 0
    seen = prompt_mask | in_output
    r = repetition[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    return logits - frequency[:, None] * counts_f - presence[:, None] * in_output.to(logits.dtype)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits [B, V] outside each row's top-k, then outside its top-p nucleus.

    top_k [B] int64 (V = off), top_p [B] float (1 = off). The nucleus is computed on the
    top-k survivors' renormalised distribution: the smallest prefix (by descending
    probability) whose mass reaches top_p; the most likely token is always kept. Ties at
    the k-th value are broken by sort order, so exactly k tokens survive.
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
    rank = torch.arange(vocab, device=logits.device)
    drop = rank[None, :] >= top_k[:, None]  # [B, V] in sorted order
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability strictly ahead of each token
    # rows with top_p == 1 skip this: fp rounding can push mass_before to 1.0 in the tail
    drop |= (mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None]
    drop[:, 0] = False
    mask = torch.zeros_like(drop).scatter_(-1, order, drop)  # back to vocabulary order
    return logits.masked_fill(mask, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p [B] times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))

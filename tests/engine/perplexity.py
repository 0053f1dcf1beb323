"""Perplexity of a model on the fixed text tests/data/perplexity.txt: the quality yardstick
of the lossy formats (FP8 weights, FP8 KV cache).

The text is fed in chunks through the paged KV cache, as the engine's chunked prefill does,
so every chunk after the first attends to keys and values read back from the cache (an FP8
cache's quantized values, not the fresh ones).
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from tests.engine.hf_families import BLOCK, Paged

TEXT = (Path(__file__).parent.parent / "data" / "perplexity.txt").read_text()


def perplexity(model, token_ids: list[int], chunk: int = 64,
               driver: type[Paged] = Paged) -> float:
    """exp(mean NLL of token i+1 given tokens 0..i) over `token_ids`, fed `chunk` tokens per
    step through `driver` (a Paged subclass can choose the cache's format)."""
    n = len(token_ids)
    paged = driver(model, num_blocks=-(-n // BLOCK) + 1)
    table = list(range(-(-n // BLOCK)))
    nll, count = 0.0, 0
    for start in range(0, n - 1, chunk):
        new = token_ids[start:min(start + chunk, n - 1)]
        logits = paged.step([(new, start, table)])[0].float()  # [len(new), vocab]
        targets = torch.tensor(token_ids[start + 1:start + 1 + len(new)])
        nll += F.cross_entropy(logits, targets, reduction="sum").item()
        count += len(new)
    return math.exp(nll / count)

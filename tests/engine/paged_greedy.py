"""Greedy decode of the chat question "What is the capital of France?" one token per step
through a paged KV cache, as the engine runs it: the answer the default model's tests read
"Paris" in, over whichever cache format the caller allocated."""
from __future__ import annotations

import torch

from pdserve.engine.model.attention import make_metadata

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
BLOCK_SIZE, TABLE = 16, [3, 0, 5, 1, 4]  # blocks out of order: the table is really read


def capital_answer(model, cfg, tok, kv: torch.Tensor, steps: int = 12) -> str:
    """The greedy answer (at most `steps` tokens, EOS ends it) with `kv` as the cache
    (at least 6 blocks of BLOCK_SIZE)."""
    tokens = tok.encode(tok.apply_chat_template(QUESTION))
    new, out = tokens, []
    with torch.no_grad():
        for _ in range(steps):
            n = len(tokens) + len(out)
            meta = make_metadata([len(new)], [n], [TABLE], BLOCK_SIZE)
            hidden = model(torch.tensor(new), torch.arange(n - len(new), n), meta, kv)
            nxt = int(model.compute_logits(hidden[-1:]).argmax())
            if nxt in cfg.eos_token_ids:
                break
            out.append(nxt)
            new = [nxt]
    return tok.decode(out)

"""Fresh-prefill SDPA runs at a few padded lengths (engine/model/sdpa_prefill.py): cuDNN builds
an execution plan per sequence length, so every new prompt length cost its prefill step ~40 ms
on an H200. Padding at the end of a causal sequence must leave its rows exact, waste under
1/8, and the warm-up's prompts must reach every padded length a prompt can need. (CPU: the
math backend; the GPU scale test compares the cuDNN path with the paged kernel.)"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from pdserve.engine.model.sdpa_prefill import (
    MIN_TOKENS,
    causal_attention,
    padded_len,
    plan_lengths,
)


def test_padded_lengths_are_few_and_waste_under_an_eighth() -> None:
    for s in range(1, 20000):
        p = padded_len(s)
        assert s <= p < s + s / 8 + 1 and padded_len(p) == p
    assert len({padded_len(s) for s in range(1024, 2049)}) == 9


def test_the_warmup_prompts_reach_every_padded_length() -> None:
    for top in (1024, 2000, 2048, 5000):
        reached = {padded_len(s) for s in plan_lengths(top)}
        assert reached == {padded_len(s) for s in range(MIN_TOKENS, top + 1)}
        assert max(plan_lengths(top)) <= top


def test_padded_causal_attention_is_exact_on_the_real_rows() -> None:
    g = torch.Generator().manual_seed(3)
    S, hq, hkv, d = 1100, 4, 2, 16  # pads to 1152
    q, k, v = (torch.randn(S, h, d, generator=g) for h in (hq, hkv, hkv))
    out = causal_attention(q, k, v, 0.25, backends=[SDPBackend.MATH])
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        is_causal=True, scale=0.25, enable_gqa=True)[0].transpose(0, 1)
    assert out.shape == (S, hq, d)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)

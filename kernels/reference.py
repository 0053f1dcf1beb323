"""Pure-torch references: each computes the same function as one Triton kernel, in fp32.

They define the kernels' semantics (tests compare against them) and run anywhere. Shapes follow
engine/model/attention.py: T new tokens, B sequences, Hq query heads, Hkv KV heads, D head dim,
a layer's cache view [num_blocks, block_size, Hkv, D].
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def add_rmsnorm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual (rounded to x.dtype, as the unfused model would hold it);
    normed = h * rsqrt(mean(h^2) + eps) * weight. Returns (normed, h), both x.dtype."""
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    hf = h.float()
    rstd = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return (hf * rstd * weight.float()).to(x.dtype), h


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> silu(gate) * up, [T, I]."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, prologue: str = "none",
             residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
             eps: float = 1e-6, add: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """prologue(x) [T, K] @ weight [N, K]^T in fp32 -> x.dtype. "silu" rounds its output to
    x.dtype first, as the unfused model stores it; "norm" keeps rmsnorm(h) in fp32 (the
    kernel applies rstd after the dot product) and returns (y, h); add [T, N] is summed
    before rounding."""
    h = None
    if prologue == "norm":
        h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
        hf = h.float()
        a = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    elif prologue == "silu":
        a = silu_and_mul_ref(x)
    else:
        a = x
    y = a.float() @ weight.float().t()
    if add is not None:
        y = y + add.float()
    y = y.to(x.dtype)
    return (y, h) if prologue == "norm" else y


# -- FP8 weights (kernels/fp8_scales.py) -------------------------------------------------------

def fp8_dequant_ref(weight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]
                    ) -> torch.Tensor:
    """W8 [..., N, K] float8_e4m3fn times its block's scale (scales [..., ceil(N / bn),
    ceil(K / bk)]) -> float32 [..., N, K]: the weight the FP8 kernels multiply by."""
    n, k = weight.shape[-2], weight.shape[-1]
    full = scales.float().repeat_interleave(block[0], dim=-2)[..., :n, :]
    return weight.float() * full.repeat_interleave(block[1], dim=-1)[..., :k]


def quant_act_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token-group activation quantization: x [M, K] -> (x8 float8_e4m3fn [M, K],
    scales float32 [M, ceil(K / group)]) with scale = amax(|group|) / 448 (a tiny floor for
    all-zero groups) and x8 = x / scale rounded to nearest."""
    m, k = x.shape
    g = -(-k // group)
    padded = torch.nn.functional.pad(x.float(), (0, g * group - k)).view(m, g, group)
    scales = padded.abs().amax(-1).clamp(min=1e-10) / 448.0
    x8 = (padded / scales[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return x8.view(m, g * group)[:, :k], scales


def fp8_gemm_ref(x8: torch.Tensor, x_scales: torch.Tensor, group: int, weight: torch.Tensor,
                 scales: torch.Tensor, block: tuple[int, int], out_dtype: torch.dtype,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """(x8 with its 1 x group scales) @ (W8 with its block scales)^T (+ bias) in fp32 ->
    [M, N] in out_dtype: the FP8 GEMM's function."""
    a = fp8_dequant_ref(x8, x_scales, (1, group))
    y = a @ fp8_dequant_ref(weight, scales, block).t()
    return (y if bias is None else y + bias.float()).to(out_dtype)


def argmax_ref(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] -> int64 [B]: the first index of each row's maximum (kernels.argmax)."""
    return logits.argmax(dim=-1)


def rope_cos_sin(inv_freq: torch.Tensor, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_pos, D/2] (fp32) from inv_freq [D/2] (already scaled, e.g. llama3)."""
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32, device=inv_freq.device),
                        inv_freq.float())
    return freqs.cos(), freqs.sin()


def _rms_heads(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    if weight is None:
        return x
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def _rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (HF Llama/Qwen). x [T, H, D] fp32, cos/sin [T, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Scatter k/v [T, Hkv, D] into cache views [NB, BS, Hkv, D]; slots < 0 are skipped."""
    bs = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache[slots // bs, slots % bs] = k[keep].to(k_cache.dtype)
    v_cache[slots // bs, slots % bs] = v[keep].to(v_cache.dtype)


def qk_norm_rope_cache_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           positions: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                           k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, q_norm: torch.Tensor | None = None,
                           k_norm: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """Optional per-head RMSNorm of q/k, RoPE at `positions`, k/v into the cache.
    positions None: cos/sin are already per-token [T, D/2]. Returns the rotated q as a new
    [T, Hq, D] tensor of q.dtype."""
    if positions is not None:
        cos, sin = cos[positions.long()], sin[positions.long()]
    c, s = cos.float(), sin.float()
    q_out = _rope_neox(_rms_heads(q.float(), q_norm, eps), c, s)
    k_out = _rope_neox(_rms_heads(k.float(), k_norm, eps), c, s)
    write_kv_ref(k_out, v, k_cache, v_cache, slot_mapping)
    return q_out.to(q.dtype)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of varlen queries over a paged cache (decode = query_len 1).

    q [T, Hq, D]; sequence b owns q rows query_start_loc[b]:query_start_loc[b+1], its context
    is seq_lens[b] tokens in blocks block_tables[b], and query i of n sits at position
    seq_lens[b] - n + i, seeing keys 0..that position. Returns [T, Hq, D] in q.dtype.
    """
    out = torch.zeros_like(q)
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // hkv
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        start, end = qsl[b], qsl[b + 1]
        if end == start:
            continue
        blocks = block_tables[b, : (seq_len + bs - 1) // bs].long()
        keys = k_cache[blocks].reshape(-1, hkv, k_cache.shape[-1])[:seq_len].float()
        vals = v_cache[blocks].reshape(-1, hkv, v_cache.shape[-1])[:seq_len].float()
        keys = keys.repeat_interleave(group, dim=1)  # [S, Hq, D]
        vals = vals.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys) * scale
        pos = seq_len - (end - start) + torch.arange(end - start, device=q.device)
        hidden = torch.arange(seq_len, device=q.device)[None, :] > pos[:, None]  # [n, S]
        scores = scores.masked_fill(hidden[None], float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals).to(q.dtype)
    return out


# -- mixture of experts ------------------------------------------------------------------
# E experts, each a SiLU-gated MLP: w13 [E, 2I, H] stacks gate (rows 0..I-1) over up
# (rows I..2I-1), w2 [E, H, I] is down. The router picks top_k experts per token.

def moe_route_ref(x: torch.Tensor, router_weight: torch.Tensor, top_k: int,
                  scoring: str = "softmax", correction_bias: torch.Tensor | None = None,
                  n_group: int = 1, topk_group: int = 1, renormalize: bool = True,
                  routed_scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Router GEMV + scoring + (grouped) top-k, in fp32. x [T, H], router_weight [E, H].
    Returns (topk_weights [T, top_k] float32, topk_ids [T, top_k] int32).

    "softmax" (Qwen3-MoE): probabilities, top-k of them, renormalised if asked.
    "sigmoid" (GLM-4.5, DeepSeek-V3): s = sigmoid(logits) chooses through s + correction_bias
    within the topk_group best of n_group expert groups (a group scores the sum of its best
    two), weights are s itself (no bias), renormalised if asked, times routed_scaling.
    Experts of the other groups are never chosen (-inf, as transformers 5 and vLLM mask them:
    with a negative correction bias a 0.0 mask could outrank a kept expert)."""
    logits = x.float() @ router_weight.float().t()  # [T, E]
    if scoring == "softmax":
        probs = logits.softmax(dim=-1)
        weights, ids = probs.topk(top_k, dim=-1)
    elif scoring == "sigmoid":
        scores = logits.sigmoid()
        choice = scores if correction_bias is None else scores + correction_bias.float()
        if n_group > 1:
            T, E = choice.shape
            group_scores = choice.view(T, n_group, E // n_group).topk(2, dim=-1)[0].sum(-1)
            keep = torch.zeros_like(group_scores)
            keep.scatter_(1, group_scores.topk(topk_group, dim=-1)[1], 1.0)
            mask = keep.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
            choice = choice.masked_fill(mask == 0, float("-inf"))
        ids = choice.topk(top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
    else:
        raise ValueError(f"scoring: expected 'softmax' or 'sigmoid', got {scoring!r}")
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if scoring == "sigmoid" else 0.0))
    return weights * routed_scaling, ids.to(torch.int32)


def moe_experts_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j],
    in fp32 -> x.dtype. x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_* [T, top_k]."""
    T, H = x.shape
    inter = w2.shape[-1]
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    xf = x.float()
    for e in topk_ids.unique().tolist():  # experts with no tokens cost nothing
        rows, slots = (topk_ids == e).nonzero(as_tuple=True)
        gate_up = xf[rows] @ w13[e].float().t()  # [n, 2I]
        h = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, rows, (h @ w2[e].float().t()) * topk_weights[rows, slots, None].float())
    return out.to(x.dtype)


def merge_partials_ref(o: torch.Tensor, lse: torch.Tensor, seq_lens: torch.Tensor,
                       block_n: int) -> torch.Tensor:
    """The decode attention's unmerged splits (kernels/decode_attention.SplitPartials: o
    [B, Hq, S, D], lse [B, Hq, S] base 2) -> [B, Hq, D] fp32, each sequence's first
    active_splits(seq_lens[b], block_n, S) splits weighted by their softmax sums."""
    from pdserve.kernels.decode_attention import active_splits  # imports triton: here only

    out = torch.zeros(o.shape[0], o.shape[1], o.shape[3], dtype=torch.float32, device=o.device)
    for b, n in enumerate(seq_lens.tolist()):
        k = active_splits(n, block_n, o.shape[2])
        if k == 0:
            continue
        w = torch.softmax(lse[b, :, :k].float() * math.log(2.0), dim=-1)  # [Hq, k]
        w = torch.nan_to_num(w)  # a head with no keys at all: zero weights
        out[b] = (w[..., None] * o[b, :, :k].float()).sum(1)
    return out


def fp8_gemv_tc_ref(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                    prologue: str = "none", norm_weight: torch.Tensor | None = None,
                    eps: float = 1e-6, *, out: torch.Tensor, add: torch.Tensor | None = None,
                    res_out: torch.Tensor | None = None, zero: tuple[torch.Tensor, ...] = ()
                    ) -> torch.Tensor:
    """kernels/fp8_gemv_tc.py's function: the prologue's activation a [K] ("norm": x times
    the norm weight, its rstd applied to the outputs; "silu": silu(gate) * up; "merge": x's
    attention splits merged, merge_partials_ref) quantized per 128 columns, times the
    dequantized weight, added into out (fp32) with `add`; res_out <- x for "norm"; each
    `zero` buffer <- 0. Returns out."""
    K = weight.shape[1]
    rstd = torch.ones((), dtype=torch.float32, device=weight.device)
    if prologue == "merge":  # x: SplitPartials (kernels/decode_attention.py)
        a = merge_partials_ref(x.o, x.lse, x.seq_lens, x.block_n).reshape(-1)
    elif prologue == "norm":
        xf = x.float().reshape(-1)
        rstd = torch.rsqrt(xf.square().mean() + eps)
        a = xf * norm_weight.float()
        if res_out is not None:
            res_out.copy_(xf.view_as(res_out))
    elif prologue == "silu":
        xf = x.float().reshape(-1)
        a = F.silu(xf[:K]) * xf[K:]
    else:
        a = x.float().reshape(-1)
    a8, sa = quant_act_ref(a[None], 128)
    y = fp8_dequant_ref(a8, sa, (1, 128)) @ fp8_dequant_ref(weight, scales, (128, 128)).t()
    y = y * rstd + (add.float() if add is not None else 0.0)
    for z in zero:
        z.zero_()
    return out.add_(y.view_as(out))

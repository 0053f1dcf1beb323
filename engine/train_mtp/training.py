"""train-mtp step 4, training: the head's initialisation, the distillation loss against the
target's top-K (plus chain and feature terms), the top-1 agreement on held-out sequences,
and the AdamW loop."""
from __future__ import annotations

import math
import random
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from pdserve.engine.train_mtp.corpus import Sample, _progress_interval


class DenseCausalBackend:
    """Training attention: the batch is B padded rows of equal length; causal SDPA, no cache.
    (The MTP layer's Attention writes K/V through write_kv, then attends: we keep them.)"""

    name = "dense"

    def __init__(self) -> None:
        self.batch = 1
        self._kv: tuple[torch.Tensor, torch.Tensor] | None = None

    def write_kv(self, k, v, k_cache, v_cache, meta) -> None:
        self._kv = (k, v)

    def attend(self, q, k_cache, v_cache, meta, scale) -> torch.Tensor:
        k, v = self._kv
        T, hq, d = q.shape
        B, L = self.batch, T // self.batch

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.view(B, L, -1, d).transpose(1, 2)

        o = F.scaled_dot_product_attention(heads(q), heads(k).to(q.dtype), heads(v).to(q.dtype),
                                           is_causal=True, scale=scale, enable_gqa=True)
        return o.transpose(1, 2).reshape(T, hq, d)


INITS = ("random", "last-layer")


def init_head(model, device: torch.device, backend: DenseCausalBackend, seed: int = 0,
              init: str = "random"):
    """fp32 head. random: N(0, 0.02) matrices and unit norms; the final norm starts as the
    target's (its output feeds the same lm_head). last-layer: the decoder block also starts
    as a copy of the target's last layer, and eh_proj as [small random | identity] so the
    block first sees the target's own final state."""
    from pdserve.engine.spec.mtp_head import random_head, with_mtp_layers

    if init not in INITS:
        raise ValueError(f"init: must be one of {INITS}, got {init!r}")
    head = random_head(with_mtp_layers(model.config, 1), torch.float32, device, seed=seed,
                       backend=backend)
    layer = head.layers[0]
    with torch.no_grad():
        layer.norm.weight.copy_(model.norm.weight.float())
        if init == "last-layer":
            src = {k: v.float() for k, v in model.layers[-1].state_dict().items()}
            layer.block.load_state_dict(src, strict=True)
            h = model.config.hidden_size
            layer.eh_proj.weight[:, h:].copy_(torch.eye(h, device=layer.eh_proj.weight.device))
    return head.requires_grad_(True).train()


def _batch(samples: list[Sample], device: torch.device):
    """Pad a batch to one length L (tokens) / L-1 (computed positions). Returns tokens
    [B, L], hidden [B, L-1, H], top ids/logp [B, L-1, K] and valid [B, L-1]: real positions."""
    L = max(len(s.tokens) for s in samples)

    def pad(x: torch.Tensor, n: int, value: float = 0) -> torch.Tensor:
        return F.pad(x, [0, 0] * (x.dim() - 1) + [0, n - x.shape[0]], value=value)

    def stack(field: str, n: int, value: float = 0) -> torch.Tensor:
        return torch.stack([pad(getattr(s, field), n, value) for s in samples]).to(device)

    pos = torch.arange(L - 1)
    valid = torch.stack([(pos < len(s.hidden)) & (pos >= s.loss_from)
                         for s in samples]).to(device)
    return (stack("tokens", L), stack("hidden", L - 1), stack("top_ids", L - 1),
            stack("top_logp", L - 1, -30.0), valid)


def batch_loss(model, head, backend: DenseCausalBackend, samples: list[Sample],
               device: torch.device, chain_weight: float = 0.0, vocab_subset: int = 0,
               feature_weight: float = 0.0, hard_weight: float = 0.0,
               stats: dict | None = None) -> torch.Tensor:
    """Soft cross-entropy of the head's distribution at t vs the target's at t+1, plus
    (hard_weight) cross-entropy on the target's argmax there (the token greedy verification
    accepts), plus (feature_weight) a smooth-L1 pull of the head's output towards the
    target's own hidden state at t+1: both feed the same lm_head, and the 576-dim target is a
    far denser signal per position than a top-K distribution (EAGLE's observation); it also
    makes the head's output a good input for the next chained draft. stats (optional) gets
    the first draft's top-1 agreement with the target's argmax."""
    tokens, hidden, top_ids, top_logp, valid = _batch(samples, device)
    B, L1 = valid.shape  # L1 = L - 1 computed positions
    dummy = torch.empty((1, 1, head.config.num_kv_layers, 2, 1, 1), device=device)  # [NB, Hkv, L, 2, BS, D]
    backend.batch = B
    pos = torch.arange(L1, device=device).repeat(B)
    g = head(model, tokens[:, 1:].reshape(-1), hidden.reshape(B * L1, -1), pos, None, dummy)
    g = g.view(B, L1, -1)  # position t predicts token t+2: the target's distribution at t+1
    loss = _distill(model, g[:, :-1], top_ids[:, 1:], top_logp[:, 1:], valid[:, 1:],
                    vocab_subset, hard_weight, stats, "top1")
    if feature_weight > 0:
        keep = valid[:, 1:]
        loss = loss + feature_weight * F.smooth_l1_loss(g[:, :-1][keep].float(),
                                                        hidden[:, 1:][keep].float())
    if chain_weight > 0 and L1 > 2:  # draft 2: (own output at t, token t+2) at position t+1
        pos2 = torch.arange(1, L1, device=device).repeat(B)
        g2 = head(model, tokens[:, 2:].reshape(-1), g[:, :-1].reshape(B * (L1 - 1), -1), pos2,
                  None, dummy, step=1).view(B, L1 - 1, -1)
        loss = loss + chain_weight * _distill(model, g2[:, :-1], top_ids[:, 2:], top_logp[:, 2:],
                                              valid[:, 2:], vocab_subset, hard_weight, stats,
                                              "top1_chain")
    return loss


def _distill(model, g: torch.Tensor, top_ids: torch.Tensor, top_logp: torch.Tensor,
             valid: torch.Tensor, vocab_subset: int = 0, hard_weight: float = 0.0,
             stats: dict | None = None, name: str = "top1") -> torch.Tensor:
    """g [B, L', H] over valid [B, L'] positions; the target's top-K [B, L', K] there (its
    argmax first). Soft cross-entropy against the top-K distribution + hard_weight x
    cross-entropy on the argmax.

    vocab_subset > 0 (CPU speed): the softmax runs over the batch's candidate tokens (every
    top-K id) plus random others up to that many, not the whole vocabulary: the LM-head
    matmul is most of a CPU step, and the tokens that matter for argmax are the candidates."""
    keep = valid.reshape(-1)
    rows = g.reshape(-1, g.shape[-1])[keep]
    k = top_ids.shape[-1]
    ids = top_ids.reshape(-1, k)[keep]
    weight = model.lm_head.weight
    vocab = weight.shape[0]
    if 0 < vocab_subset < vocab:
        extra = torch.randint(0, vocab, (vocab_subset,), device=ids.device)
        cand = torch.unique(torch.cat([ids.reshape(-1), extra]))
        lookup = torch.zeros(vocab, dtype=torch.int64, device=ids.device)
        lookup[cand] = torch.arange(cand.numel(), device=ids.device)
        weight, ids = weight[cand], lookup[ids]
    logits = (rows.to(weight.dtype) @ weight.t()).float()  # [n, V or subset]
    logq_all = torch.log_softmax(logits, dim=-1)
    logq = logq_all.gather(-1, ids)
    loss = -(top_logp.reshape(-1, k)[keep].exp() * logq).sum(-1).mean()
    if hard_weight > 0:
        loss = loss - hard_weight * logq[:, 0].mean()
    if stats is not None:
        with torch.no_grad():
            hit = (logits.argmax(-1) == ids[:, 0]).float()
            stats[name] = stats.get(name, 0.0) + hit.sum().item()
            stats[name + "_n"] = stats.get(name + "_n", 0) + hit.numel()
    return loss


def _length_batches(samples: list[Sample], batch_size: int, rng: random.Random) -> list[list[int]]:
    """One epoch of batches: shuffled, then grouped by length within windows of 16 batches
    (less padding), the batches themselves in random order."""
    order = list(range(len(samples)))
    rng.shuffle(order)
    window = batch_size * 16
    batches = []
    for i in range(0, len(order), window):
        chunk = sorted(order[i:i + window], key=lambda j: len(samples[j].tokens))
        batches += [chunk[j:j + batch_size] for j in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


@torch.no_grad()
def evaluate_top1(model, head, backend: DenseCausalBackend, samples: list[Sample],
                  device: torch.device, batch_size: int, vocab_subset: int = 0) -> dict:
    """Top-1 agreement of the head's first (and chained second) draft with the target's
    argmax, and the distillation loss, over `samples` (no training)."""
    if not samples:
        return {}
    was_training = head.training
    head.eval()
    stats: dict = {}
    losses = []
    autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else _null()
    for i in range(0, len(samples), batch_size):
        with autocast:
            losses.append(batch_loss(model, head, backend, samples[i:i + batch_size], device,
                                     chain_weight=1.0, vocab_subset=vocab_subset,
                                     stats=stats).item())
    head.train(was_training)
    return {"loss": sum(losses) / len(losses),
            "top1": stats.get("top1", 0.0) / max(1, stats.get("top1_n", 0)),
            "top1_chain": stats.get("top1_chain", 0.0) / max(1, stats.get("top1_chain_n", 0))}


def train_head(model, samples: list[Sample], device: torch.device, *, epochs: float,
               batch_size: int, lr: float, time_budget_s: float, chain_weight: float,
               seed: int, vocab_subset: int = 0, hard_weight: float = 0.0,
               feature_weight: float = 0.0, init: str = "random",
               val_samples: list[Sample] | None = None, evals: int = 10,
               warmup_frac: float = 0.05, min_lr_frac: float = 0.1,
               history: dict | None = None) -> tuple[object, list[float]]:
    """AdamW, warm-up then cosine decay over the run's progress: the larger of steps done /
    steps planned and time spent / time budget, so a run cut by the budget still ends at
    the low learning rate. `evals` times during the run (and at the end) the head's top-1
    agreement is measured on val_samples; history (a dict) receives those curves."""
    backend = DenseCausalBackend()
    head = init_head(model, device, backend, seed, init)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    rng = random.Random(seed)
    steps = max(1, math.ceil(epochs * len(samples) / batch_size))
    warmup = max(1, int(steps * warmup_frac))
    losses: list[float] = []
    curve: list[dict] = []
    start = time.monotonic()
    queue: list[list[int]] = []
    autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else _null()
    val = list(val_samples or [])
    eval_bs = batch_size if device.type == "cuda" else max(1, batch_size // 2)
    next_eval = 1.0 / max(1, evals)
    stats: dict = {}
    bar = tqdm(total=steps, desc="training", unit="step", mininterval=_progress_interval())

    def check(step: int) -> None:
        ev = evaluate_top1(model, head, backend, val, device, eval_bs, vocab_subset)
        ev.update(step=step, seconds=round(time.monotonic() - start, 1),
                  train_top1=stats.get("top1", 0.0) / max(1, stats.get("top1_n", 0)))
        stats.clear()
        curve.append(ev)
        bar.write(f"train-mtp: step {step}: train top-1 {ev['train_top1']:.3f}, held-out slice "
                  f"top-1 {ev.get('top1', float('nan')):.3f} (chained "
                  f"{ev.get('top1_chain', float('nan')):.3f}), loss {ev.get('loss', 0):.3f}")

    step = 0
    for step in range(steps):
        progress = max(step / steps, (time.monotonic() - start) / time_budget_s)
        if progress >= 1.0:
            bar.write(f"train-mtp: time budget of {time_budget_s:.0f} s reached after {step} "
                      f"of {steps} steps")
            break
        if val and progress >= next_eval:
            check(step)
            next_eval += 1.0 / max(1, evals)
        for group in opt.param_groups:
            group["lr"] = _learning_rate(lr, step, warmup, progress, min_lr_frac)
        if not queue:
            queue = _length_batches(samples, batch_size, rng)
        batch = [samples[i] for i in queue.pop()]
        with autocast:
            loss = batch_loss(model, head, backend, batch, device, chain_weight, vocab_subset,
                              feature_weight, hard_weight, stats)
        losses.append(_optimizer_step(loss, opt, params))
        bar.update()
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}", refresh=False)
    else:
        step = steps
    if val:
        check(step)
    bar.close()
    if history is not None:
        history.update(curve=curve, steps_planned=steps, seconds=round(time.monotonic() - start, 1))
    return head.eval().requires_grad_(False), losses


def _learning_rate(lr: float, step: int, warmup: int, progress: float,
                   min_lr_frac: float) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to min_lr_frac x lr as progress
    goes 0 -> 1."""
    return lr * min(1.0, (step + 1) / warmup) * (
        min_lr_frac + (1 - min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


def _optimizer_step(loss: torch.Tensor, opt: torch.optim.Optimizer,
                    params: list[torch.nn.Parameter]) -> float:
    """Backward, clip the gradient norm to 1, one optimizer step; returns the loss."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    return loss.item()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

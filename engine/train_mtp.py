"""`pdserve train-mtp`: train an MTP head for a model by self-distillation.

    pdserve train-mtp --out engine/mtp_heads/smollm2-135m-instruct.safetensors

The recipe needs no data set and no downloads:
  1. prompts: its own templates x topics, wrapped in the model's chat template; a separate
     set of templates and topics (heldout_prompts) is never trained on and measures acceptance;
  2. continuations: the model answers them through our engine (batched; part greedy, part
     sampled at temperature ~0.8, so the head sees both what greedy decoding produces and
     some variety);
  3. teacher signal: while generating, the engine's own forward passes are recorded: the
     target's normed hidden state h[t] at every position, and its top-K next-token
     distribution there (lm_head over h[t]);
  4. training: the head reads (h[t], token[t+1]) at position t and learns the target's
     distribution at t+1 (i.e. of token t+2): cross-entropy against the target's top-K soft
     distribution (a KL to the target, better than hard labels). Embeddings and lm_head are the
     target's and stay frozen; enorm, hnorm, eh_proj, the decoder block and the final norm
     train. Optional chain loss: a second step from the head's own output (what drafts 2..k
     see). On CPU the softmax runs over a vocabulary subset (the batch's candidate tokens).
  5. evaluation: first-draft acceptance at k=1 and mean accepted length at k=3 on the
     held-out prompts, through the engine's spec-decode counters.
Outputs: the head (safetensors, fp16), <out>.json (settings, losses, acceptance), and a loss
curve <out>.png. CPU works (small defaults); CUDA runs the same recipe at a larger size.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

TRAIN_TEMPLATES = [
    "Explain {t} to a beginner.", "Write a short paragraph about {t}.",
    "What are three interesting facts about {t}?", "Give me a simple overview of {t}.",
    "Why is {t} important?", "Describe {t} in a few sentences.",
    "What should a student know about {t}?", "Summarize the history of {t}.",
    "List some pros and cons of {t}.", "How would you teach a child about {t}?",
    "Write a short story that involves {t}.", "What are common misconceptions about {t}?",
    "Compare {t} with something similar.", "Write a haiku about {t}.",
    "What questions do people often ask about {t}?", "Give practical tips related to {t}.",
    "How has {t} changed over time?", "Write an encouraging note about learning {t}.",
    "Explain {t} using an analogy.", "What are the main parts of {t}?",
]
TRAIN_TOPICS = [
    "photosynthesis", "the water cycle", "black holes", "the French Revolution", "volcanoes",
    "machine learning", "the human heart", "climate change", "the Roman Empire", "electricity",
    "gravity", "the internet", "honey bees", "the Moon", "recycling", "vaccines", "chess",
    "the Pacific Ocean", "dinosaurs", "renewable energy", "the printing press", "rainforests",
    "the immune system", "earthquakes", "Python programming", "the solar system", "coffee",
    "the Great Wall of China", "democracy", "plate tectonics", "music theory", "sleep",
    "the stock market", "bicycles", "penguins", "the periodic table", "ancient Egypt",
    "healthy eating", "photography", "the Olympic Games", "DNA", "airplanes", "deserts",
    "the Renaissance", "friendship", "time management", "the brain", "volunteering",
    "rivers", "mountains", "the Amazon", "elephants", "whales", "butterflies", "mushrooms",
    "trees", "coral reefs", "hurricanes", "tornadoes", "snow", "rainbows", "the Sun", "Mars",
    "Jupiter", "stars", "galaxies", "telescopes", "rockets", "satellites", "the speed of light",
    "magnets", "atoms", "chemistry", "algebra", "geometry", "prime numbers", "statistics",
    "probability", "calculus", "cryptography", "databases", "operating systems",
    "web browsers", "smartphones", "batteries", "electric cars", "trains", "bridges",
    "skyscrapers", "architecture", "painting", "sculpture", "poetry", "novels", "theater",
    "movies", "the piano", "the guitar", "orchestras", "dance", "cooking pasta", "baking bread",
    "chocolate", "cheese", "rice", "spices", "gardening", "composting", "bird watching",
    "hiking", "camping", "swimming", "running", "yoga", "meditation", "football", "basketball",
    "tennis", "the Middle Ages", "the Vikings", "ancient Greece", "the Aztecs",
    "the Cold War", "World War II", "the Moon landing", "the Wright brothers", "Marie Curie",
    "Isaac Newton", "Albert Einstein", "Leonardo da Vinci", "Shakespeare", "languages",
    "learning to read", "public speaking", "writing an essay", "job interviews", "budgeting",
    "saving money", "taxes", "banks", "inflation", "supply and demand", "small businesses",
    "marketing", "teamwork", "leadership", "kindness", "habits", "memory", "emotions",
    "dogs", "cats", "horses", "owls", "sharks", "frogs", "ants", "spiders", "bacteria",
    "viruses", "the skeleton", "muscles", "the lungs", "digestion", "nutrition", "water",
    "oxygen", "carbon", "plastic", "glass", "steel", "paper", "maps", "compasses", "clocks",
    "calendars", "weather forecasts", "oceans", "islands", "caves", "fossils", "gold",
]
HELDOUT_TEMPLATES = [
    "Can you tell me about {t}?", "I am curious about {t}. What is it?",
    "Write a brief explanation of {t} for a school report.", "What is the main idea behind {t}?",
]
HELDOUT_TOPICS = [
    "glaciers", "the Industrial Revolution", "octopuses", "solar panels", "the Silk Road",
    "earthworms", "jazz", "submarines", "the nervous system", "tea", "lighthouses", "comets",
]


def training_prompts(n: int, seed: int = 0) -> list[str]:
    """n user messages from TRAIN_TEMPLATES x TRAIN_TOPICS (seeded order); past the distinct
    pairs they repeat (their sampled continuations differ)."""
    pairs = [(a, b) for a in TRAIN_TEMPLATES for b in TRAIN_TOPICS]
    random.Random(seed).shuffle(pairs)
    return [tpl.format(t=topic) for tpl, topic in (pairs[i % len(pairs)] for i in range(n))]


def temperature_for(i: int, num_distinct: int) -> float:
    """First pass over the distinct prompts: greedy and 0.8 alternating (greedy text is what
    acceptance is measured on); repeats are sampled (a greedy repeat adds nothing)."""
    if i < num_distinct:
        return 0.0 if i % 2 == 0 else 0.8
    return 0.7 if i % 2 == 0 else 0.9


def heldout_prompts(n: int) -> list[str]:
    """User messages from templates and topics that training never sees."""
    pairs = [(a, b) for b in HELDOUT_TOPICS for a in HELDOUT_TEMPLATES]
    random.Random(1234).shuffle(pairs)
    return [tpl.format(t=topic) for tpl, topic in pairs[:n]]


def chat(tokenizer, message: str) -> list[int]:
    if tokenizer is None:
        raise ValueError("model: train-mtp needs a model with a tokenizer and chat template")
    return tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], add_generation_prompt=True))


# -- 1-3. the corpus -----------------------------------------------------------------------------

@dataclass
class Sample:
    """One generated sequence of L tokens; position t < L - 1 was computed by the target."""

    tokens: torch.Tensor  # [L] int64
    hidden: torch.Tensor  # [L-1, H] the target's normed hidden state at each computed position
    top_ids: torch.Tensor  # [L-1, K] the target's top-K next tokens there
    top_logp: torch.Tensor  # [L-1, K] their log-probabilities (renormalised over K)
    loss_from: int = 0  # first position to learn at (the shared system prompt teaches nothing)


class HiddenRecorder:
    """Keeps the normed hidden state of every position the engine's target computes, by
    wrapping runner.run (which rows belong to whom) around a forward hook on the model (the
    rows). The states are the engine's own, so the head trains on what it will see when
    serving. Needs an eager engine (no CUDA graphs) without prefix caching."""

    def __init__(self, engine) -> None:
        self.rows: dict[str, list[torch.Tensor]] = {}
        self._last: torch.Tensor | None = None
        runner = engine.runner
        self._hook = runner.model.register_forward_hook(self._on_forward)
        self._run = runner.run
        runner.run = self._on_run

    def _on_forward(self, module, args, output) -> None:
        self._last = output[0] if isinstance(output, tuple) else output

    def _on_run(self, out, **kw):
        result = self._run(out, **kw)
        hidden, row = self._last, 0
        for s in out.scheduled:
            chunks = self.rows.setdefault(s.request.request_id, [])
            if s.start_pos == 0:  # computed from the start (again, after a preemption)
                chunks.clear()
            # clone outside inference mode: a normal tensor, usable in autograd later
            chunks.append(hidden[row:row + s.num_new_tokens].float().cpu().clone())
            row += s.num_new_tokens
        return result

    def take(self, request_id: str) -> torch.Tensor:
        return torch.cat(self.rows.pop(request_id))


class PaddedDecodeBackend:
    """CPU generation speed: a decode-only step attends for all sequences in ONE padded SDPA
    call (the torch reference loops over sequences, which dominates a 64-sequence CPU step).
    Anything else falls back to the reference."""

    name = "torch-padded"

    def write_kv(self, k, v, k_cache, v_cache, meta) -> None:
        from engine.attention import write_kv

        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)

    def attend(self, q, k_cache, v_cache, meta, scale) -> torch.Tensor:
        from engine.attention import paged_attention_torch

        if not meta.is_decode_only:
            return paged_attention_torch(q, k_cache, v_cache, meta, scale)
        bs, longest = k_cache.shape[1], meta.max_seq_len
        tables = meta.block_tables[:, :-(-longest // bs)].long()  # [B, nb], padded with 0
        k = k_cache[tables].flatten(1, 2)[:, :longest].transpose(1, 2)  # [B, Hkv, S, D]
        v = v_cache[tables].flatten(1, 2)[:, :longest].transpose(1, 2)
        mask = torch.arange(longest, device=q.device)[None, :] < meta.seq_lens[:, None]
        o = F.scaled_dot_product_attention(q[:, :, None, :], k.to(q.dtype), v.to(q.dtype),
                                           attn_mask=mask[:, None, None, :], scale=scale,
                                           enable_gqa=True)  # [B, Hq, 1, D]
        return o[:, :, 0, :]


def generation_engine(model: str | None, device: str, seed: int):
    """The engine that writes the corpus: eager (the recorder hooks the model's forward), no
    prefix caching (every position of every sequence must be computed, the shared system
    prompt included). CUDA: Triton kernels; CPU: the padded decode attention above."""
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.engine import LLMEngine
    from engine.llm import build_engine
    from engine.model_source import load_model

    if device.startswith("cuda"):
        return build_engine(model, device=device, max_num_seqs=256, max_num_batched_tokens=16384,
                            max_model_len=2048, enable_prefix_caching=False, use_triton=True,
                            seed=seed)
    net, cfg, tokenizer = load_model(model, dtype="float32", device=device,
                                     backend=PaddedDecodeBackend())
    config = EngineConfig(
        model=cfg, cache=CacheConfig(block_size=16, num_blocks=8192, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=4096,
                                  max_model_len=1024), device=device, seed=seed)
    return LLMEngine(config, net, tokenizer)


def generate_corpus(engine, prompts: list[list[int]], max_tokens: int,
                    temperatures: list[float], seed: int, top_k: int = 32) -> list[Sample]:
    """The model answers every prompt (temperatures[i] for prompt i); returns each sequence
    with the target's hidden states and top-K next-token distributions."""
    from engine.sampling_params import SamplingParams

    recorder = HiddenRecorder(engine)
    tokens: dict[str, list[int]] = {}
    for i, ids in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens, temperature=temperatures[i],
                                seed=seed + i)
        [rid] = engine.add_request(ids, params, request_id=f"train-{i}")
        tokens[rid] = list(ids)
    bar = tqdm(total=len(prompts) * max_tokens, desc="generating", unit="tok")
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            bar.update(len(out.new_token_ids) + (max_tokens - out.num_output_tokens
                                                 if out.finished else 0))
    bar.close()
    model = engine.runner.model
    shared = _common_prefix(prompts)
    samples = []
    for rid, seq in tokens.items():
        hidden = recorder.take(rid)[:len(seq) - 1]
        top_ids, top_logp = _top_k(model, hidden, top_k)
        samples.append(Sample(torch.tensor(seq), hidden, top_ids, top_logp,
                              max(0, shared - 2)))
    return samples


def _common_prefix(seqs: list[list[int]]) -> int:
    n = min(len(s) for s in seqs)
    for i in range(n):
        if any(s[i] != seqs[0][i] for s in seqs):
            return i
    return n


@torch.no_grad()
def _top_k(model, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's top-k next tokens at each row of hidden [N, H] (on CPU)."""
    weight = model.lm_head.weight
    logits = model.compute_logits(hidden.to(weight.device, weight.dtype))
    top_logp, top_ids = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
    top_logp = top_logp - torch.logsumexp(top_logp, dim=-1, keepdim=True)
    return top_ids.cpu(), top_logp.float().cpu()


# -- 3-4. training --------------------------------------------------------------------------------

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


def init_head(model, device: torch.device, backend: DenseCausalBackend, seed: int = 0):
    """fp32 head, N(0, 0.02) matrices and unit norms. (Starting the block as a copy of the
    target's last layer learned slower in our runs: that layer expects a residual stream.)"""
    from engine.mtp import random_head, with_mtp_layers

    head = random_head(with_mtp_layers(model.config, 1), torch.float32, device, seed=seed,
                       backend=backend)
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
               feature_weight: float = 0.0) -> torch.Tensor:
    """Soft cross-entropy of the head's distribution at t vs the target's at t+1, plus
    (feature_weight) a smooth-L1 pull of the head's output towards the target's own hidden
    state at t+1: both feed the same lm_head, and the 576-dim target is a far denser signal
    per position than a top-K distribution (EAGLE's observation)."""
    tokens, hidden, top_ids, top_logp, valid = _batch(samples, device)
    B, L1 = valid.shape  # L1 = L - 1 computed positions
    dummy = torch.empty((1, head.config.num_kv_layers, 2, 1, 1, 1), device=device)
    backend.batch = B
    pos = torch.arange(L1, device=device).repeat(B)
    g = head(model, tokens[:, 1:].reshape(-1), hidden.reshape(B * L1, -1), pos, None, dummy)
    g = g.view(B, L1, -1)  # position t predicts token t+2: the target's distribution at t+1
    loss = _soft_ce(model, g[:, :-1], top_ids[:, 1:], top_logp[:, 1:], valid[:, 1:],
                    vocab_subset)
    if feature_weight > 0:
        keep = valid[:, 1:]
        loss = loss + feature_weight * F.smooth_l1_loss(g[:, :-1][keep].float(),
                                                        hidden[:, 1:][keep].float())
    if chain_weight > 0 and L1 > 2:  # draft 2: (own output at t, token t+2) at position t+1
        pos2 = torch.arange(1, L1, device=device).repeat(B)
        g2 = head(model, tokens[:, 2:].reshape(-1), g[:, :-1].reshape(B * (L1 - 1), -1), pos2,
                  None, dummy, step=1).view(B, L1 - 1, -1)
        loss = loss + chain_weight * _soft_ce(model, g2[:, :-1], top_ids[:, 2:],
                                              top_logp[:, 2:], valid[:, 2:], vocab_subset)
    return loss


def _soft_ce(model, g: torch.Tensor, top_ids: torch.Tensor, top_logp: torch.Tensor,
             valid: torch.Tensor, vocab_subset: int = 0) -> torch.Tensor:
    """g [B, L', H] over valid [B, L'] positions; the target's top-K [B, L', K] there.

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
    logq = torch.log_softmax(logits, dim=-1).gather(-1, ids)
    return -(top_logp.reshape(-1, k)[keep].exp() * logq).sum(-1).mean()


def train_head(model, samples: list[Sample], device: torch.device, *, epochs: float,
               batch_size: int, lr: float, time_budget_s: float, chain_weight: float,
               seed: int, vocab_subset: int = 0) -> tuple[object, list[float]]:
    """AdamW, warm-up then cosine decay over the run's progress: the larger of steps done /
    steps planned and time spent / time budget, so a run cut by the budget still ends at
    the low learning rate."""
    backend = DenseCausalBackend()
    head = init_head(model, device, backend, seed)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    rng = random.Random(seed)
    steps = max(1, math.ceil(epochs * len(samples) / batch_size))
    warmup = max(1, steps // 20)
    losses: list[float] = []
    start = time.monotonic()
    order: list[int] = []
    autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else _null()
    bar = tqdm(total=steps, desc="training", unit="step")
    for step in range(steps):
        progress = max(step / steps, (time.monotonic() - start) / time_budget_s)
        if progress >= 1.0:
            print(f"train-mtp: time budget of {time_budget_s:.0f} s reached after {step} of "
                  f"{steps} steps", file=sys.stderr)
            break
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / warmup) * (
                0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        if len(order) < batch_size:
            fresh = list(range(len(samples)))
            rng.shuffle(fresh)
            order += fresh
        batch, order = [samples[i] for i in order[:batch_size]], order[batch_size:]
        with autocast:
            loss = batch_loss(model, head, backend, batch, device, chain_weight, vocab_subset)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        bar.update()
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
    bar.close()
    return head.eval().requires_grad_(False), losses


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# -- 5. evaluation ----------------------------------------------------------------------------

def measure_acceptance(model_name: str | None, head_path: str, prompts: list[str], k: int,
                       max_tokens: int, device: str) -> dict:
    """Greedy decoding of `prompts` with k drafts per step; numbers from the engine counters."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    from engine.spec_decode import SpecConfig

    llm = LLM(model_name, device=device, speculative=SpecConfig(
        num_speculative_tokens=k, batch_k_caps=()), mtp_head=head_path)
    ids = [chat(llm.tokenizer, p) for p in prompts]
    llm.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    st = llm.engine.spec_stats
    per_pos = [n / max(1, st.num_drafts) for n in st.num_accepted_tokens_per_pos]
    return {"k": k, "num_drafts": st.num_drafts, "num_draft_tokens": st.num_draft_tokens,
            "num_accepted_tokens": st.num_accepted_tokens,
            "acceptance_rate": st.acceptance_rate, "first_draft_acceptance": per_pos[0],
            "acceptance_per_pos": per_pos, "mean_accepted_length": st.mean_accepted_length}


def plot_losses(losses: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = max(1, len(losses) // 50)
    smooth = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
              for i in range(len(losses))]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(losses, alpha=0.3, label="batch loss")
    ax.plot(smooth, label=f"moving mean ({window})")
    ax.set_xlabel("step")
    ax.set_ylabel("soft cross-entropy (nats)")
    ax.set_title("MTP head self-distillation")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- CLI -------------------------------------------------------------------------------------

def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-mtp", help="train an MTP head by self-distillation (CPU or one GPU)")
    p.add_argument("--model", default=None,
                   help="HF folder, .gguf, or (default) the embedded SmolLM2-135M-Instruct")
    p.add_argument("--out", required=True, help="output .safetensors (plus .json and .png)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    p.add_argument("--num-prompts", type=int, default=None, help="default: 512 CPU, 4608 GPU")
    p.add_argument("--max-tokens", type=int, default=None, help="default: 128 CPU, 384 GPU")
    p.add_argument("--epochs", type=float, default=None, help="default: 5 CPU, 4 GPU")
    p.add_argument("--vocab-subset", type=int, default=None,
                   help="softmax over this many candidate tokens (default: 4096 CPU, full GPU)")
    p.add_argument("--batch-size", type=int, default=None, help="default: 16 CPU, 32 GPU")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--chain-weight", type=float, default=None,
                   help="weight of the draft-2 loss, the head reading its own output "
                        "(default: 0 CPU, 0.5 GPU)")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="training time cap (default: 420 s CPU, 240 s GPU)")
    p.add_argument("--eval-prompts", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_train)


def _cmd_train(args: argparse.Namespace) -> int:
    from engine.llm import default_device

    device = args.device or default_device()
    gpu = device.startswith("cuda")
    n_prompts = args.num_prompts or (4608 if gpu else 512)
    max_tokens = args.max_tokens or (384 if gpu else 128)
    epochs = args.epochs or (4.0 if gpu else 5.0)
    t0 = time.monotonic()
    torch.manual_seed(args.seed)
    engine = generation_engine(args.model, device, args.seed)
    prompts = [chat(engine.tokenizer, m) for m in training_prompts(n_prompts, args.seed)]
    distinct = len(TRAIN_TEMPLATES) * len(TRAIN_TOPICS)
    temps = [temperature_for(i, distinct) for i in range(n_prompts)]
    samples = generate_corpus(engine, prompts, max_tokens, temps, args.seed)
    model = engine.runner.model
    t_gen = time.monotonic() - t0
    head, losses = train_head(model, samples, torch.device(device), epochs=epochs,
                              batch_size=args.batch_size or (32 if gpu else 16), lr=args.lr,
                              time_budget_s=args.time_budget_s or (240.0 if gpu else 420.0),
                              chain_weight=(args.chain_weight if args.chain_weight is not None
                                            else 0.5 if gpu else 0.0), seed=args.seed,
                              vocab_subset=args.vocab_subset if args.vocab_subset is not None
                              else (0 if gpu else 4096))
    t_train = time.monotonic() - t0 - t_gen
    out = Path(args.out)
    from engine.mtp import save_mtp_head

    save_mtp_head(head, out, extra={"base_model": str(args.model or "smollm2-135m-instruct"),
                                    "recipe": "pdserve train-mtp self-distillation"})
    plot_losses(losses, out.with_suffix(".png"))
    held = heldout_prompts(args.eval_prompts)
    report = {"model": args.model, "device": device, "num_prompts": n_prompts,
              "max_tokens": max_tokens, "train_tokens": sum(len(x.tokens) for x in samples),
              "steps": len(losses), "final_loss": sum(losses[-20:]) / len(losses[-20:]),
              "generate_s": round(t_gen, 1), "train_s": round(t_train, 1),
              "eval_k1": measure_acceptance(args.model, str(out), held, 1, 64, device),
              "eval_k3": measure_acceptance(args.model, str(out), held, 3, 64, device),
              "losses": losses}
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "losses"}, indent=1))
    return 0

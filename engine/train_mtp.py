"""`pdserve train-mtp`: train an MTP head for a model by self-distillation.

    pdserve train-mtp --out engine/mtp_heads/smollm2-135m-instruct.safetensors
    pdserve train-mtp --device cuda --model /tmp/smollm2.gguf --out /tmp/head.safetensors

The recipe needs no data set and no downloads:
  1. prompts: its own templates x topics plus generated tasks (arithmetic, code, writing),
     wrapped in the model's chat template; a separate set of templates and topics
     (heldout_prompts) is never trained on and measures acceptance;
  2. continuations: the model answers them through our engine, many sequences at once
     (CUDA: Triton kernels, CUDA-graph decode steps, 512 sequences in flight, refilled in
     waves so most steps are pure decode steps); the first pass over the distinct prompts
     is mostly greedy (what verification compares drafts against), the rest sampled at
     temperature 0.6-0.9 for variety. CUDA runs are time-budgeted (--gen-time-s): as many
     sequences as fit; sequences cut by the budget keep what they have;
  3. teacher signal: while generating, the engine's own forward passes are recorded: the
     target's normed hidden state h[t] at every position, and its top-K next-token
     distribution there (lm_head over h[t]);
  4. training: the head reads (h[t], token[t+1]) at position t and learns the target's
     distribution at t+1 (i.e. of token t+2): soft cross-entropy against the target's top-K
     distribution plus (--hard-weight) cross-entropy on its argmax, the token greedy
     verification accepts. Embeddings and lm_head are the target's and stay frozen; enorm,
     hnorm, eh_proj, the decoder block and the final norm train (the final norm starts as
     the target's, --init last-layer also starts the block as the target's last layer).
     Optional chain loss: a second step from the head's own output (what drafts 2..k see),
     and (--feature-weight) a pull of the head's output towards the target's hidden state
     at t+1 (EAGLE's feature loss: drafts 2..k then read an in-distribution state). AdamW,
     warm-up then cosine decay, bf16 autocast on CUDA, batches grouped by length; a slice of
     the corpus is held out for top-1 agreement curves. On CPU the softmax runs over a
     vocabulary subset (the batch's candidate tokens).
  5. evaluation: first-draft acceptance at k=1 and mean accepted length at k=3 on the
     held-out prompts, through the engine's spec-decode counters.
Outputs: the head (safetensors, fp16), <out>.json (settings, timings, losses, top-1 curves,
acceptance) and a loss curve <out>.png (matplotlib, or a plain plot without it). CPU works
(small defaults); CUDA runs the same recipe at a larger size within --deadline-s.
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
    "Tell me a fun fact about {t}.", "Explain how {t} works.", "Write a short poem about {t}.",
    "Give an example of {t} in everyday life.", "What are the benefits of {t}?",
    "What are the risks or downsides of {t}?", "Write a tweet about {t}.",
    "Describe {t} to someone who has never heard of it.",
    "Write three quiz questions about {t}, with answers.", "How do scientists study {t}?",
    "What is the future of {t}?", "Write a dialogue between two friends discussing {t}.",
    "Explain {t} in one paragraph.", "What words are related to {t}?",
    "Create a short lesson plan about {t}.", "What are five key terms about {t}?",
    "Why do people find {t} fascinating?", "Give a step-by-step explanation of {t}.",
    "Write a paragraph for a children's book about {t}.",
    "What would the world be like without {t}?",
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
TRAIN_TOPICS += [
    "the ocean tides", "the atmosphere", "wind turbines", "nuclear energy", "quantum physics",
    "evolution", "genetics", "cells", "the human eye", "the ear", "teeth", "the heart rate",
    "blood", "the kidneys", "the liver", "the skin", "hormones", "allergies", "fever",
    "exercise", "stretching", "posture", "hydration", "breakfast", "vegetables", "fruit",
    "bread", "soup", "pizza", "sushi", "tacos", "curry", "salad", "ice cream", "honey",
    "sugar", "salt", "olive oil", "fermentation", "yogurt", "farming", "tractors", "wheat",
    "corn", "potatoes", "tomatoes", "apples", "bananas", "oranges", "grapes", "wine making",
    "forests", "wetlands", "grasslands", "the Arctic", "Antarctica", "the Sahara",
    "the Himalayas", "the Alps", "the Nile", "the Mississippi River", "Lake Baikal",
    "Australia", "Japan", "Brazil", "Canada", "India", "Kenya", "Mexico", "Norway", "Egypt",
    "Paris", "London", "New York City", "Tokyo", "Rome", "cities", "villages", "roads",
    "traffic", "public transport", "bicycles in cities", "ships", "sailing", "airports",
    "helicopters", "drones", "robots", "artificial intelligence", "neural networks",
    "computer programming", "JavaScript", "SQL", "Linux", "cloud computing",
    "cybersecurity", "passwords", "email", "social media", "video games", "virtual reality",
    "3D printing", "semiconductors", "transistors", "the telephone", "radio", "television",
    "cameras", "microscopes", "lasers", "sound waves", "light", "color", "heat",
    "temperature", "energy", "friction", "momentum", "simple machines", "levers", "pulleys",
    "engines", "steam power", "electric motors", "circuits", "solar eclipses", "the seasons",
    "day and night", "the calendar year", "leap years", "time zones", "money", "credit cards",
    "interest rates", "investing", "insurance", "entrepreneurship", "customer service",
    "negotiation", "meetings", "remote work", "productivity", "goal setting", "motivation",
    "stress", "happiness", "gratitude", "empathy", "honesty", "courage", "patience",
    "curiosity", "creativity", "critical thinking", "debate", "philosophy", "ethics",
    "logic", "history museums", "libraries", "schools", "universities", "homework",
    "exams", "note taking", "reading books", "writing poetry", "grammar", "punctuation",
    "spelling", "learning a language", "sign language", "Spanish", "Chinese characters",
    "mythology", "fairy tales", "superheroes", "comics", "animation", "photography tips",
    "drawing", "pottery", "knitting", "woodworking", "origami", "magic tricks", "puzzles",
    "board games", "card games", "the Olympics history", "soccer", "baseball", "cycling",
    "skiing", "surfing", "rock climbing", "martial arts", "marathons", "birds", "parrots",
    "eagles", "wolves", "bears", "lions", "tigers", "giraffes", "zebras", "kangaroos",
    "koalas", "pandas", "dolphins", "sea turtles", "jellyfish", "crabs", "salmon", "bees",
    "ladybugs", "snails", "lizards", "snakes", "crocodiles", "camels", "cows", "chickens",
    "pets", "veterinarians", "doctors", "nurses", "firefighters", "teachers", "engineers",
    "scientists", "astronauts", "pilots", "farmers", "chefs", "artists", "musicians",
    "the Eiffel Tower", "the pyramids", "castles", "knights", "pirates", "explorers",
    "Christopher Columbus", "the Titanic", "the Great Depression", "the American Revolution",
    "the Declaration of Independence", "the United Nations", "elections", "laws",
    "human rights", "recycling plastic", "pollution", "air quality", "deforestation",
    "endangered species", "national parks", "zoos", "aquariums", "weather", "clouds",
    "rain", "lightning", "fog", "wind", "floods", "droughts", "wildfires", "tsunamis",
]
TRAIN_TOPICS = list(dict.fromkeys(TRAIN_TOPICS))  # one of each
HELDOUT_TEMPLATES = [
    "Can you tell me about {t}?", "I am curious about {t}. What is it?",
    "Write a brief explanation of {t} for a school report.", "What is the main idea behind {t}?",
]
HELDOUT_TOPICS = [
    "glaciers", "the Industrial Revolution", "octopuses", "solar panels", "the Silk Road",
    "earthworms", "jazz", "submarines", "the nervous system", "tea", "lighthouses", "comets",
]
# generated tasks: other answer styles (numbers, code, letters) than topic explanations
_CODE_TASKS = [
    "reverses a string", "checks if a number is prime", "computes the factorial of n",
    "sorts a list of numbers", "counts the vowels in a string",
    "finds the largest number in a list", "merges two sorted lists",
    "checks if a word is a palindrome", "returns the first n Fibonacci numbers",
    "removes duplicates from a list", "converts Celsius to Fahrenheit",
    "counts the words in a sentence", "computes the average of a list",
    "finds the second smallest number in a list", "checks if two words are anagrams",
    "capitalizes every word in a sentence", "computes the greatest common divisor of two numbers",
    "flattens a nested list", "counts how often each letter appears in a string",
    "returns the even numbers from a list", "checks if a year is a leap year",
    "converts a number to binary", "sums the digits of a number", "finds the median of a list",
]
_CODE_TEMPLATES = ["Write a Python function that {x}.",
                   "How do I write a JavaScript function that {x}?",
                   "Explain, with code, how to write a program that {x}."]
_WRITING = [
    "Write an email to my {a} asking for {b}.", "Write a thank-you note to my {a} for {b}.",
    "Give me a polite way to tell my {a} about {b}.",
]
_WHO = ["teacher", "boss", "neighbor", "friend", "landlord", "coach", "grandmother", "colleague"]
_WHAT = ["a day off", "help with a project", "the noise at night", "a book recommendation",
         "feedback on my work", "a birthday party", "a late payment", "a meeting next week"]


def training_prompts(n: int, seed: int = 0) -> list[str]:
    """n user messages from TRAIN_TEMPLATES x TRAIN_TOPICS (seeded order); past the distinct
    pairs they repeat (their sampled continuations differ)."""
    pairs = [(a, b) for a in TRAIN_TEMPLATES for b in TRAIN_TOPICS]
    random.Random(seed).shuffle(pairs)
    return [tpl.format(t=topic) for tpl, topic in (pairs[i % len(pairs)] for i in range(n))]


def task_prompts(n: int, seed: int = 0) -> list[str]:
    """n generated tasks: arithmetic and word problems (fresh numbers each), code, letters."""
    rng = random.Random(seed + 101)
    out = []
    for _ in range(n):
        kind = rng.random()
        a, b = rng.randint(2, 999), rng.randint(2, 99)
        if kind < 0.35:
            out.append(rng.choice([
                f"What is {a} + {b}?", f"What is {a} times {b}?", f"What is {a} minus {b}?",
                f"Solve for x: {b}x + {a} = {a + b * rng.randint(1, 20)}.",
                f"What is {b}% of {a}?", f"Is {a} a prime number?",
                f"If a train travels {a} km in {b % 9 + 1} hours, what is its average speed?",
                f"I have {a} apples and give away {min(a - 1, b)}. How many are left?",
                f"Convert {a} minutes to hours and minutes."]))
        elif kind < 0.7:
            out.append(rng.choice(_CODE_TEMPLATES).format(x=rng.choice(_CODE_TASKS)))
        else:
            out.append(rng.choice(_WRITING).format(a=rng.choice(_WHO), b=rng.choice(_WHAT)))
    return out


def corpus_prompts(n: int, seed: int = 0, task_fraction: float = 0.15) -> list[str]:
    """The training mixture: topic prompts with a share of generated tasks, interleaved."""
    n_tasks = int(round(n * task_fraction))
    topics, tasks = training_prompts(n - n_tasks, seed), task_prompts(n_tasks, seed)
    out, ti = [], 0
    for i in range(n):  # spread the tasks evenly, so a cut by the time budget keeps the mix
        if ti < n_tasks and (i + 1) * n_tasks >= (ti + 1) * n:
            out.append(tasks[ti])
            ti += 1
        else:
            out.append(topics[i - ti])
    return out


def temperature_for(i: int, num_distinct: int) -> float:
    """First pass over the distinct prompts: mostly greedy (3 of 4: greedy text is what
    verification accepts), some sampled at 0.8; repeats are sampled (a greedy repeat adds
    nothing)."""
    if i < num_distinct:
        return 0.8 if i % 4 == 3 else 0.0
    return 0.6 if i % 2 == 0 else 0.9


def heldout_prompts(n: int) -> list[str]:
    """User messages from templates and topics that training never sees."""
    pairs = [(a, b) for b in HELDOUT_TOPICS for a in HELDOUT_TEMPLATES]
    random.Random(1234).shuffle(pairs)
    return [tpl.format(t=topic) for tpl, topic in pairs[:n]]


def chat_text(tokenizer, message: str) -> str:
    if tokenizer is None:
        raise ValueError("model: train-mtp needs a model with a tokenizer and chat template")
    return tokenizer.apply_chat_template([{"role": "user", "content": message}],
                                         add_generation_prompt=True)


def chat(tokenizer, message: str) -> list[int]:
    return tokenizer.encode(chat_text(tokenizer, message))


class ChatPrompts:
    """The chat-templated token ids of `messages`, made when first asked for (a CUDA run
    lists far more prompts than its time budget reaches). The template is rendered once
    around a placeholder and the message spliced in (jinja costs ~3 ms a render, encoding
    0.1 ms); checked against full renders of the first messages, else every one is rendered."""

    _PLACEHOLDER = "\u2063pdserve-train-mtp\u2063"

    def __init__(self, tokenizer, messages: list[str]) -> None:
        self.tokenizer, self.messages = tokenizer, messages
        self._ids: dict[int, list[int]] = {}
        parts = chat_text(tokenizer, self._PLACEHOLDER).split(self._PLACEHOLDER)
        self._affix = (parts[0], parts[1]) if len(parts) == 2 else None
        if self._affix is not None and any(
                self._splice(m) != chat(tokenizer, m) for m in messages[:8]):
            self._affix = None

    def _splice(self, message: str) -> list[int]:
        pre, post = self._affix
        return self.tokenizer.encode(pre + message + post)

    def __len__(self) -> int:
        return len(self.messages)

    def __getitem__(self, i: int) -> list[int]:
        if i not in self._ids:
            m = self.messages[i]
            self._ids[i] = self._splice(m) if self._affix else chat(self.tokenizer, m)
        return self._ids[i]


def _progress_interval() -> float:
    """tqdm refresh: every 2 s on a terminal, every 15 s into a log (keeps logs short)."""
    return 2.0 if sys.stderr.isatty() else 15.0


# -- 1-3. the corpus -----------------------------------------------------------------------------

@dataclass
class Sample:
    """One generated sequence of L tokens; position t < L - 1 was computed by the target.
    Tensors live where training runs (CUDA: on the GPU, hidden in the model's dtype)."""

    tokens: torch.Tensor  # [L] int64
    hidden: torch.Tensor  # [L-1, H] the target's normed hidden state at each computed position
    top_ids: torch.Tensor  # [L-1, K] the target's top-K next tokens there (argmax first)
    top_logp: torch.Tensor  # [L-1, K] their log-probabilities (renormalised over K)
    loss_from: int = 0  # first position to learn at (the shared system prompt teaches nothing)


class HiddenRecorder:
    """Keeps the normed hidden state of every position the engine's target computes, by
    wrapping runner.run (which rows belong to whom) around the runner's forward (the rows;
    CUDA-graph replays included) or, failing that, a forward hook on the model (eager only).
    The states are the engine's own, so the head trains on what it will see when serving.
    Needs an engine without prefix caching (every position must be computed)."""

    def __init__(self, engine, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        self.rows: dict[str, list[torch.Tensor]] = {}
        self.device, self.dtype = torch.device(device), dtype
        self._last: torch.Tensor | None = None
        runner = engine.runner
        self._hook = None
        if callable(getattr(runner, "_forward", None)):
            self._forward = runner._forward
            runner._forward = self._on_forward
        else:
            if getattr(runner, "cuda_graphs", None) is not None:
                raise RuntimeError("train-mtp: cannot record hidden states of CUDA-graph steps "
                                   "here; run with --no-gen-cuda-graphs")
            self._hook = runner.model.register_forward_hook(self._on_model)
        self._run = runner.run
        runner.run = self._on_run

    def _on_forward(self, *args, **kw):
        out = self._forward(*args, **kw)
        self._last = out[0] if isinstance(out, tuple) else out
        return out

    def _on_model(self, module, args, output) -> None:
        self._last = output[0] if isinstance(output, tuple) else output

    def _on_run(self, out, *args, **kw):
        self._last = None
        result = self._run(out, *args, **kw)
        total = sum(s.num_new_tokens for s in out.scheduled)
        hidden = self._last
        if hidden is None or hidden.shape[0] < total:
            raise RuntimeError("train-mtp: the hidden-state recorder missed a step's rows (did "
                               "the runner change?); try --no-gen-cuda-graphs")
        # one copy per step, outside inference mode (a normal tensor, usable in autograd)
        step = hidden[:total].to(self.device, self.dtype, copy=True)
        row = 0
        for s in out.scheduled:
            chunks = self.rows.setdefault(s.request.request_id, [])
            if s.start_pos == 0:  # computed from the start (again, after a preemption)
                chunks.clear()
            chunks.append(step[row:row + s.num_new_tokens])
            row += s.num_new_tokens
        return result

    def take(self, request_id: str) -> torch.Tensor | None:
        chunks = self.rows.pop(request_id, None)
        return torch.cat(chunks) if chunks else None


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


def generation_engine(model: str | None, device: str, seed: int, *, max_num_seqs: int | None = None,
                      max_model_len: int | None = None, cuda_graphs: bool = True,
                      fast: bool | None = None):
    """The engine that writes the corpus: no prefix caching (every position of every sequence
    must be computed, the shared system prompt included). Fast path (default on CUDA): Triton
    kernels and CUDA-graph decode steps (falls back to eager if capture fails); else (CPU)
    the padded decode attention above."""
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.engine import LLMEngine
    from engine.llm import build_engine
    from engine.model_source import load_model

    fast = device.startswith("cuda") if fast is None else fast
    if fast:
        seqs, max_len = max_num_seqs or 512, max_model_len or 1024
        kw = dict(device=device, max_num_seqs=seqs, max_num_batched_tokens=max(16384, 64 * seqs),
                  max_model_len=max_len, num_blocks=seqs * -(-max_len // 16) + 64,
                  enable_prefix_caching=False, use_triton=True, seed=seed)
        graphs = cuda_graphs and device.startswith("cuda")
        try:
            return build_engine(model, use_cuda_graphs=graphs, **kw)
        except Exception as e:  # noqa: BLE001  graphs are a speed-up, never a requirement
            if not graphs:
                raise
            print(f"train-mtp: CUDA-graph capture failed ({type(e).__name__}: {e}); "
                  "generating eagerly", file=sys.stderr)
            return build_engine(model, use_cuda_graphs=False, **kw)
    net, cfg, tokenizer = load_model(model, dtype="float32", device=device,
                                     backend=PaddedDecodeBackend())
    seqs, max_len = max_num_seqs or 128, max_model_len or 1024
    config = EngineConfig(
        model=cfg, cache=CacheConfig(block_size=16, num_blocks=max(8192, seqs * max_len // 16),
                                     enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=4096,
                                  max_model_len=max_len), device=device, seed=seed)
    return LLMEngine(config, net, tokenizer)


def generate_corpus(engine, prompts: "list[list[int]] | ChatPrompts", max_tokens: int,
                    temperatures: list[float], seed: int, top_k: int = 32, *,
                    time_budget_s: float | None = None, refill_below: float = 0.75,
                    store_device: torch.device | str = "cpu",
                    store_dtype: torch.dtype = torch.float32,
                    min_new_tokens: int = 8, info: dict | None = None) -> list[Sample]:
    """The model answers the prompts (temperatures[i] for prompt i), max_num_seqs at a time:
    new prompts join in waves whenever fewer than `refill_below` of the slots are busy (so
    most steps are decode-only steps, which CUDA graphs replay). Returns each sequence with
    the target's hidden states and top-K next-token distributions.

    time_budget_s: stop admitting prompts then; sequences still running are cut where they
    are (those with at least min_new_tokens new tokens are kept: every recorded position is
    a valid training position), prompts never started are dropped. info (a dict) receives
    the counts and the rate."""
    from engine.sampling_params import InvalidRequestError, SamplingParams

    recorder = HiddenRecorder(engine, store_device, store_dtype)
    tokenizer, engine.tokenizer = engine.tokenizer, None  # token ids in, no detokenizing
    sched = engine.scheduler
    slots = engine.config.scheduler.max_num_seqs
    tokens: dict[str, list[int]] = {}
    n_prompt: dict[str, int] = {}
    finished: set[str] = set()
    start = time.monotonic()
    deadline = None if time_budget_s is None else start + time_budget_s
    nxt, generated, cut = 0, 0, False
    bar = tqdm(total=len(prompts) * max_tokens if deadline is None else None,
               desc="generating", unit="tok", mininterval=_progress_interval())
    try:
        while True:
            if deadline is not None and time.monotonic() >= deadline:
                cut = nxt < len(prompts) or engine.has_unfinished()
                break
            busy = sched.num_running + sched.num_waiting
            if nxt < len(prompts) and busy < refill_below * slots:
                while nxt < len(prompts) and busy < slots:
                    params = SamplingParams(max_tokens=max_tokens, temperature=temperatures[nxt],
                                            seed=seed + nxt)
                    try:
                        [rid] = engine.add_request(prompts[nxt], params,
                                                   request_id=f"train-{nxt}")
                    except InvalidRequestError:  # e.g. longer than the engine's max_model_len
                        nxt += 1
                        continue
                    tokens[rid], n_prompt[rid] = list(prompts[nxt]), len(prompts[nxt])
                    nxt, busy = nxt + 1, busy + 1
            if not engine.has_unfinished():
                break
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
                generated += len(out.new_token_ids)
                bar.update(len(out.new_token_ids))
                if out.finished:
                    finished.add(out.request_id)
            bar.set_postfix(seqs=f"{len(finished)}/{nxt}", refresh=False)
    finally:
        bar.close()
        engine.tokenizer = tokenizer
    if cut:
        for rid in list(tokens):
            if rid not in finished:
                engine.abort_request(rid)
    elapsed = time.monotonic() - start
    print(f"train-mtp: generated {generated} tokens in {len(finished)} finished + "
          f"{len(tokens) - len(finished)} cut sequences in {elapsed:.0f} s "
          f"({generated / max(elapsed, 1e-9):.0f} tok/s)", file=sys.stderr)
    if info is not None:
        info.update(prompts_started=len(tokens), finished=len(finished),
                    cut=len(tokens) - len(finished), generated_tokens=generated,
                    seconds=round(elapsed, 1), tok_s=round(generated / max(elapsed, 1e-9), 1),
                    steps=getattr(engine.stats, "steps", None),
                    graph_replays=getattr(getattr(engine.runner, "cuda_graphs", None),
                                          "replays", None))

    # the shared prefix (system prompt) of the prompts: nothing to learn there
    shared = _common_prefix([prompts[i] for i in range(min(nxt, len(prompts)))]) if nxt else 0
    model = engine.runner.model
    kept: list[tuple[list[int], torch.Tensor]] = []
    for rid, seq in tokens.items():
        hidden = recorder.take(rid)
        if hidden is None:
            continue
        if rid not in finished:  # cut: keep the positions computed so far
            if len(seq) - n_prompt[rid] < min_new_tokens:
                continue
            seq = seq[:hidden.shape[0] + 1]
        hidden = hidden[:len(seq) - 1]
        if hidden.shape[0] != len(seq) - 1:
            continue  # never computed in full (a preempted request cut mid-recompute)
        kept.append((seq, hidden))
    samples: list[Sample] = []
    group: list[tuple[list[int], torch.Tensor]] = []

    def flush() -> None:  # the teacher's top-K for a group of sequences (~8K rows at once)
        top_ids, top_logp = _top_k(model, torch.cat([h for _, h in group]), top_k)
        row = 0
        for seq, hidden in group:
            n = hidden.shape[0]
            samples.append(Sample(torch.tensor(seq, device=hidden.device), hidden,
                                  top_ids[row:row + n], top_logp[row:row + n],
                                  max(0, shared - 2)))
            row += n
        group.clear()

    rows = 0
    for item in kept:
        group.append(item)
        rows += item[1].shape[0]
        if rows >= 8192:
            flush()
            rows = 0
    if group:
        flush()
    return samples


def _common_prefix(seqs: list[list[int]]) -> int:
    n = min(len(s) for s in seqs)
    for i in range(n):
        if any(s[i] != seqs[0][i] for s in seqs):
            return i
    return n


@torch.no_grad()
def _top_k(model, hidden: torch.Tensor, k: int, chunk: int = 8192
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's top-k next tokens at each row of hidden [N, H] (argmax first), on the
    device of `hidden`; log-probabilities renormalised over the k."""
    weight = model.lm_head.weight
    ids_out, logp_out = [], []
    for i in range(0, hidden.shape[0], chunk):
        logits = model.compute_logits(hidden[i:i + chunk].to(weight.device, weight.dtype))
        top_logp, top_ids = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
        top_logp = top_logp - torch.logsumexp(top_logp, dim=-1, keepdim=True)
        ids_out.append(top_ids.to(hidden.device))
        logp_out.append(top_logp.float().to(hidden.device))
    return torch.cat(ids_out), torch.cat(logp_out)


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


INITS = ("random", "last-layer")


def init_head(model, device: torch.device, backend: DenseCausalBackend, seed: int = 0,
              init: str = "random"):
    """fp32 head. random: N(0, 0.02) matrices and unit norms; the final norm starts as the
    target's (its output feeds the same lm_head). last-layer: the decoder block also starts
    as a copy of the target's last layer, and eh_proj as [small random | identity] so the
    block first sees the target's own final state."""
    from engine.mtp import random_head, with_mtp_layers

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
    dummy = torch.empty((1, head.config.num_kv_layers, 2, 1, 1, 1), device=device)
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
            group["lr"] = lr * min(1.0, (step + 1) / warmup) * (
                min_lr_frac + (1 - min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress)))
        if not queue:
            queue = _length_batches(samples, batch_size, rng)
        batch = [samples[i] for i in queue.pop()]
        with autocast:
            loss = batch_loss(model, head, backend, batch, device, chain_weight, vocab_subset,
                              feature_weight, hard_weight, stats)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
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


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# -- 5. evaluation ----------------------------------------------------------------------------

def measure_acceptance(model_name: str | None, head_path: str, prompts: list[str], k: int,
                       max_tokens: int, device: str, dtype: str = "float32") -> dict:
    """Greedy decoding of `prompts` with k drafts per step; numbers from the engine counters.
    float32 by default, on any device: the CI acceptance test runs that way on CPU."""
    import gc

    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    from engine.spec_decode import SpecConfig

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


def _smooth(values: list[float]) -> tuple[list[float], int]:
    window = max(1, len(values) // 50)
    out = [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
           for i in range(len(values))]
    return out, window


def plot_losses(losses: list[float], path: Path, curve: list[dict] | None = None) -> None:
    """Loss curve (and the held-out slice's top-1 agreement, right axis) as a PNG: matplotlib
    when installed, else a plain plot drawn here (no labels; the numbers are in the JSON)."""
    try:
        import matplotlib
    except ImportError:
        _plain_png(losses, path, curve)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    smooth, window = _smooth(losses)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(losses, alpha=0.3, label="batch loss")
    ax.plot(smooth, label=f"moving mean ({window})")
    ax.set_xlabel("step")
    ax.set_ylabel("distillation loss (nats)")
    ax.set_title("MTP head self-distillation")
    lines, labels = ax.get_legend_handles_labels()
    points = [c for c in (curve or []) if "top1" in c]
    if points:
        ax2 = ax.twinx()
        ax2.plot([c["step"] for c in points], [c["top1"] for c in points], "g.-",
                 label="held-out slice top-1 (draft 1)")
        ax2.plot([c["step"] for c in points], [c["train_top1"] for c in points], "c.:",
                 label="train top-1 (draft 1)")
        ax2.set_ylabel("top-1 agreement with the target")
        ax2.set_ylim(0, 1)
        l2, lb2 = ax2.get_legend_handles_labels()
        lines, labels = lines + l2, labels + lb2
    ax.legend(lines, labels, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plain_png(losses: list[float], path: Path, curve: list[dict] | None,
               width: int = 700, height: int = 400) -> None:
    """Axes box, batch loss (light blue), its moving mean (blue), held-out top-1 (green,
    0..1 on the full height) drawn into an RGB array, written as PNG with zlib."""
    import struct
    import zlib

    img = [[[255, 255, 255] for _ in range(width)] for _ in range(height)]
    left, right, top, bottom = 50, width - 20, 20, height - 40

    def put(x: float, y: float, color: tuple[int, int, int]) -> None:
        xi, yi = int(round(x)), int(round(y))
        if 0 <= xi < width and 0 <= yi < height:
            img[yi][xi] = list(color)

    def line(p: tuple[float, float], q: tuple[float, float], color) -> None:
        n = int(max(abs(q[0] - p[0]), abs(q[1] - p[1]), 1))
        for i in range(n + 1):
            put(p[0] + (q[0] - p[0]) * i / n, p[1] + (q[1] - p[1]) * i / n, color)

    for a, b in (((left, top), (right, top)), ((right, top), (right, bottom)),
                 ((right, bottom), (left, bottom)), ((left, bottom), (left, top))):
        line(a, b, (0, 0, 0))
    if losses:
        lo, hi = min(losses), max(losses)
        span = (hi - lo) or 1.0
        n = max([1, len(losses) - 1] + [c["step"] for c in (curve or [])])

        def xy(i: float, v: float) -> tuple[float, float]:
            return (left + (right - left) * i / n, bottom - (bottom - top) * (v - lo) / span)

        smooth, _ = _smooth(losses)
        for series, color in ((losses, (170, 200, 240)), (smooth, (30, 80, 200))):
            for i in range(1, len(series)):
                line(xy(i - 1, series[i - 1]), xy(i, series[i]), color)
        pts = [((left + (right - left) * c["step"] / n), bottom - (bottom - top) * c["top1"])
               for c in (curve or []) if "top1" in c]
        for a, b in zip(pts, pts[1:]):
            line(a, b, (20, 150, 40))
    raw = b"".join(b"\x00" + bytes(v for px in row for v in px) for row in img)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(
            ">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2,
                                                              0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))
    Path(path).write_bytes(png)


# -- CLI -------------------------------------------------------------------------------------

# defaults per device: (CPU, CUDA). The CUDA ones fit one H100 run of ~7.5 minutes in all:
# model load + Triton compile + graph capture (~40 s), 4 minutes generating (the data:
# millions of tokens), <= 2 minutes training (time-bound: the planned epochs are more than
# fit), ~30 s evaluation; --deadline-s trims training when the rest ran long
DEFAULTS = {
    "num_prompts": (512, 65536), "max_tokens": (128, 256), "epochs": (5.0, 10.0),
    "vocab_subset": (4096, 0), "batch_size": (16, 64), "chain_weight": (0.0, 0.3),
    "train_time_s": (420.0, 120.0), "gen_time_s": (None, 240.0), "gen_batch": (128, 512),
    "deadline_s": (None, 470.0), "hard_weight": (0.5, 0.5), "feature_weight": (0.0, 0.0),
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train-mtp", help="train an MTP head by self-distillation (CPU or one GPU)",
        description="Train an MTP draft head for a model on its own generations (no data "
                    "set, no downloads), then measure its acceptance on held-out prompts. "
                    "Defaults in brackets are [CPU / CUDA].")
    a = p.add_argument
    a("--model", default=None, help="HF folder or .gguf (a copy of the embedded SmolLM2 GGUF "
                                    "counts as the default model; default: the embedded "
                                    "SmolLM2-135M-Instruct)")
    a("--out", required=True, help="output .safetensors (plus .json and .png next to it)")
    a("--device", default=None, help="cpu | cuda (default: cuda if available)")
    g = p.add_argument_group("data (self-distillation corpus)")
    g.add_argument("--num-prompts", type=int, default=None,
                   help="prompts at most [512 / 65536: CUDA stops at --gen-time-s]")
    g.add_argument("--max-tokens", type=int, default=None, help="tokens per answer [128 / 256]")
    g.add_argument("--gen-time-s", type=float, default=None,
                   help="generation time budget [none / 240]")
    g.add_argument("--gen-batch", type=int, default=None,
                   help="sequences generated at once [128 / 512]")
    g.add_argument("--task-fraction", type=float, default=0.15,
                   help="share of generated tasks (arithmetic, code, letters) among the prompts "
                        "(default 0.15)")
    g.add_argument("--top-k", type=int, default=32,
                   help="teacher tokens kept per position (default 32)")
    g.add_argument("--no-gen-cuda-graphs", dest="gen_cuda_graphs", action="store_false",
                   help="generate with eager CUDA steps (CUDA graphs are on by default)")
    t = p.add_argument_group("training")
    t.add_argument("--init", choices=INITS, default="random",
                   help="decoder block start: random (default), or a copy of the target's last "
                        "layer")
    t.add_argument("--epochs", type=float, default=None,
                   help="planned passes over the corpus [5 / 10: CUDA stops at --train-time-s]")
    t.add_argument("--batch-size", type=int, default=None, help="sequences per step [16 / 64]")
    t.add_argument("--lr", type=float, default=2e-3,
                   help="peak learning rate, AdamW (default 2e-3)")
    t.add_argument("--warmup-frac", type=float, default=0.05,
                   help="warm-up share of the run (default 0.05)")
    t.add_argument("--min-lr-frac", type=float, default=0.1,
                   help="cosine decay ends at this fraction of --lr (default 0.1)")
    t.add_argument("--hard-weight", type=float, default=None,
                   help="weight of the cross-entropy on the target's argmax [0.5 / 0.5]")
    t.add_argument("--chain-weight", type=float, default=None,
                   help="weight of the draft-2 loss, the head reading its own output [0 / 0.3]")
    t.add_argument("--feature-weight", type=float, default=None,
                   help="weight of the smooth-L1 pull towards the target's next hidden state "
                        "[0 / 0]")
    t.add_argument("--vocab-subset", type=int, default=None,
                   help="softmax over this many candidate tokens, 0 = full vocabulary [4096 / 0]")
    t.add_argument("--train-time-s", "--time-budget-s", dest="train_time_s", type=float,
                   default=None, help="training time cap [420 / 120]")
    t.add_argument("--val-fraction", type=float, default=0.03,
                   help="share of the corpus held out for the top-1 curves (default 0.03)")
    e = p.add_argument_group("evaluation and budget")
    e.add_argument("--eval-prompts", type=int, default=16,
                   help="held-out prompts measured (default 16)")
    e.add_argument("--eval-tokens", type=int, default=64,
                   help="tokens per held-out answer (default 64)")
    e.add_argument("--deadline-s", type=float, default=None,
                   help="whole-run wall-clock cap: training is shortened to keep evaluation "
                        "inside it [none / 470]")
    a("--seed", type=int, default=0, help="prompt order, sampling and initialisation (default 0)")
    p.set_defaults(func=_cmd_train)


def _default(args: argparse.Namespace, name: str, gpu: bool):
    value = getattr(args, name)
    return DEFAULTS[name][1 if gpu else 0] if value is None else value


def _cmd_train(args: argparse.Namespace) -> int:
    from engine.llm import default_device
    from engine.model_source import resolve_model
    from engine.mtp import save_mtp_head

    t0 = time.monotonic()
    device = args.device or default_device()
    gpu = device.startswith("cuda")
    cfg = {name: _default(args, name, gpu) for name in DEFAULTS}
    cfg.update(task_fraction=args.task_fraction, top_k=args.top_k, init=args.init, lr=args.lr,
               warmup_frac=args.warmup_frac, min_lr_frac=args.min_lr_frac,
               val_fraction=args.val_fraction, gen_cuda_graphs=args.gen_cuda_graphs,
               seed=args.seed)
    deadline = None if cfg["deadline_s"] is None else t0 + cfg["deadline_s"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    source = resolve_model(args.model)
    print(f"train-mtp: model {source.name!r} ({source.path or source.kind}) on {device}; "
          f"settings {json.dumps(cfg)}", file=sys.stderr)
    torch.manual_seed(args.seed)

    # 1-3. the corpus
    n_prompts = cfg["num_prompts"]
    messages = corpus_prompts(n_prompts, args.seed, cfg["task_fraction"])
    held = set(heldout_prompts(len(HELDOUT_TEMPLATES) * len(HELDOUT_TOPICS)))
    if held & set(messages):
        raise AssertionError("train-mtp: held-out prompts leaked into the training prompts")
    from engine.model_source import load_tokenizer

    prompts = ChatPrompts(load_tokenizer(source), messages)
    longest = max(len(prompts[i]) for i in range(min(len(prompts), 2000)))
    max_len = -(-(longest + 32 + cfg["max_tokens"]) // 64) * 64  # room for longer prompts
    engine = generation_engine(args.model, device, args.seed, max_num_seqs=cfg["gen_batch"],
                               max_model_len=max_len, cuda_graphs=cfg["gen_cuda_graphs"])
    t_load = time.monotonic() - t0
    distinct = len(TRAIN_TEMPLATES) * len(TRAIN_TOPICS)
    temps = [temperature_for(i, distinct) for i in range(n_prompts)]
    store = engine.runner.model.embed_tokens.weight
    gen_info: dict = {"cuda_graphs": getattr(engine.runner, "cuda_graphs", None) is not None}
    samples = generate_corpus(engine, prompts, cfg["max_tokens"], temps, args.seed, cfg["top_k"],
                              time_budget_s=cfg["gen_time_s"], store_device=store.device,
                              store_dtype=store.dtype if gpu else torch.float32, info=gen_info)
    if not samples:
        print("train-mtp: no sequences were generated (raise --gen-time-s)", file=sys.stderr)
        return 1
    model = engine.runner.model
    engine = None  # its KV cache and CUDA graphs are not needed any more
    import gc

    gc.collect()
    if gpu:
        torch.cuda.empty_cache()
    t_gen = time.monotonic() - t0 - t_load
    rng = random.Random(args.seed + 17)
    order = list(range(len(samples)))
    rng.shuffle(order)
    n_val = min(len(samples) // 4, max(1, int(len(samples) * cfg["val_fraction"]))) \
        if len(samples) >= 4 else 0
    val = [samples[i] for i in order[:n_val]][:256]
    train = [samples[i] for i in order[n_val:]]
    train_tokens = sum(len(s.tokens) for s in train)
    learn_tokens = sum(len(s.hidden) - s.loss_from for s in train)
    print(f"train-mtp: corpus {len(samples)} sequences, {train_tokens} tokens in training "
          f"({learn_tokens} positions to learn at), {len(val)} sequences held out",
          file=sys.stderr)

    # 4. training
    train_budget = cfg["train_time_s"]
    eval_reserve = 60.0 if gpu else 0.0
    if deadline is not None:
        train_budget = max(10.0, min(train_budget, deadline - time.monotonic() - eval_reserve))
    history: dict = {}
    head, losses = train_head(
        model, train, torch.device(device), epochs=cfg["epochs"], batch_size=cfg["batch_size"],
        lr=cfg["lr"], time_budget_s=train_budget, chain_weight=cfg["chain_weight"],
        seed=args.seed, vocab_subset=cfg["vocab_subset"], hard_weight=cfg["hard_weight"],
        feature_weight=cfg["feature_weight"], init=cfg["init"], val_samples=val,
        warmup_frac=cfg["warmup_frac"], min_lr_frac=cfg["min_lr_frac"], history=history)
    t_train = time.monotonic() - t0 - t_load - t_gen
    save_mtp_head(head, out, extra={
        "base_model": source.name, "base_model_file": Path(source.path).name if source.path
        else source.kind, "recipe": "pdserve train-mtp self-distillation",
        "train_tokens": str(train_tokens)})
    curve = history.get("curve", [])
    plot_losses(losses, out.with_suffix(".png"), curve)
    report = {"model": source.name, "model_path": source.path, "device": device,
              "device_name": torch.cuda.get_device_name() if gpu else "cpu",
              "command": " ".join(["pdserve train-mtp"] + sys.argv[2:]) if len(sys.argv) > 1
              else "pdserve train-mtp",
              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "settings": cfg,
              "versions": {"torch": torch.__version__, "cuda": torch.version.cuda},
              "generation": gen_info, "num_sequences": len(samples),
              "train_tokens": train_tokens, "train_positions": learn_tokens,
              "val_sequences": len(val), "steps": len(losses),
              "final_loss": sum(losses[-20:]) / max(1, len(losses[-20:])),
              "load_s": round(t_load, 1), "generate_s": round(t_gen, 1),
              "train_s": round(t_train, 1), "top1_curve": curve,
              "peak_gpu_memory_gb": round(torch.cuda.max_memory_allocated() / 2**30, 1)
              if gpu else None,
              "val_top1": curve[-1].get("top1") if curve else None,
              "train_top1": curve[-1].get("train_top1") if curve else None,
              "losses": losses}

    def write() -> None:
        out.with_suffix(".json").write_text(json.dumps(report, indent=1))

    write()  # the head, its curve and numbers are on disk before the evaluation starts
    print(f"train-mtp: wrote {out}, {out.with_suffix('.png')}, {out.with_suffix('.json')}",
          file=sys.stderr)

    # 5. acceptance on held-out prompts
    held_msgs = heldout_prompts(args.eval_prompts)
    for k in (1, 3):
        if deadline is not None and k > 1 and time.monotonic() > deadline - 15:
            report[f"eval_k{k}"] = "skipped: --deadline-s reached"
            continue
        t = time.monotonic()
        report[f"eval_k{k}"] = measure_acceptance(args.model, str(out), held_msgs, k,
                                                  args.eval_tokens, device)
        report[f"eval_k{k}"]["seconds"] = round(time.monotonic() - t, 1)
        write()
    report["total_s"] = round(time.monotonic() - t0, 1)
    write()
    print(json.dumps({k: v for k, v in report.items() if k not in ("losses", "top1_curve")},
                     indent=1))
    return 0

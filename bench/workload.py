"""Workloads for `pdserve bench`: random prompts, shared prefixes, Mooncake trace replay,
ShareGPT conversations.

Prompts are text made of common English words so that any server's tokenizer turns each
word into roughly one token; the real token counts come back in the server's `usage`, so
the bench never needs the server's tokenizer. A workload is a list of `RequestSpec`s, each
with an arrival offset (seconds from the start of the run) when the workload fixes one
(trace replay), or None when the load generator draws arrivals itself (Poisson rate).
"""
from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Short, common words: one token each in GPT-2, Llama, Qwen and SmolLM2 vocabularies when
# preceded by a space, so "N words" is close to "N tokens" for every server.
WORDS = tuple("""
the of and to in is was for on are with as at be by this had not but from or have an
they which one you were all we her she there would their will when who him been has more
if no out do so can what up said about other into than its time only could new them man
some these then two first may any like now my such make over our even most me state after
also made many did must before back see through way where get much go well your know should
down work year because come people just say each those take day good how long own too little
use us very great still men here life both between old under last never place same another
think house while high right might came off find states since used give against three
himself look few general hand school part small american home during number again mrs
around thought went without however course company world point fact children water city
""".split())


@dataclass(frozen=True)
class RequestSpec:
    """One request to send. input_len is the intended prompt length in words (~tokens)."""

    prompt: str
    input_len: int
    output_len: int
    arrival_s: float | None = None  # offset from run start; None = the load generator decides


@dataclass(frozen=True)
class LengthRange:
    """Inclusive integer range, parsed from "N" or "LO:HI"."""

    lo: int
    hi: int

    @classmethod
    def parse(cls, text: str, name: str) -> LengthRange:
        try:
            parts = [int(p) for p in str(text).split(":")]
        except ValueError as e:
            raise ValueError(f"{name}: expected N or LO:HI integers, got {text!r}") from e
        if len(parts) not in (1, 2):
            raise ValueError(f"{name}: expected N or LO:HI, got {text!r}")
        lo, hi = parts[0], parts[-1]
        if lo < 1 or hi < lo:
            raise ValueError(f"{name}: need 1 <= LO <= HI, got {text!r}")
        return cls(lo, hi)

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.lo, self.hi)


def random_words(rng: random.Random, n: int) -> list[str]:
    return [rng.choice(WORDS) for _ in range(n)]


def random_workload(num_prompts: int, input_len: LengthRange, output_len: LengthRange,
                    shared_prefix_ratio: float = 0.0, seed: int = 0) -> list[RequestSpec]:
    """Random prompts; the first floor(ratio * input_len) words of each prompt are one
    prefix shared by all requests (what a prefix cache can reuse), the rest is unique."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts: must be >= 1, got {num_prompts}")
    if not 0.0 <= shared_prefix_ratio <= 1.0:
        raise ValueError(f"shared_prefix_ratio: must be in [0, 1], got {shared_prefix_ratio}")
    rng = random.Random(seed)
    # one shared prefix long enough for the longest prompt; each request takes its share
    shared = random_words(random.Random(seed + 1), math.floor(shared_prefix_ratio * input_len.hi))
    specs = []
    for _ in range(num_prompts):
        n_in = input_len.sample(rng)
        n_shared = math.floor(shared_prefix_ratio * n_in)
        words = shared[:n_shared] + random_words(rng, n_in - n_shared)
        specs.append(RequestSpec(" ".join(words), n_in, output_len.sample(rng)))
    return specs


@dataclass(frozen=True)
class TraceEntry:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(path: str | Path, limit: int | None = None) -> list[TraceEntry]:
    """Read a Mooncake-format JSONL trace: one object per line with timestamp (ms),
    input_length, output_length and hash_ids (one id per 512-token block)."""
    entries: list[TraceEntry] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit is not None and len(entries) >= limit:
                break
            try:
                obj = json.loads(line)
                entry = TraceEntry(float(obj["timestamp"]), int(obj["input_length"]),
                                   int(obj["output_length"]),
                                   tuple(int(h) for h in obj.get("hash_ids", [])))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: bad trace line ({e!r}): "
                                 "needs timestamp, input_length, output_length, hash_ids") from e
            if entry.input_length < 1 or entry.output_length < 1:
                raise ValueError(f"{path}:{lineno}: input_length and output_length must be >= 1")
            entries.append(entry)
    if not entries:
        raise ValueError(f"{path}: trace has no entries")
    return entries


class PrefixBlocks:
    """The synthetic shared prefix behind hash ids: block h is block_size words drawn from a
    generator seeded by h, so requests that share hash ids share exactly that text."""

    def __init__(self, block_size: int = 512, seed: int = 0) -> None:
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        self.block_size = block_size
        self.seed = seed
        self._cache: dict[int, list[str]] = {}

    def block(self, hash_id: int) -> list[str]:
        if hash_id not in self._cache:
            rng = random.Random(f"{self.seed}:{hash_id}")
            self._cache[hash_id] = random_words(rng, self.block_size)
        return self._cache[hash_id]


def trace_workload(entries: list[TraceEntry], block_size: int = 512,
                   seed: int = 0) -> list[RequestSpec]:
    """Turn trace entries into requests arriving at their timestamps (relative to the first).

    Prompt = the hash-id blocks in order, cut to input_length words; if input_length is
    longer than the blocks, unique random words fill the rest (the uncached tail)."""
    blocks = PrefixBlocks(block_size, seed)
    rng = random.Random(seed)
    t0 = min(e.timestamp_ms for e in entries)
    specs = []
    for e in entries:
        words: list[str] = []
        for h in e.hash_ids:
            if len(words) >= e.input_length:
                break
            words.extend(blocks.block(h))
        words = words[:e.input_length]
        words.extend(random_words(rng, e.input_length - len(words)))
        specs.append(RequestSpec(" ".join(words), e.input_length, e.output_length,
                                 arrival_s=(e.timestamp_ms - t0) / 1000.0))
    specs.sort(key=lambda s: s.arrival_s or 0.0)
    return specs


def poisson_arrivals(n: int, rate: float, seed: int = 0, burstiness: float = 1.0
                     ) -> list[float]:
    """Arrival offsets (s) of n requests at `rate` req/s; rate = inf sends everything at t=0.
    The first request leaves at t=0. Gaps are gamma-distributed with shape `burstiness` and
    mean 1 / rate, as vllm bench serve's --burstiness: 1 is a Poisson process, below 1
    burstier, above 1 more even."""
    if rate <= 0 or math.isnan(rate):
        raise ValueError(f"request_rate: must be > 0 (or inf), got {rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness: must be a finite number > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        if i > 0:  # burstiness 1: the exponential draws of earlier runs, seed for seed
            t += rng.expovariate(rate) if burstiness == 1.0 else \
                rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        out.append(t)
    return out


# vllm bench serve's ShareGPT filter: prompt and reply of >= 4 tokens, prompt <= 1024,
# prompt + reply <= 2048 (its fixed limits, so results compare)
SHAREGPT_MIN, SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL = 4, 1024, 2048


def approx_tokens(text: str) -> int:
    """~4 characters per token (English text), when the bench has no tokenizer."""
    return max(1, math.ceil(len(text) / 4))


def sharegpt_workload(path: str | Path, num_prompts: int, seed: int = 0,
                      count_tokens: Callable[[str], int] = approx_tokens) -> list[RequestSpec]:
    """ShareGPT conversations as vllm bench serve samples them: each conversation's first
    turn is the prompt and its second the reply, whose length in tokens (count_tokens) is
    the request's max_tokens; shuffled by `seed`, filtered as above, the first num_prompts."""
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except ValueError as e:
            raise ValueError(f"{path}: not a ShareGPT JSON file ({e})") from e
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of conversations")
    pairs = [(c["conversations"][0]["value"], c["conversations"][1]["value"]) for c in data
             if isinstance(c, dict) and isinstance(c.get("conversations"), list)
             and len(c["conversations"]) >= 2
             and all(isinstance(t, dict) and isinstance(t.get("value"), str)
                     for t in c["conversations"][:2])]
    random.Random(seed).shuffle(pairs)
    specs = []
    for prompt, reply in pairs:
        n_in, n_out = count_tokens(prompt), count_tokens(reply)
        if min(n_in, n_out) < SHAREGPT_MIN or n_in > SHAREGPT_MAX_PROMPT \
                or n_in + n_out > SHAREGPT_MAX_TOTAL:
            continue
        specs.append(RequestSpec(prompt, n_in, n_out))
        if len(specs) == num_prompts:
            break
    if not specs:
        raise ValueError(f"{path}: no conversation passed the ShareGPT filter (two turns, "
                         f"{SHAREGPT_MIN}..{SHAREGPT_MAX_PROMPT} prompt tokens, "
                         f"<= {SHAREGPT_MAX_TOTAL} in all)")
    return specs


def tokenizer_counter(path: str | Path) -> Callable[[str], int]:
    """Token counts from a Hugging Face tokenizer.json (or a folder holding one)."""
    from tokenizers import Tokenizer

    file = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as e:  # noqa: BLE001 - tokenizers raises its own Exception type
        raise ValueError(f"--tokenizer: cannot load {file}: {e}") from e
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)

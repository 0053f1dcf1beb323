"""Sampler: one row of logits per sampling request -> one token (+ optional logprobs).

Pipeline, per row, in this order (each row uses its own request's settings, vectorised over
the batch with per-row parameter tensors):
    repetition penalty -> frequency / presence penalties -> logit_bias -> allowed_token_ids
    -> min_tokens ban -> bad_words ban -> grammar mask -> temperature -> top-k -> top-p ->
    min-p -> draw (greedy rows: argmax of the penalised, biased, masked logits)

logit_bias (OpenAI) is added after the penalties so that it is exactly the shift the client
asked for: before them, the repetition penalty would divide a +100 bias of a token already
seen by r (and frequency / presence are additive, so their order with the bias is moot). It
comes before temperature like the logits it shifts, so +100 / -100 force / ban a token in
greedy and random rows alike. min_tokens (vLLM's) sets EOS and the stop_token_ids to -inf
while the output is shorter than it, after the bias, so no bias lifts them. bad_words
(vLLM's) bans, at each step, the last token of every bad-word sequence whose other tokens
end the output so far (the host compares lists: a handful of short sequences per request).

Randomness. Every request owns a torch.Generator. The noise for output token i is drawn from
that generator re-seeded with mix(base_seed, i), where base_seed is the request's seed (or,
unseeded, the engine seed mixed with a per-request counter). So a seeded request draws the
same tokens whatever else is in the batch, after a preemption, and across the prefill ->
decode split (P draws token 0, D continues at token 1 with the same seed).

Penalty state. Requests with penalties keep a [V] count tensor of output tokens and a [V] bool
mask of prompt tokens on the logits' device. The engine calls `state.observe(token)` for each
token it appends; that is O(1) and nothing is rebuilt from the history.

Grammar (structured outputs). A request with one keeps its GrammarState here too (attached by
the runner, engine/structured/matcher.py), advanced by the same observe(). Its bitmask masks
the logits after logit_bias, before temperature -- greedy rows included: the all-greedy fast
path masks before its argmax. A batch without grammars builds no bitmask. The bitmask is
filled (matcher.BitmaskFiller) when sample() starts: after the runner launched the step's
forward and LM head, so the host fills it while the GPU computes the logits it masks.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.core.request import Request
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.exec.device_io import HostCopy, to_device
from pdserve.engine.exec.logits_processors import apply_min_p, apply_penalties, apply_top_k_top_p
from pdserve.engine.structured.matcher import BitmaskFiller, GrammarState, apply_bitmask

# Temperatures below this are treated as greedy: dividing by them overflows float32.
SAMPLING_EPS = 1e-5
_MASK64 = (1 << 64) - 1

Logprobs = tuple[float, list[tuple[int, float]]]


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def bad_word_bans(request: Request) -> list[int]:
    """The tokens request's bad_words ban at its next output position: each sequence's last
    token where the output ends with the rest of it (vLLM's bad_words, over the output
    only). [] without bad words."""
    seqs = request.sampling_params.bad_words_token_ids
    if not seqs:
        return []
    out = request.output_token_ids
    return sorted({q[-1] for q in seqs
                   if len(q) == 1 or (len(out) >= len(q) - 1
                                      and tuple(out[len(out) - len(q) + 1:]) == q[:-1])})


def mix_seed(seed: int, salt: int) -> int:
    """A 63-bit generator seed from (seed, salt); nearby inputs give unrelated streams."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (salt & _MASK64)) >> 1


@dataclass
class SamplerState:
    """Per-request sampler state, created once by `Sampler.new_state`."""

    base_seed: int
    generator: torch.Generator
    vocab_size: int
    output_counts: torch.Tensor | None = None  # [V] int32: count of each token in the output
    prompt_mask: torch.Tensor | None = None  # [V] bool: token occurs in the prompt
    bias_ids: torch.Tensor | None = None  # [E] int64: the request's logit_bias token ids
    bias_values: torch.Tensor | None = None  # [E] float32: their biases, in the same order
    # [K] int64: EOS and stop_token_ids, banned while the output is shorter than min_tokens
    min_tokens_ban: torch.Tensor | None = None
    allowed: torch.Tensor | None = None  # [V] bool: allowed_token_ids (None: all)
    num_observed: int = 0  # output tokens seen by observe(); must track the request
    grammar: GrammarState | None = None  # structured output: the matcher, at the output's end

    def observe(self, token_id: int) -> None:
        """Account for one new output token (O(1): one indexed add on the device)."""
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token_id: {token_id} outside the vocabulary [0, {self.vocab_size})")
        self.num_observed += 1
        if self.grammar is not None:  # queued: the next fill accepts it (matcher.py)
            self.grammar.accept(token_id)
        if self.output_counts is not None:
            # the tensor may be an inference tensor (made under inference_mode by the runner):
            # in-place updates to those are only legal inside inference_mode
            with torch.inference_mode():
                self.output_counts[token_id] += 1

    def generator_at(self, position: int) -> torch.Generator:
        """The generator for output position `position`, re-seeded so draws depend only on it."""
        self.generator.manual_seed(mix_seed(self.base_seed, position))
        return self.generator


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[Logprobs | None]  # per row: (chosen logprob, top-N [(token, logprob)]) or None


class Sampler:
    def __init__(self, seed: int = 0,
                 argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 eos_token_ids: Sequence[int] = ()) -> None:
        """argmax: [B, V] -> int64 [B] for the greedy rows (the model's: a Triton kernel on
        its fused path), torch.argmax by default. eos_token_ids: what min_tokens bans."""
        self.seed = seed
        self.eos_token_ids = tuple(eos_token_ids)
        self.argmax = argmax if argmax is not None else (lambda x: x.argmax(dim=-1))
        self._counter = itertools.count()  # distinct streams for unseeded requests
        self._host_copy = HostCopy()
        self.masks = BitmaskFiller()  # grammar rows' bitmask: pinned, queued, batch-filled

    @torch.inference_mode()
    def new_state(self, request: Request, vocab_size: int,
                  device: torch.device | str) -> SamplerState:
        """State for one request; counts tokens it already has (e.g. decode after prefill)."""
        params = request.sampling_params
        device = torch.device(device)
        if params.seed is not None:
            base_seed = params.seed
        else:
            base_seed = mix_seed(self.seed, next(self._counter))
        state = SamplerState(base_seed, torch.Generator(device=device), vocab_size,
                             num_observed=len(request.output_token_ids))
        if params.has_penalties:
            state.prompt_mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            prompt = torch.tensor(request.prompt_token_ids, dtype=torch.int64, device=device)
            state.prompt_mask[prompt] = True
            state.output_counts = torch.zeros(vocab_size, dtype=torch.int32, device=device)
            if request.output_token_ids:
                out = torch.tensor(request.output_token_ids, dtype=torch.int64, device=device)
                state.output_counts.index_add_(0, out, torch.ones_like(out, dtype=torch.int32))
        if params.has_logit_bias or params.has_allowed or params.has_bad_words:
            params.check_vocab(vocab_size)  # an id past the row would index out of bounds
        if params.has_logit_bias:  # on the device once: a step only concatenates them
            ids, values = zip(*params.logit_bias.items())
            state.bias_ids = torch.tensor(ids, dtype=torch.int64, device=device)
            state.bias_values = torch.tensor(values, dtype=torch.float32, device=device)
        if params.has_allowed:
            state.allowed = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            state.allowed[to_device(params.allowed_token_ids, torch.int64, device)] = True
        if params.min_tokens > len(request.output_token_ids):
            eos = () if params.ignore_eos else self.eos_token_ids
            banned = sorted({t for t in (*eos, *params.stop_token_ids) if t < vocab_size})
            state.min_tokens_ban = torch.tensor(banned, dtype=torch.int64, device=device)
        return state

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request],
                 states: Sequence[SamplerState],
                 before_sync: Callable[[torch.Tensor], object] | None = None) -> SampleOutput:
        return self.sample(logits, requests, states, before_sync)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, requests: Sequence[Request],
               states: Sequence[SamplerState],
               before_sync: Callable[[torch.Tensor], object] | None = None) -> SampleOutput:
        """Draw one token per row of logits [B, V] (float). before_sync, if given, gets the
        drawn ids [B] on the device before the host reads them (overlapped decode launches
        the next forward from them)."""
        params = [r.sampling_params for r in requests]
        # [B, W] on the device | None; filled on the host while the GPU runs the forward
        bitmask = self.masks.fill([s.grammar for s in states], logits.shape[-1], logits.device)
        processed = self._process(logits, requests, states, bitmask)  # -inf outside support
        token_ids = self.argmax(processed)  # greedy rows keep this
        random_rows = [i for i, p in enumerate(params) if p.temperature >= SAMPLING_EPS]
        if random_rows:
            rows = to_device(random_rows, torch.int64, logits.device)
            probs = processed[rows].softmax(dim=-1)  # [R, V]
            noise = self._noise(requests, states, random_rows, logits)  # [R, V] ~ Exp(1)
            # exponential race: argmax p_i / E_i is a draw from p, using only per-row noise
            token_ids[rows] = (probs / noise).argmax(dim=-1)
        if before_sync is None:
            ids = token_ids.tolist()
        else:  # copy the ids out first: a read after before_sync's work would wait for it
            self._host_copy.start(token_ids)
            before_sync(token_ids)
            ids = self._host_copy.wait()
        return SampleOutput(ids, self._logprobs(logits, params, ids))

    @torch.inference_mode()
    def probs_after_processing(self, logits: torch.Tensor, requests: Sequence[Request],
                               states: Sequence[SamplerState],
                               bitmask: torch.Tensor | None = None) -> torch.Tensor:
        """The exact distribution `sample` draws from, [B, V]; greedy rows are one-hot. A
        grammar's mask is the caller's (bitmask [B, W]): verification masks each row with
        the state after its drafts, not the state's own."""
        processed = self._process(logits, requests, states, bitmask).float()
        probs = processed.softmax(dim=-1)
        greedy_rows = [r.sampling_params.temperature < SAMPLING_EPS for r in requests]
        if any(greedy_rows):
            greedy = to_device(greedy_rows, torch.bool, logits.device)
            one_hot = torch.zeros_like(probs).scatter_(-1, processed.argmax(-1, keepdim=True), 1.0)
            probs = torch.where(greedy[:, None], one_hot, probs)
        return probs

    # -- pipeline --------------------------------------------------------------------------
    def _process(self, logits: torch.Tensor, requests: Sequence[Request],
                 states: Sequence[SamplerState], bitmask: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """Penalties, logit_bias, the grammar's bitmask [B, W], temperature, top-k, top-p,
        min-p on a float32 copy of logits [B, V] (the logits themselves, or a masked copy in
        their dtype, when every row is greedy with neither penalties nor a logit_bias)."""
        self._check(logits, requests, states)
        params = [r.sampling_params for r in requests]
        pen_rows = [i for i, p in enumerate(params) if p.has_penalties]
        bias_rows = [i for i, p in enumerate(params) if p.has_logit_bias]
        ban_rows = [i for i, r in enumerate(requests)
                    if len(r.output_token_ids) < r.sampling_params.min_tokens]
        allow_rows = [i for i, p in enumerate(params) if p.has_allowed]
        bad = {i: b for i, r in enumerate(requests) if (b := bad_word_bans(r))}
        greedy = [p.temperature < SAMPLING_EPS for p in params]
        if not pen_rows and not bias_rows and not ban_rows and not allow_rows and not bad \
                and all(greedy):
            # argmax alone: no float copy of [B, V] (bf16 is fine), but never past the mask
            return logits if bitmask is None else apply_bitmask(logits, bitmask)
        out = logits.float()
        if pen_rows:
            out = self._penalise(out, params, states, pen_rows)
        if bias_rows:  # after the penalties, before temperature (module docstring)
            out = self._add_bias(out, states, bias_rows)
        if allow_rows:  # after the bias: +100 cannot lift a token off the allow-list
            out = self._allow(out, states, allow_rows)
        if ban_rows:  # after the bias: +100 cannot lift a banned EOS
            out = self._ban(out, states, ban_rows)
        if bad:  # after the bias too: the bad words' next tokens, this step's
            out = self._ban_bad_words(out, bad)
        if bitmask is not None:  # after the bias: +100 cannot lift a forbidden token
            out = apply_bitmask(out, bitmask)
        dev, vocab = logits.device, logits.shape[-1]

        def per_row(values: list[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return to_device(values, dtype, dev)

        if any(not g and p.temperature != 1.0 for g, p in zip(greedy, params)):
            temps = per_row([1.0 if g else p.temperature for g, p in zip(greedy, params)])
            out = out / temps[:, None]
        # greedy rows skip truncation: argmax survives it anyway
        top_k = [vocab if g or p.top_k < 0 else min(p.top_k, vocab) for g, p in zip(greedy, params)]
        top_p = [1.0 if g else p.top_p for g, p in zip(greedy, params)]
        if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
            out = apply_top_k_top_p(out, per_row(top_k, torch.int64), per_row(top_p))
        min_p = [0.0 if g else p.min_p for g, p in zip(greedy, params)]
        if any(m > 0.0 for m in min_p):
            out = apply_min_p(out, per_row(min_p))
        return out

    def _penalise(self, logits: torch.Tensor, params: list[SamplingParams],
                  states: Sequence[SamplerState], rows: list[int]) -> torch.Tensor:
        """Apply penalties to the listed rows only (their states hold counts and masks)."""
        for i in rows:
            if states[i].output_counts is None:
                raise ValueError(f"states[{i}]: request has penalties but its state was made "
                                 "without them (create it with Sampler.new_state)")
        dev = logits.device
        idx = to_device(rows, torch.int64, dev)
        sub = apply_penalties(
            logits[idx],
            torch.stack([states[i].prompt_mask for i in rows]),
            torch.stack([states[i].output_counts for i in rows]),
            to_device([params[i].repetition_penalty for i in rows], torch.float32, dev),
            to_device([params[i].presence_penalty for i in rows], torch.float32, dev),
            to_device([params[i].frequency_penalty for i in rows], torch.float32, dev))
        out = logits.clone()
        out[idx] = sub
        return out

    @staticmethod
    def _add_bias(logits: torch.Tensor, states: Sequence[SamplerState],
                  rows: list[int]) -> torch.Tensor:
        """logits [B, V] float32 plus each listed row's logit_bias, as one indexed add over
        all E (row, token) entries of the batch. Out of place: `logits` may be the caller's
        tensor (float32 logits come through .float() uncopied), and the raw logprobs and the
        other rows must not see the bias."""
        row_of, ids = _entries([states[i].bias_ids for i in rows], rows, "a logit_bias",
                               logits.device)
        values = torch.cat([states[i].bias_values for i in rows])  # [E] biases
        # a request's ids are distinct (dict keys): gather + add + put, no accumulation order
        return logits.index_put((row_of, ids), logits[row_of, ids] + values)

    @staticmethod
    def _ban(logits: torch.Tensor, states: Sequence[SamplerState],
             rows: list[int]) -> torch.Tensor:
        """logits [B, V] with each listed row's min_tokens ban (EOS, stop_token_ids) at -inf."""
        row_of, ids = _entries([states[i].min_tokens_ban for i in rows], rows, "min_tokens",
                               logits.device)
        return logits.index_put((row_of, ids), torch.tensor(float("-inf"), device=logits.device))

    @staticmethod
    def _ban_bad_words(logits: torch.Tensor, bans: dict[int, list[int]]) -> torch.Tensor:
        """logits [B, V] with each row's bad-word bans of this step (row -> token ids, from
        bad_word_bans on the host) at -inf, as _ban (out of place)."""
        dev = logits.device
        row_of = to_device([i for i, ids in bans.items() for _ in ids], torch.int64, dev)
        ids = to_device([t for b in bans.values() for t in b], torch.int64, dev)
        return logits.index_put((row_of, ids), torch.tensor(float("-inf"), device=dev))

    @staticmethod
    def _allow(logits: torch.Tensor, states: Sequence[SamplerState],
               rows: list[int]) -> torch.Tensor:
        """logits [B, V] with every token off each listed row's allowed_token_ids at -inf
        (out of place, as _add_bias)."""
        for i in rows:
            if states[i].allowed is None:
                raise ValueError(f"states[{i}]: request has allowed_token_ids but its state "
                                 "was made without them (create it with Sampler.new_state)")
        idx = to_device(rows, torch.int64, logits.device)
        keep = torch.stack([states[i].allowed for i in rows])  # [R, V]
        out = logits.clone()
        out[idx] = logits[idx].masked_fill(~keep, float("-inf"))
        return out

    def _noise(self, requests: Sequence[Request], states: Sequence[SamplerState],
               rows: list[int], logits: torch.Tensor) -> torch.Tensor:
        """Exp(1) noise [R, V], row i from request i's generator at its output position."""
        vocab = logits.shape[-1]
        noise = [torch.empty(vocab, device=logits.device).exponential_(
                     generator=states[i].generator_at(len(requests[i].output_token_ids)))
                 for i in rows]
        # a zero draw would make p/E = nan for p = 0 (argmax picks nan): keep E > 0
        return torch.stack(noise).clamp_min_(torch.finfo(torch.float32).tiny)

    def _logprobs(self, logits: torch.Tensor, params: list[SamplingParams],
                  token_ids: list[int]) -> list[Logprobs | None]:
        """Raw (pre-penalty, pre-bias, pre-temperature) logprobs of the chosen token and the
        top-N."""
        out: list[Logprobs | None] = [None] * len(params)
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not rows:
            return out
        dev = logits.device
        logp = torch.log_softmax(logits[to_device(rows, torch.int64, dev)].float(), dim=-1)
        chosen = logp.gather(1, to_device([[token_ids[i]] for i in rows], torch.int64, dev))
        top_lp, top_ids = logp.topk(max(params[i].logprobs for i in rows), dim=-1)  # [R, N]
        chosen_l, top_lp_l, top_ids_l = chosen[:, 0].tolist(), top_lp.tolist(), top_ids.tolist()
        for j, i in enumerate(rows):
            n = params[i].logprobs
            out[i] = (chosen_l[j], [(int(t), lp) for t, lp in zip(top_ids_l[j][:n], top_lp_l[j][:n])])
        return out

    @staticmethod
    def _check(logits: torch.Tensor, requests: Sequence[Request],
               states: Sequence[SamplerState]) -> None:
        if logits.dim() != 2 or not logits.is_floating_point():
            raise ValueError(f"logits: expected a float [B, V] tensor, got {tuple(logits.shape)} "
                             f"{logits.dtype}")
        if not logits.shape[0] == len(requests) == len(states):
            raise ValueError(f"logits: {logits.shape[0]} rows but {len(requests)} requests and "
                             f"{len(states)} states")
        for i, (req, st) in enumerate(zip(requests, states)):
            if st.vocab_size != logits.shape[1]:
                raise ValueError(f"states[{i}].vocab_size: {st.vocab_size} != logits width "
                                 f"{logits.shape[1]} (request {req.request_id})")
            if req.sampling_params.has_penalties and st.num_observed != len(req.output_token_ids):
                raise RuntimeError(
                    f"request {req.request_id}: sampler state saw {st.num_observed} output "
                    f"tokens, request has {len(req.output_token_ids)}; call state.observe() "
                    "for every appended token")


def _entries(per_row: list[torch.Tensor | None], rows: list[int], what: str,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token id) of every entry of the listed rows' token-id tensors, as two [E]
    tensors: the indices of one batched index_put."""
    for row, ids in zip(rows, per_row):
        if ids is None:
            raise ValueError(f"states[{row}]: request has {what} but its state was made "
                             "without it (create it with Sampler.new_state)")
    counts = [t.numel() for t in per_row]  # type: ignore[union-attr]
    # output_size spares CUDA a sync to size the result
    row_of = torch.repeat_interleave(to_device(rows, torch.int64, device),
                                     to_device(counts, torch.int64, device),
                                     output_size=sum(counts))
    return row_of, torch.cat(per_row)  # type: ignore[arg-type]


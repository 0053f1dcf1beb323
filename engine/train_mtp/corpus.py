"""train-mtp steps 1-3, the corpus: the engine that generates it, the recorder of the
target's hidden states, and each generated sequence with the target's top-K distributions."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm import tqdm

from pdserve.engine.train_mtp.prompts import ChatPrompts


def _progress_interval() -> float:
    """tqdm refresh: every 2 s on a terminal, every 15 s into a log (keeps logs short)."""
    return 2.0 if sys.stderr.isatty() else 15.0

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
        from pdserve.engine.model.attention import write_kv

        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)

    def attend(self, q, k_cache, v_cache, meta, scale) -> torch.Tensor:
        from pdserve.engine.model.attention import paged_attention_torch

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
    from pdserve.engine.core.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.engine.llm import build_engine
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.model.loader import load_model

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

@dataclass
class _Run:
    """What a generation run left: each request's tokens (prompt + answer so far), prompt
    lengths, the finished requests, how many prompts were admitted, and whether the time
    budget cut it."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    n_prompt: dict[str, int] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)
    admitted: int = 0
    generated: int = 0
    cut: bool = False


def generate_corpus(engine, prompts: list[list[int]] | ChatPrompts, max_tokens: int,
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
    recorder = HiddenRecorder(engine, store_device, store_dtype)
    start = time.monotonic()
    deadline = None if time_budget_s is None else start + time_budget_s
    run = _run_requests(engine, prompts, max_tokens, temperatures, seed, deadline, refill_below)
    if run.cut:
        for rid in list(run.tokens):
            if rid not in run.finished:
                engine.abort_request(rid)
    _log_rate(engine, run, time.monotonic() - start, info)

    # the shared prefix (system prompt) of the prompts: nothing to learn there
    nxt = run.admitted
    shared = _common_prefix([prompts[i] for i in range(min(nxt, len(prompts)))]) if nxt else 0
    kept = _recorded_sequences(recorder, run, min_new_tokens)
    return _with_teacher(engine.runner.model, kept, top_k, shared)


def _run_requests(engine, prompts: list[list[int]] | ChatPrompts, max_tokens: int,
                  temperatures: list[float], seed: int, deadline: float | None,
                  refill_below: float) -> _Run:
    """Admit prompts in waves and step the engine until all are answered or the deadline."""
    from pdserve.engine.core.sampling_params import InvalidRequestError, SamplingParams

    tokenizer, engine.tokenizer = engine.tokenizer, None  # token ids in, no detokenizing
    sched = engine.scheduler
    slots = engine.config.scheduler.max_num_seqs
    run = _Run()
    tokens, finished = run.tokens, run.finished
    nxt = 0
    bar = tqdm(total=len(prompts) * max_tokens if deadline is None else None,
               desc="generating", unit="tok", mininterval=_progress_interval())
    try:
        while True:
            if deadline is not None and time.monotonic() >= deadline:
                run.cut = nxt < len(prompts) or engine.has_unfinished()
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
                    tokens[rid], run.n_prompt[rid] = list(prompts[nxt]), len(prompts[nxt])
                    nxt, busy = nxt + 1, busy + 1
            if not engine.has_unfinished():
                break
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
                run.generated += len(out.new_token_ids)
                bar.update(len(out.new_token_ids))
                if out.finished:
                    finished.add(out.request_id)
            bar.set_postfix(seqs=f"{len(finished)}/{nxt}", refresh=False)
    finally:
        run.admitted = nxt
        bar.close()
        engine.tokenizer = tokenizer
    return run


def _log_rate(engine, run: _Run, elapsed: float, info: dict | None) -> None:
    """Print the run's token rate; info (a dict, optional) receives the counts."""
    tokens, finished, generated = run.tokens, run.finished, run.generated
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


def _recorded_sequences(recorder: HiddenRecorder, run: _Run,
                        min_new_tokens: int) -> list[tuple[list[int], torch.Tensor]]:
    """Each kept sequence with its recorded hidden states (one row per computed position)."""
    kept: list[tuple[list[int], torch.Tensor]] = []
    for rid, seq in run.tokens.items():
        hidden = recorder.take(rid)
        if hidden is None:
            continue
        if rid not in run.finished:  # cut: keep the positions computed so far
            if len(seq) - run.n_prompt[rid] < min_new_tokens:
                continue
            seq = seq[:hidden.shape[0] + 1]
        hidden = hidden[:len(seq) - 1]
        if hidden.shape[0] != len(seq) - 1:
            continue  # never computed in full (a preempted request cut mid-recompute)
        kept.append((seq, hidden))
    return kept


def _with_teacher(model, kept: list[tuple[list[int], torch.Tensor]], top_k: int,
                  shared: int) -> list[Sample]:
    """The kept sequences as Samples, with the target's top-K at every position; learning
    starts near the end of the `shared` prefix."""
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

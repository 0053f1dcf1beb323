"""ModelRunner: the torch half of an engine step.

It turns a SchedulerOutput (which requests, how many new tokens each) into flat varlen
tensors, runs the model over the paged KV cache, and samples one token for every request
that reached its end this step. It owns the KV cache tensor and per-request sampler state.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata
from engine.config import EngineConfig, ModelConfig
from engine.model import Model
from engine.request import Request
from engine.sampler import Sampler, SamplerState
from engine.scheduler import SchedulerOutput

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def allocate_kv_cache(model: ModelConfig, num_blocks: int, block_size: int,
                      dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """[num_blocks, num_kv_layers, 2, block_size, num_kv_heads, head_dim]: one block = one region."""
    shape = (num_blocks, model.num_kv_layers, 2, block_size, model.num_kv_heads, model.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


@dataclass
class StepResult:
    """What one model step produced for the requests that sample."""

    sampled: dict[str, list[int]]
    logprobs: dict[str, tuple[float, list[tuple[int, float]]]]
    hidden: dict[str, torch.Tensor]  # pre-norm last hidden state, [hidden] (prefill role / MTP)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: Model, kv_cache: torch.Tensor | None = None):
        self.config = config
        self.model = model
        self.device = torch.device(config.device)
        cache = config.cache
        self.block_size = cache.block_size
        self.kv_cache = kv_cache if kv_cache is not None else allocate_kv_cache(
            config.model, cache.num_blocks, cache.block_size, torch_dtype(cache.kv_dtype), self.device)
        self.sampler = Sampler(config.seed)
        self._states: dict[str, SamplerState] = {}

    # -- per-request sampler state -------------------------------------------------------
    def _state(self, req: Request) -> SamplerState:
        state = self._states.get(req.request_id)
        if state is None:
            state = self.sampler.new_state(req, self.config.model.vocab_size, self.device)
            self._states[req.request_id] = state
        return state

    def free_request(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def observe(self, req: Request, token_ids: list[int]) -> None:
        """Feed accepted tokens to the request's incremental penalty state."""
        state = self._states.get(req.request_id)
        if state is not None:
            for t in token_ids:
                state.observe(t)

    # -- one step ------------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flatten the scheduled tokens: input_ids [T], positions [T], attention metadata."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qlens: list[int] = []
        slens: list[int] = []
        tables: list[list[int]] = []
        bs = self.block_size
        for s in out.scheduled:
            req, start = s.request, s.request.num_computed_tokens
            end = start + s.num_new_tokens
            ids += req.all_token_ids[start:end]
            pos += range(start, end)
            table = req.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            qlens.append(s.num_new_tokens)
            slens.append(end)
            tables.append(table[: (end + bs - 1) // bs])
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        dev = self.device
        qsl = [0]
        for q in qlens:
            qsl.append(qsl[-1] + q)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(slens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            max_query_len=max(qlens), max_seq_len=max(slens),
            query_lens_cpu=qlens, seq_lens_cpu=slens, block_size=bs)
        return (torch.tensor(ids, dtype=torch.int64, device=dev),
                torch.tensor(pos, dtype=torch.int64, device=dev), meta)

    @torch.inference_mode()
    def run(self, out: SchedulerOutput, want_hidden: bool = False) -> StepResult:
        input_ids, positions, meta = self.prepare(out)
        hidden, prenorm = self.model(input_ids, positions, meta, self.kv_cache, return_prenorm=True)
        # last row of each sequence that samples this step
        last_rows = [int(meta.query_start_loc[i + 1]) - 1 for i, s in enumerate(out.scheduled)
                     if s.samples]
        sampling = [s.request for s in out.scheduled if s.samples]
        result = StepResult({}, {}, {})
        if not sampling:
            return result
        rows = torch.tensor(last_rows, device=self.device)
        logits = self.model.compute_logits(hidden[rows])
        states = [self._state(r) for r in sampling]
        sample = self.sampler(logits, sampling, states)
        for i, req in enumerate(sampling):
            result.sampled[req.request_id] = [sample.token_ids[i]]
            if sample.logprobs[i] is not None:
                result.logprobs[req.request_id] = sample.logprobs[i]
            if want_hidden:
                result.hidden[req.request_id] = prenorm[last_rows[i]].float().cpu()
        return result

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks (all layers, K and V) src -> dst; one region each."""
        for src, dst in pairs:
            self.kv_cache[dst].copy_(self.kv_cache[src])

"""Offline API: `LLM(model).generate(prompts, SamplingParams(...))`, like vLLM's.

    llm = LLM()                                   # embedded SmolLM2-135M-Instruct
    [out] = llm.generate("Hello", SamplingParams(max_tokens=8, temperature=0))
    print(out.outputs[0].text)
    LLM(speculative="mtp", num_speculative_tokens=2)  # MTP drafting with the trained head
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from engine.config import CacheConfig, ConfigError, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine, RequestOutput
from engine.model_source import load_model, resolve_model
from engine.mtp import resolve_mtp_head, with_mtp_layers
from engine.sampling_params import SamplingParams
from engine.spec_decode import SpecConfig
from engine.weights import as_dtype


@dataclass
class Completion:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[Completion]
    num_cached_tokens: int = 0


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def build_engine(model: str | None = None, *, device: str | None = None, dtype: str | None = None,
                 num_blocks: int | None = None, block_size: int = 16, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, use_triton: bool = False,
                 use_cuda_graphs: bool = False, overlap_decode: str = "auto", seed: int = 0,
                 speculative: str | SpecConfig | None = None,
                 num_speculative_tokens: int | None = None,
                 mtp_head: str | None = None, draft_vocab: int | None = None) -> LLMEngine:
    """Load a model (path, preset name or None = embedded default) and wrap it in an engine.

    use_triton: Triton kernels (fused norms, SiLU-mul, attention prologue, paged attention);
    on CPU they run in Triton's interpreter (tests). use_cuda_graphs (CUDA, needs use_triton):
    decode steps replay graphs captured when the engine is built (engine/cuda_graphs.py).
    overlap_decode: "auto" (with CUDA graphs), "on" or "off": launch the next decode forward
    before the host reads this step's tokens (engine/overlap.py).

    speculative="mtp" (or a SpecConfig): MTP speculative decoding with the model's MTP head:
    `mtp_head` (a train-mtp file), the checkpoint's MTP layers, random for presets, or the
    trained head shipped for the default model. num_speculative_tokens overrides k;
    draft_vocab N drafts over N token ids only (SpecConfig.draft_vocab)."""
    device = device or default_device()
    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    source = resolve_model(model)
    backend = None
    if use_triton:
        from kernels import TritonAttentionBackend  # triton only when asked for

        backend = TritonAttentionBackend()
    net, model_cfg, tokenizer = load_model(source, dtype=dtype, device=device, seed=seed,
                                           backend=backend)
    net.use_fused_ops(use_triton)
    spec = _spec_config(speculative, num_speculative_tokens, draft_vocab)
    head, head_id = None, ""
    if spec is not None:  # the KV cache gets one more layer per MTP layer
        head, model_cfg, head_id = resolve_mtp_head(source, model_cfg, as_dtype(dtype), device,
                                                    net.backend, seed, mtp_head)
        head.set_fused(use_triton)
    else:
        model_cfg = with_mtp_layers(model_cfg, 0)  # a checkpoint's MTP layers stay unused
    max_len = min(max_model_len or model_cfg.max_position_embeddings,
                  model_cfg.max_position_embeddings)
    if device.startswith("cuda"):  # RoPE rows by one gather (CPU keeps computing them: its
        # vectorised cos may differ by an ulp between a table and a batch's rows)
        drafts = spec.num_speculative_tokens if spec is not None else 0
        net.rotary.reserve(max_len + drafts + 1, torch.device(device))
    if num_blocks is None:  # enough for a few full-length sequences; modest on CPU
        num_blocks = max(64, (2 * max_len) // block_size) if device == "cpu" else \
            max(64, (64 * max_len) // block_size)
    config = EngineConfig(
        model=model_cfg,
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, kv_dtype=dtype,
                          enable_prefix_caching=enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens,
                                  max_model_len=max_len),
        device=device, dtype=dtype, use_triton=use_triton, use_cuda_graphs=use_cuda_graphs,
        overlap_decode=overlap_decode, seed=seed)
    return LLMEngine(config, net, tokenizer, spec=spec, mtp_head=head, mtp_head_id=head_id)


def _spec_config(speculative: str | SpecConfig | None, k: int | None,
                 draft_vocab: int | None = None) -> SpecConfig | None:
    if speculative is None or speculative == "none":
        if draft_vocab:
            raise ConfigError("draft_vocab: needs speculative='mtp'")
        return None
    if isinstance(speculative, SpecConfig):
        spec = speculative
    elif isinstance(speculative, str):
        spec = SpecConfig(method=speculative)
    else:
        raise ConfigError(f"speculative: expected 'mtp' or a SpecConfig, got {speculative!r}")
    if k is not None:
        spec = dataclasses.replace(spec, num_speculative_tokens=k)
    if draft_vocab is not None:
        spec = dataclasses.replace(spec, draft_vocab=draft_vocab)
    return spec


class LLM:
    def __init__(self, model: str | None = None, **engine_kwargs: object) -> None:
        self.engine = build_engine(model, **engine_kwargs)  # type: ignore[arg-type]
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | Sequence[str] | Sequence[list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[GenerationResult]:
        """Run all prompts to completion as one continuously batched workload."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params or SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError("sampling_params: need one per prompt or a single one")
        results: list[GenerationResult] = []
        groups: dict[str, tuple[GenerationResult, int]] = {}
        for prompt, p in zip(prompts, plist):
            rids = self.engine.add_request(prompt, p)
            ids = self.engine.scheduler.get_request(rids[0]).prompt_token_ids
            res = GenerationResult(rids[0], ids, [Completion(i) for i in range(len(rids))])
            results.append(res)
            groups.update({rid: (res, i) for i, rid in enumerate(rids)})
        for out in self.engine.generate_until_done():
            res, i = groups[out.request_id]
            _accumulate(res.outputs[i], out)
            res.num_cached_tokens = max(res.num_cached_tokens, out.num_cached_tokens)
        return results

    def stream(self, prompt: str | list[int], sampling_params: SamplingParams) -> Iterator[str]:
        """Yield text deltas of one completion as the engine produces them."""
        [rid] = self.engine.add_request(prompt, sampling_params)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.request_id == rid and out.new_text:
                    yield out.new_text

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        if self.tokenizer is None:
            raise ValueError("model: this model has no tokenizer / chat template")
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def _accumulate(c: Completion, out: RequestOutput) -> None:
    c.text += out.new_text
    c.token_ids += out.new_token_ids
    c.logprobs += out.new_logprobs
    if out.finished:
        c.finish_reason = out.finish_reason

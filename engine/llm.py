"""Offline API: `LLM(model).generate(prompts, SamplingParams(...))`, like vLLM's.

    llm = LLM()                                   # embedded SmolLM2-135M-Instruct
    [out] = llm.generate("Hello", SamplingParams(max_tokens=8, temperature=0))
    print(out.outputs[0].text)
    LLM(speculative="mtp", num_speculative_tokens=2)  # MTP drafting with the trained head
    LLM(tensor_parallel_size=3)  # this process and 2 spawned ones, each 1/3 of the model
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from pdserve.engine.core.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    ModelIdentity,
    SchedulerConfig,
    SpecConfig,
)
from pdserve.engine.core.engine_args import EngineArgs
from pdserve.engine.core.outputs import PromptLogprob, RequestOutput
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.dist.config import ParallelConfig
from pdserve.engine.dist.group import TPGroup
from pdserve.engine.dist.heads import check_model_split
from pdserve.engine.dist.lockstep import Follower
from pdserve.engine.dist.parallel import TPContext
from pdserve.engine.dist.rank import LocalRanks, check_tp_args
from pdserve.engine.dist.shard import bind_context
from pdserve.engine.exec.cuda_graphs import maybe_decode_graphs
from pdserve.engine.exec.kv_cache import engine_kv_cache
from pdserve.engine.exec.warmup import warm_up
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model.decoder import Model
from pdserve.engine.model.fp8_convert import check_fp8_kernels
from pdserve.engine.model.loader import (
    load_model,
    load_tokenizer_and_config,
    model_identity,
    resolve_model,
)
from pdserve.engine.model.shard_load import resolve_mtp_shard
from pdserve.engine.model.weights import as_dtype
from pdserve.engine.spec.mtp_head import resolve_mtp_head, with_mtp_layers
from pdserve.engine.spec.verify_graphs import maybe_verify_graphs
from pdserve.kernels.triton_mode import select_triton_mode


@dataclass
class Completion:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    stop_reason: str | int | None = None  # the stop string or token that ended it


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[Completion]
    num_cached_tokens: int = 0
    # with prompt_logprobs: prompt token i + 1's given tokens 0..i
    prompt_logprobs: list[PromptLogprob] | None = None


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class RankParts:
    """What one rank loaded: its Model (the shard with TP), the EngineConfig (model = the
    FULL config: the compat hash is the same at every TP size), and the group (None: TP 1)."""

    net: Model
    config: EngineConfig
    tokenizer: object
    spec: SpecConfig | None
    head: torch.nn.Module | None
    head_id: str
    group: TPGroup | None

    def follower(self) -> Follower:
        """A follower rank's lockstep loop over its own KV cache (the leader's blocks; with
        MTP one more layer per MTP layer) and, with speculative, its shard of the MTP head:
        it runs rank 0's drafting passes (engine/dist/lockstep.py MTP messages). With CUDA
        graphs its decode graphs are captured here, while rank 0's ModelRunner captures its
        own: the warm-up forwards and the captures meet in the same collectives."""
        assert self.group is not None  # a follower always has its group
        kv = engine_kv_cache(self.config, self.net.config.num_kv_heads)
        graphs = maybe_decode_graphs(self.config, self.net, kv)
        verify = maybe_verify_graphs(self.config, self.net, kv, self.spec)  # as rank 0's
        return Follower(self.group, self.net, kv, head=self.head, graphs=graphs,
                        verify_graphs=verify)


def load_rank(args: EngineArgs, parallel: ParallelConfig | None = None,
              join: Callable[[], TPGroup] | None = None) -> RankParts:
    """Load the model for one rank. With TP the rank loads only its shard, directly
    (engine/model/shard_load.py: each checkpoint tensor cut as it streams, a preset drawn a
    full tensor at a time; peak memory beyond the shard: one full tensor), then joins the
    group: a follower passes its ParallelConfig; rank 0 of args.tensor_parallel_size ranks
    its `join`, called once loaded (its peers load meanwhile). With a join but
    args.tensor_parallel_size 1 the caller's group has formed already (worker/tp_group.py
    RankActor): join() runs first and says the rank."""
    device = parallel.device if parallel is not None else (args.device or default_device())
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    source = resolve_model(args.model)
    backend, spec = None, args.spec_config()
    if args.use_triton:  # an entry point of the offline API: pick the Triton mode first
        select_triton_mode()
        from pdserve.engine.model.triton_attention import TritonAttentionBackend

        backend = TritonAttentionBackend(
            verify_rows=spec.num_speculative_tokens + 1 if spec is not None else 1)
    group = join() if join is not None and args.tensor_parallel_size <= 1 else None
    tp, rank = _rank_of(args, parallel, group)
    net, model_cfg, tokenizer = load_model(source, dtype=dtype, device=device, seed=args.seed,
                                           backend=backend, quantization=args.quantization,
                                           tp=tp, rank=rank)
    if group is None and parallel is not None and parallel.tp_size > 1:
        group = TPGroup(parallel)
    elif group is None and join is not None:
        group = join()
    if group is not None:
        _check_joined(group, tp, rank)
        net = bind_context(net, TPContext(group, model_cfg.vocab_size))
    check_fp8_kernels(net, args.use_triton)
    net.use_fused_ops(args.use_triton)
    head, head_id = None, ""
    if spec is not None:  # the KV cache gets one more layer per MTP layer
        head, model_cfg, head_id = resolve_mtp_shard(source, model_cfg, tp, rank, as_dtype(dtype),
                                                     device, net.backend, args.seed,
                                                     args.mtp_head) if tp > 1 else \
            resolve_mtp_head(source, model_cfg, as_dtype(dtype), device, net.backend, args.seed,
                             args.mtp_head)
        head.set_fused(args.use_triton)
    else:
        model_cfg = with_mtp_layers(model_cfg, 0)  # a checkpoint's MTP layers stay unused
    max_len = min(args.max_model_len or model_cfg.max_position_embeddings,
                  model_cfg.max_position_embeddings)
    if device.startswith("cuda"):  # RoPE rows by one gather (CPU keeps computing them: its
        # vectorised cos may differ by an ulp between a table and a batch's rows)
        drafts = spec.num_speculative_tokens if spec is not None else 0
        net.rotary.reserve(max_len + drafts + 1, torch.device(device))
    identity = model_identity(source, seed=args.seed, quantization=args.quantization,
                              tokenizer=tokenizer)  # every rank alike: the checkpoint's
    config = _engine_config(args, model_cfg, device, dtype, max_len, identity)
    return RankParts(net, config, tokenizer, spec, head, head_id, group)


def _rank_of(args: EngineArgs, parallel: ParallelConfig | None,
             group: TPGroup | None) -> tuple[int, int]:
    """(tp size, rank) this process loads the shard of, known before it joins."""
    if group is not None:
        return group.size, group.rank
    if parallel is not None:
        return parallel.tp_size, parallel.rank
    return args.tensor_parallel_size, 0


def _check_joined(group: TPGroup, tp: int, rank: int) -> None:
    """The group joined after loading must be the one the shard was cut for."""
    if (group.size, group.rank) != (tp, rank):
        raise ConfigError(f"tensor_parallel_size: loaded the shard of rank {rank} of {tp} but "
                          f"joined as rank {group.rank} of {group.size}")


def build_engine(args: EngineArgs | str | None = None, /, **fields: object) -> LLMEngine:
    """Load a model and wrap it in an engine: build_engine(EngineArgs(...)), or as a shorthand
    build_engine(model, **EngineArgs fields) (a model path, preset name, or None = the
    embedded default). Fields are validated by EngineArgs, which names a bad one.

    With speculation (args.speculative) the MTP head comes from `mtp_head` (a train-mtp file),
    the checkpoint's MTP layers, random weights for presets, or the trained head shipped for
    the default model (engine/spec/mtp_head.py resolve_mtp_head).

    tensor_parallel_size N > 1: this process is rank 0 and N - 1 spawned processes follow
    its steps (engine/dist/rank.py); engine.close() stops them."""
    if not isinstance(args, EngineArgs):
        args = EngineArgs(model=args, **fields)  # type: ignore[arg-type]
    elif fields:
        args = args.replace(**fields)
    check_tp_args(args)
    ranks = None
    if args.tensor_parallel_size > 1:  # every split checked (naming the field) before spawning
        check_model_split(load_tokenizer_and_config(args.model)[1], args.tensor_parallel_size)
        ranks = LocalRanks.start(args, args.device or default_device())
    try:
        parts = load_rank(args, join=ranks.join if ranks is not None else None)
        engine = LLMEngine(parts.config, parts.net, parts.tokenizer, spec=parts.spec,
                           mtp_head=parts.head, mtp_head_id=parts.head_id,
                           leader=ranks.leader if ranks is not None else None)
        if args.warmup:  # Triton compiles here, not in a served step
            warm_up(engine)
        if ranks is not None:  # graphs captured: their collectives get a deadline
            ranks.group.start_watchdog()
    except BaseException:
        if ranks is not None:
            ranks.close()
        raise
    if ranks is not None:  # close() or, at the latest, the engine's collection or exit
        engine.on_close(weakref.finalize(engine, ranks.close))
    return engine


def _engine_config(args: EngineArgs, model_cfg: ModelConfig, device: str, dtype: str,
                   max_len: int, identity: ModelIdentity) -> EngineConfig:
    num_blocks = args.num_blocks
    if num_blocks is None:  # enough for a few full-length sequences; modest on CPU
        per_device = 2 if device == "cpu" else 64
        num_blocks = max(64, (per_device * max_len) // args.block_size)
    return EngineConfig(
        model=model_cfg,
        cache=CacheConfig(block_size=args.block_size, num_blocks=num_blocks, kv_dtype=dtype,
                          enable_prefix_caching=args.enable_prefix_caching,
                          kv_cache_dtype=args.kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_model_len=max_len, policy=args.scheduling_policy),
        device=device, dtype=dtype, use_triton=args.use_triton,
        use_cuda_graphs=args.use_cuda_graphs, overlap_decode=args.overlap_decode, seed=args.seed,
        identity=identity)


class LLM:
    """LLM(model, **EngineArgs fields) or LLM(EngineArgs(...))."""

    def __init__(self, model: EngineArgs | str | None = None, **fields: object) -> None:
        self.engine = build_engine(model, **fields)
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Stop the engine's follower ranks (tensor_parallel_size > 1); idempotent."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
            if out.prompt_logprobs is not None and res.prompt_logprobs is None:
                res.prompt_logprobs = out.prompt_logprobs
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
        c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason

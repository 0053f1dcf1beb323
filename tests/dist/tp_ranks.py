"""What each rank runs in tests/dist/test_tp_forward.py (module level: spawned processes
import it). Every rank builds the same seeded full model, keeps its shard, and runs the
sharded forward in the real gloo group; rank 0 also runs the full model and compares."""
from __future__ import annotations

import time

import torch

from pdserve.engine.core.config import ModelConfig, MoEConfig
from pdserve.engine.dist.group import GroupError, TPGroup
from pdserve.engine.dist.lockstep import Follower, Leader, LeaderModel
from pdserve.engine.dist.parallel import TPContext
from pdserve.engine.dist.shard import shard_model
from pdserve.engine.model.decoder import Model
from pdserve.engine.model.weights import random_model

from tests.dist import tp_harness as h

NEW_TOKENS = 6


def tiny(arch: str = "qwen3", heads: int = 4, kv: int = 2, head_dim: int = 16,
         vocab: int = 101, inter: int = 96, moe: bool = False) -> ModelConfig:
    """vocab 101: not a multiple of 2 or 3, so the last rank's vocabulary rows are padded."""
    m = MoEConfig(num_experts=8, top_k=2, intermediate_size=48, dense_layers=(1,)) if moe else None
    return ModelConfig(arch=arch, vocab_size=vocab, hidden_size=heads * head_dim, num_layers=2,
                       num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
                       intermediate_size=inter, qk_norm=arch in ("qwen3", "qwen3_moe"),
                       moe=m, rms_norm_eps=1e-6)


def prompts(cfg: ModelConfig) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 7, 3)]


def _models(group: TPGroup, cfg: ModelConfig) -> tuple[Model, Model]:
    full = random_model(cfg, seed=0, std=0.1)
    ctx = TPContext(group, cfg.vocab_size)
    return full, shard_model(full, group.size, group.rank, ctx=ctx)


def _full_step(full: Model, kv: torch.Tensor):
    def step(b, rows):
        ids, pos, meta = b.to_device(torch.device("cpu"))
        return full.compute_logits(full(ids, pos, meta, kv)[torch.tensor(rows)])
    return step


def sharded_equals_full(group: TPGroup, cfg: ModelConfig) -> dict:
    """Greedy over 3 prompts x NEW_TOKENS on the shard (eager layers, logits all-gathered),
    then one batch-1 decode step through the GEMV path (residual added by rank 0 only) and
    the cross-rank argmax; rank 0 compares with the full model."""
    full, local = _models(group, cfg)
    kv = h.kv_cache(local.config, 3)
    first: list[torch.Tensor] = []

    @torch.inference_mode()
    def tp_step(b, rows):
        ids, pos, meta = b.to_device(torch.device("cpu"))
        logits = local.compute_logits(local(ids, pos, meta, kv)[rows])
        first.append(logits)
        return logits

    ps = prompts(cfg)
    tp_tokens = h.greedy_loop(tp_step, ps, NEW_TOKENS)
    # one more decode step of sequence 0 alone (T = 1): GEMV path and cross-rank argmax
    seq0 = ps[0] + tp_tokens[0]
    b = h.batch([seq0[-1:]], [len(seq0) - 1])
    with torch.inference_mode():
        ids, pos, meta = b.to_device(torch.device("cpu"))
        for layer in local.layers:  # the decoder's GEMV path (kernels.gemv, interpreted)
            layer.fused = True
        hid = local(ids, pos, meta, kv)
        tp_next = local.greedy(hid).tolist()
    out = {"tokens": tp_tokens, "next": tp_next, "shapes": _shapes(local)}
    if group.rank == 0:
        kvf = h.kv_cache(cfg, 3)
        with torch.inference_mode():
            out["full_tokens"] = h.greedy_loop(_full_step(full, kvf), ps, NEW_TOKENS)
            ids, pos, meta = h.batch(ps, [0, 0, 0]).to_device(torch.device("cpu"))
            ref = h.kv_cache(cfg, 3)
            rows = [4, 11, 14]
            out["first_diff"] = (full.compute_logits(full(ids, pos, meta, ref)[rows])
                                 - first[0]).abs().max().item()
            ids, pos, meta = b.to_device(torch.device("cpu"))
            hf = full(ids, pos, meta, kvf)
            out["gemv_diff"] = (hf - hid).abs().max().item()
            out["full_next"] = full.compute_logits(hf).argmax(-1).tolist()
    return out


def _shapes(model: Model) -> dict:
    a = model.layers[0].self_attn
    return {"qkv": tuple(a.qkv_proj.weight.shape), "o": tuple(a.o_proj.weight.shape),
            "embed": tuple(model.embed_tokens.weight.shape),
            "heads": (a.num_heads, a.num_kv_heads)}


def lockstep_equals_full(group: TPGroup, cfg: ModelConfig) -> dict:
    """Rank 0 leads (announces each step, then runs it), the others follow until STOP."""
    full, local = _models(group, cfg)
    kv = h.kv_cache(local.config, 3)
    if group.rank != 0:
        steps = Follower(group, local, kv).run()
        return {"steps": steps, "copied": bool(torch.equal(kv[30], kv[0]))}
    leader = Leader(group)
    lm = LeaderModel(leader, local, kv)
    tokens = h.greedy_loop(lm.step, prompts(cfg), NEW_TOKENS)
    lm.copy_blocks([(0, 30), (1, 31)])  # every rank copies in its own cache
    leader.tick()
    leader.stop()
    with torch.inference_mode():
        ref = h.greedy_loop(_full_step(full, h.kv_cache(cfg, 3)), prompts(cfg), NEW_TOKENS)
    return {"tokens": tokens, "full_tokens": ref, "copied": bool(torch.equal(kv[30], kv[0]))}


def dead_follower(group: TPGroup, cfg: ModelConfig) -> dict:
    """Rank 1 exits after the first step; rank 0's next forward must fail, not hang."""
    _, local = _models(group, cfg)
    kv = h.kv_cache(local.config, 3)
    if group.rank == 1:
        f = Follower(group, local, kv)
        f.forward(f.receive())
        group.close()  # the process ends: its sockets close
        return {"left": True}
    lm = LeaderModel(Leader(group), local, kv)
    lm.step(h.batch([[1, 2, 3]], [0]), [2])
    t0 = time.monotonic()
    try:
        for _ in range(50):
            lm.step(h.batch([[4]], [3]), [0])
    except GroupError as e:
        return {"error": str(e)[:300], "seconds": time.monotonic() - t0}
    return {"error": None}


def silent_leader(group: TPGroup, cfg: ModelConfig) -> dict:
    """Rank 0 stops sending (hung) without closing; the follower's wait must end with a
    GroupError at the group's deadline. Rank 0 waits out its own deadline in a barrier."""
    _, local = _models(group, cfg)
    if group.rank == 0:
        try:
            group.barrier()  # never completes: the follower is in its receive
        except GroupError as e:
            return {"leader_error": str(e)[:200]}
        return {"leader_error": None}
    try:
        Follower(group, local, h.kv_cache(local.config, 1)).receive()
    except GroupError as e:
        return {"error": str(e)[:300]}
    return {"error": None}

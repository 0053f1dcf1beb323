"""Sharding a loaded full model into a rank's shard (engine/dist/shard.py): the ranks' pieces
put back together are the full tensors; FP8 scales follow their weights (or the split is
refused naming the scale); MoE experts, MTP layers and SmolLM2-135M's shape at TP=3."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.engine.core.config import ConfigError, ModelConfig, MoEConfig
from pdserve.engine.dist.shard import ShardPlan, shard_model, shard_mtp_head
from pdserve.engine.model.fp8 import Fp8Linear, dequantize
from pdserve.engine.model.fp8_convert import quantize_model
from pdserve.engine.model.moe import Experts
from pdserve.engine.model.weights import random_model
from pdserve.engine.spec.mtp_head import MTPHead


def _cfg(kv: int = 2, moe: MoEConfig | None = None, **kw: object) -> ModelConfig:
    return ModelConfig(arch="qwen3_moe" if moe else "qwen3", vocab_size=101, hidden_size=64,
                       num_layers=2, num_heads=4, num_kv_heads=kv, head_dim=16,
                       intermediate_size=96, qk_norm=True, moe=moe, **kw)


def _qkv_rows(cfg: ModelConfig, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return w[:q], w[q:q + kv], w[q + kv:]


def test_rank_pieces_put_together_are_the_full_tensors() -> None:
    cfg = _cfg()
    full = random_model(cfg, seed=0)
    shards = [shard_model(full, 2, r) for r in range(2)]
    fa, la = full.layers[1].self_attn, [s.layers[1].self_attn for s in shards]
    lq = [_qkv_rows(s.config, a.qkv_proj.weight) for s, a in zip(shards, la)]
    for i, full_part in enumerate(_qkv_rows(cfg, fa.qkv_proj.weight)):  # q, k, v
        assert torch.equal(torch.cat([p[i] for p in lq]), full_part)
    assert torch.equal(torch.cat([a.o_proj.weight for a in la], 1), fa.o_proj.weight)
    fm, lm = full.layers[0].mlp, [s.layers[0].mlp for s in shards]
    gates = [m.gate_up_proj.weight.chunk(2) for m in lm]
    assert torch.equal(torch.cat([g for g, _ in gates] + [u for _, u in gates]),
                       fm.gate_up_proj.weight)
    assert torch.equal(torch.cat([m.down_proj.weight for m in lm], 1), fm.down_proj.weight)
    # vocabulary: 51 rows each, the last row of rank 1 is padding (zeros)
    emb = torch.cat([s.embed_tokens.weight for s in shards])
    assert emb.shape[0] == 102 and torch.equal(emb[:101], full.embed_tokens.weight)
    assert not emb[101].any()
    # QK-norm and layer norms replicated
    assert all(torch.equal(a.q_norm.weight, fa.q_norm.weight) for a in la)
    assert shards[1].config.num_heads == 2 and shards[1].config.intermediate_size == 48


def test_one_kv_head_is_replicated_on_every_rank() -> None:
    cfg = _cfg(kv=1)
    full = random_model(cfg, seed=0)
    _, fk, fv = _qkv_rows(cfg, full.layers[0].self_attn.qkv_proj.weight)
    for r in range(2):
        s = shard_model(full, 2, r)
        _, k, v = _qkv_rows(s.config, s.layers[0].self_attn.qkv_proj.weight)
        assert torch.equal(k, fk) and torch.equal(v, fv)


def test_bias_rows_follow_the_heads() -> None:
    cfg = dataclasses.replace(_cfg(), arch="qwen2", qk_norm=False, attention_bias=True)
    full = random_model(cfg, seed=0)
    b = [shard_model(full, 2, r).layers[0].self_attn.qkv_proj.bias for r in range(2)]
    fq, fk, fv = _qkv_rows(cfg, full.layers[0].self_attn.qkv_proj.bias)
    assert torch.equal(torch.cat([b[0][:32], b[1][:32], b[0][32:48], b[1][32:48]]),
                       torch.cat([fq, fk]))


def test_moe_experts_split_inside_each_expert() -> None:
    moe = MoEConfig(num_experts=4, top_k=2, intermediate_size=64)
    full = random_model(_cfg(moe=moe), seed=0)
    fe = full.layers[0].mlp.experts
    parts = [shard_model(full, 2, r).layers[0].mlp for r in range(2)]
    assert all(torch.equal(p.gate.weight, full.layers[0].mlp.gate.weight) for p in parts)
    e = [p.experts for p in parts]
    assert e[0].w13.shape == (4, 64, 64) and e[0].w2.shape == (4, 64, 32)
    g = [x.w13.chunk(2, dim=1) for x in e]
    assert torch.equal(torch.cat([g[0][0], g[1][0], g[0][1], g[1][1]], 1), fe.w13)
    assert torch.equal(torch.cat([x.w2 for x in e], 2), fe.w2)


def _dense(m: torch.nn.Module) -> torch.Tensor:
    return dequantize(m.weight, m.weight_scale, m.block) if isinstance(m, Fp8Linear) else m.weight


@pytest.mark.parametrize("block,want", [((16, 16), (16, 16)), ((32, 16), (1, 16))])
def test_fp8_scales_follow_their_rows(block: tuple[int, int], want: tuple[int, int]) -> None:
    """Aligned row pieces keep the block; pieces inside a block (k/v heads of 16 rows in
    32-row blocks) get per-row scales, exactly: the shard dequantizes to the full one's rows."""
    moe = MoEConfig(num_experts=4, top_k=2, intermediate_size=64)
    full = random_model(_cfg(moe=moe), seed=0)
    quantize_model(full, block)
    for r in range(2):
        plan = ShardPlan(full.config, 2, r)
        local = shard_model(full, 2, r)
        for name, m in full.named_modules():
            if isinstance(m, Fp8Linear):
                lm = local.get_submodule(name)
                assert isinstance(lm, Fp8Linear) and lm.weight.dtype == m.weight.dtype
                assert torch.equal(_dense(lm), plan.shard(f"{name}.weight", _dense(m))), name
                if name.endswith("qkv_proj"):
                    assert lm.block == want
            elif isinstance(m, Experts):
                le = local.get_submodule(name)
                w13 = dequantize(m.w13, m.w13_scale, m.blocks[0])
                lw13 = dequantize(le.w13, le.w13_scale, le.blocks[0])
                assert torch.equal(lw13, plan.shard(f"{name}.w13", w13))
                lw2 = dequantize(le.w2, le.w2_scale, le.blocks[1])
                assert torch.equal(lw2, plan.shard(f"{name}.w2", dequantize(m.w2, m.w2_scale,
                                                                           m.blocks[1])))


def test_fp8_column_split_inside_a_scale_block_is_refused_naming_the_scale() -> None:
    full = random_model(_cfg(), seed=0)
    quantize_model(full, (16, 32))  # down_proj: 48 columns per rank, blocks of 32
    with pytest.raises(ConfigError, match=r"^layers\.0\.mlp\.down_proj\.weight_scale: columns "
                                          r"\[48, 96\)"):
        shard_model(full, 2, 1)


def test_mtp_head_block_is_split_and_its_inputs_replicated() -> None:
    cfg = dataclasses.replace(_cfg(), num_mtp_layers=1)
    torch.manual_seed(0)
    head = MTPHead(cfg)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.1)
    local = shard_mtp_head(head, cfg, 2, 1)
    assert torch.equal(local.layers[0].eh_proj.weight, head.layers[0].eh_proj.weight)
    fa, la = head.layers[0].block.self_attn, local.layers[0].block.self_attn
    assert la.qkv_proj.weight.shape == (64, 64) and la.num_heads == 2
    assert torch.equal(la.o_proj.weight, fa.o_proj.weight[:, 32:])


def test_smollm2_135m_shape_at_tp3() -> None:
    """SmolLM2-135M (9 heads, 3 KV heads, MLP 1536, vocabulary 49152) on the meta device."""
    cfg = ModelConfig(arch="llama", vocab_size=49152, hidden_size=576, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536,
                      tie_word_embeddings=True)
    local = shard_model(random_model(cfg, device="meta"), 3, 2)
    c = local.config
    assert (c.num_heads, c.num_kv_heads, c.intermediate_size, c.vocab_size) == (3, 1, 512, 16384)
    assert local.layers[0].self_attn.qkv_proj.weight.shape == (5 * 64, 576)
    assert local.lm_head.weight is local.embed_tokens.weight  # still tied
    with pytest.raises(ConfigError, match="^num_heads: 9 attention heads"):
        ShardPlan(cfg, 2, 0)

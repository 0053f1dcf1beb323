"""Tiny Hugging Face checkpoints of the model families beyond Llama / Qwen3, made with
transformers' own classes (test_families.py, test_mtp_checkpoint.py), and a driver that runs
our model over the paged KV cache the way the engine does.

MiMo has no transformers class: its checkpoint is a Qwen2 one whose config.json says
model_type "mimo" (architectures ["MiMoForCausalLM"], num_nextn_predict_layers), plus MTP
tensors `model.mtp_layers.{i}.{token_layernorm, hidden_layernorm, input_proj, final_layernorm,
<Qwen2 decoder layer>}` as XiaomiMiMo/MiMo-7B's modeling_mimo.py names them. GLM-4.5's MTP
layer is DeepSeek-V3-named: `model.layers.{N}.{enorm, hnorm, eh_proj, shared_head.norm,
shared_head.head, embed_tokens, <MoE decoder layer>}`, which transformers' Glm4Moe class does not
create; the block tensors are taken from layer N of an (N + 1)-layer model of the same config.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pdserve.engine.exec.kv_cache import allocate_kv_cache
from pdserve.engine.model.attention import make_metadata
from pdserve.kernels.kv_quant import FP8

transformers = pytest.importorskip("transformers")

VOCAB = 96
BLOCK = 4
NUM_BLOCKS = 48
TOL = 1e-4
_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def _qwen2(layers: int = 2) -> transformers.PretrainedConfig:
    return transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
        max_position_embeddings=512, tie_word_embeddings=False, rope_parameters=_ROPE)


def _qwen3_moe(layers: int = 3) -> transformers.PretrainedConfig:
    # layer 1 dense (mlp_only_layers); 16 experts, top 2: a few tokens leave experts idle
    return transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=16, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
        max_position_embeddings=512, tie_word_embeddings=False, rope_parameters=_ROPE)


def _glm4_moe(layers: int = 3, **kw: object) -> transformers.PretrainedConfig:
    # GLM-4.5-like: QK-norm, q/k/v biases, RoPE on half of each head, dense first layer, a
    # shared expert, group-limited sigmoid routing (4 groups, best 2 eligible), scaling 2.5
    args = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                head_dim=32, n_routed_experts=16, num_experts_per_tok=2, n_group=4, topk_group=2,
                first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5,
                norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
                max_position_embeddings=512, tie_word_embeddings=False,
                rope_parameters={**_ROPE, "partial_rotary_factor": 0.5})
    return transformers.Glm4MoeConfig(**{**args, **kw})


def _glm4_moe_air(layers: int = 3) -> transformers.PretrainedConfig:
    # GLM-4.5-Air-like: no QK-norm, one expert group, top 3 without renormalisation
    return _glm4_moe(layers, use_qk_norm=False, n_group=1, topk_group=1, num_experts_per_tok=3,
                     routed_scaling_factor=1.0, norm_topk_prob=False)


CONFIGS: dict[str, Callable[..., transformers.PretrainedConfig]] = {
    "qwen2": _qwen2, "mimo": _qwen2, "qwen3_moe": _qwen3_moe, "glm4_moe": _glm4_moe,
    "glm4_moe_air": _glm4_moe_air}


def tiny_hf(family: str, layers: int | None = None, seed: int = 0):
    """A transformers model of `family` with O(1) random weights (so a wrong op shows in the
    logits), non-trivial norms and, for GLM, a random non-zero correction bias (transformers
    initialises it to zeros), of both signs: some biased scores are negative, where masking
    the other groups with 0.0 instead of transformers' -inf would pick a wrong expert."""
    torch.manual_seed(seed)
    cfg = CONFIGS[family]() if layers is None else CONFIGS[family](layers)
    cfg._attn_implementation = "eager"
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name
                    else torch.randn_like(p) / p.shape[-1] ** 0.5)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(1.2 * torch.rand_like(b) - 0.8)
    return hf


def save_checkpoint(family: str, folder: Path, mtp: bool = False):
    """Save tiny_hf(family) to `folder` as its family's checkpoint; mtp: with one MTP layer
    (MiMo or DeepSeek/GLM naming) and num_nextn_predict_layers=1. Returns (the transformers
    model of the target, the (N + 1)-layer model whose last layer is the MTP block, or None)."""
    hf = tiny_hf(family)
    hf.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    if family == "mimo":  # a MiMo checkpoint is a Qwen2 one under another name
        config.update(model_type="mimo", architectures=["MiMoForCausalLM"], attention_bias=True)
    config["num_nextn_predict_layers"] = 1 if mtp else 0
    (folder / "config.json").write_text(json.dumps(config))
    if not mtp:
        return hf, None
    n = hf.config.num_hidden_layers
    donor = tiny_hf(family, layers=n + 1, seed=1)
    donor.save_pretrained(folder / "donor")
    from safetensors.torch import load_file, save_file
    tensors = load_file(folder / "model.safetensors")
    block = {k.removeprefix(f"model.layers.{n}."): v
             for k, v in load_file(folder / "donor" / "model.safetensors").items()
             if k.startswith(f"model.layers.{n}.")}
    save_file({**tensors, **mtp_tensors(family, n, block, tensors)},
              folder / "model.safetensors", metadata={"format": "pt"})
    return hf, donor


def mtp_own_weights(h: int) -> dict[str, torch.Tensor]:
    """enorm, hnorm, eh_proj ([token | hidden] -> H) and the final norm, DeepSeek names."""
    g = torch.Generator().manual_seed(9)
    return {"enorm.weight": 1 + 0.3 * torch.randn(h, generator=g),
            "hnorm.weight": 1 + 0.3 * torch.randn(h, generator=g),
            "eh_proj.weight": torch.randn(h, 2 * h, generator=g) / (2 * h) ** 0.5,
            "shared_head.norm.weight": 1 + 0.3 * torch.randn(h, generator=g)}


def mtp_tensors(family: str, n: int, block: dict[str, torch.Tensor],
                target: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    own = mtp_own_weights(target["model.norm.weight"].shape[0])
    if family == "mimo":  # MiMo's input_proj reads [hidden | token]
        h = own["enorm.weight"].shape[0]
        proj = own["eh_proj.weight"]
        names = {"token_layernorm.weight": own["enorm.weight"],
                 "hidden_layernorm.weight": own["hnorm.weight"],
                 "input_proj.weight": torch.cat([proj[:, h:], proj[:, :h]], dim=1),
                 "final_layernorm.weight": own["shared_head.norm.weight"]}
        return {f"model.mtp_layers.0.{k}": v for k, v in {**names, **block}.items()}
    shared = {"shared_head.head.weight": target["lm_head.weight"].clone(),
              "embed_tokens.weight": target["model.embed_tokens.weight"].clone()}
    return {f"model.layers.{n}.{k}": v for k, v in {**own, **shared, **block}.items()}


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]  # [len, vocab]


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def assert_match(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ref.abs().max() > 1.0  # the comparison means something
    diff = (ours - ref).abs().max().item()
    assert diff <= TOL, f"max abs diff {diff:.2e}"


class Paged:
    """Drives our model like the engine: one call = one step over several sequences."""

    kv_dtype: torch.dtype | None = None  # None: the model's float dtype; FP8: an fp8 cache

    def __init__(self, model, num_blocks: int = NUM_BLOCKS) -> None:
        self.model = model
        dtype = self.kv_dtype or next(model.parameters()).dtype
        self.kv = allocate_kv_cache(model.config, num_blocks, BLOCK, dtype, "cpu")

    def step(self, seqs: list[tuple[list[int], int, list[int]]]) -> list[torch.Tensor]:
        """seqs: (new_tokens, tokens_already_cached, block_table) -> logits [new, vocab] each."""
        ids, pos = [], []
        for new, cached, _ in seqs:
            ids += new
            pos += range(cached, cached + len(new))
        meta = make_metadata([len(n) for n, _, _ in seqs], [c + len(n) for n, c, _ in seqs],
                             [t for _, _, t in seqs], BLOCK)
        with torch.no_grad():
            logits = self.logits(torch.tensor(ids), torch.tensor(pos), meta)
        return list(logits.split([len(n) for n, _, _ in seqs]))

    def logits(self, ids: torch.Tensor, pos: torch.Tensor, meta) -> torch.Tensor:
        return self.model.compute_logits(self.model(ids, pos, meta, self.kv))


class PagedFP8(Paged):
    """Paged over an fp8 KV cache (e4m3 values + per-block scales, engine/exec/kv_cache.py)."""

    kv_dtype = FP8

"""Checkpoints' own MTP layers: GLM-4.5 (DeepSeek-V3 naming, `model.layers.{N}.{enorm, hnorm,
eh_proj, shared_head.norm}` + a MoE decoder block) and MiMo (`model.mtp_layers.0.*` + a Qwen2
block with q/k/v biases), each written beside a transformers-saved target
(tests/engine/hf_families.py).

The MTP layer's output equals a reference built from transformers' own decoder layer (layer N
of an (N + 1)-layer model of the same config) and the checkpoint's extra tensors; greedy
decoding drafting through it at k = 1 and k = 2 equals greedy decoding without it, colocated
and across an in-process prefill/decode split.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pdserve.engine.core.config import SpecConfig
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.exec.kv_cache import allocate_kv_cache
from pdserve.engine.llm import build_engine
from pdserve.engine.model.attention import make_metadata
from pdserve.engine.model.moe import MoEBlock
from pdserve.engine.model.weights import load_hf, read_hf_config
from pdserve.engine.spec.mtp_head import load_hf_mtp

from tests.engine.hf_families import BLOCK, mtp_own_weights, prompt, save_checkpoint

pytest.importorskip("transformers")

TINY = dict(device="cpu", block_size=BLOCK, num_blocks=128)
PROMPTS = [prompt(n, 50 + n) for n in (6, 13, 9)]


@pytest.fixture(scope="module", params=["glm4_moe", "mimo"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(family, folder, transformers target, transformers (N + 1)-layer donor of the block)."""
    folder = tmp_path_factory.mktemp(f"{request.param}-mtp")
    hf, donor = save_checkpoint(request.param, folder, mtp=True)
    return request.param, folder, hf, donor


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _reference_logits(hf, donor, tokens: list[int]) -> torch.Tensor:
    """MTP logits for positions 0..T-2 (token t+1, hidden t), from transformers' modules:
    lm_head(norm(block(eh_proj([enorm(embed(x[t+1])) | hnorm(h[t])]))))."""
    cfg, n = hf.config, hf.config.num_hidden_layers
    own = mtp_own_weights(cfg.hidden_size)
    ids = torch.tensor([tokens])
    with torch.no_grad():
        h = hf.model(ids[:, :-1]).last_hidden_state  # after the final norm, as vLLM feeds it
        e = hf.model.embed_tokens(ids[:, 1:])
        x = torch.cat([_rms(e, own["enorm.weight"], cfg.rms_norm_eps),
                       _rms(h, own["hnorm.weight"], cfg.rms_norm_eps)], -1) @ own["eh_proj.weight"].t()
        T = x.shape[1]
        pos = torch.arange(T)[None]
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        y = donor.model.layers[n](x, attention_mask=mask, position_ids=pos,
                                  position_embeddings=donor.model.rotary_emb(x, pos))
        y = y[0] if isinstance(y, tuple) else y
        return hf.lm_head(_rms(y, own["shared_head.norm.weight"], cfg.rms_norm_eps))[0]


def test_mtp_layer_matches_transformers_modules(checkpoint) -> None:
    family, folder, hf, donor = checkpoint
    target, cfg = load_hf(folder)
    assert cfg.num_mtp_layers == 1 and cfg.arch == family
    head = load_hf_mtp(folder, cfg, torch.float32, "cpu")
    layer = head.layers[0]
    assert isinstance(layer.block.mlp, MoEBlock) == (family == "glm4_moe")
    assert layer.block.self_attn.qkv_proj.bias is not None  # both families carry q/k/v biases
    tokens = prompt(11, 60)
    T, table = len(tokens) - 1, [6, 2, 9]
    kv = allocate_kv_cache(cfg, 12, BLOCK, torch.float32, "cpu")
    meta = make_metadata([T], [T], [table], BLOCK)
    ids, pos = torch.tensor(tokens), torch.arange(T)
    with torch.no_grad():
        hidden = target(ids[:-1], pos, meta, kv)
        out = head(target, ids[1:], hidden, pos, meta, kv)
        ours = target.compute_logits(out)
    ref = _reference_logits(hf, donor, tokens)
    assert ref.abs().max() > 1.0
    assert (ours - ref).abs().max().item() <= 1e-4
    assert kv[table[0], :, cfg.num_layers].abs().sum() > 0  # the MTP layer's own KV layer ([NB, Hkv, L, ...])


def _greedy(engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(p, params)[0] for p in prompts]
    out: dict[str, list[int]] = {r: [] for r in rids}
    for o in engine.generate_until_done():
        out[o.request_id] += o.new_token_ids
    return [out[r] for r in rids]


@pytest.mark.parametrize("k", [1, 2])
def test_greedy_with_checkpoint_mtp_equals_without(checkpoint, k: int) -> None:
    """Colocated engine, 8-token budget (chunked prefill beside verify steps)."""
    _, folder, _, _ = checkpoint
    want = _greedy(build_engine(str(folder), **TINY, max_num_batched_tokens=8), PROMPTS, 12)
    spec = build_engine(str(folder), **TINY, max_num_batched_tokens=8,
                        speculative=SpecConfig(num_speculative_tokens=k, batch_k_caps=()))
    assert spec.config.model.num_mtp_layers == 1
    assert _greedy(spec, PROMPTS, 12) == want
    assert spec.spec_stats.num_drafts > 0 and spec.spec_stats.num_draft_tokens > 0


def test_checkpoint_without_its_mtp_tensors_is_refused(tmp_path: Path) -> None:
    """A glm4_moe config.json declares one MTP layer (transformers 5 writes
    num_nextn_predict_layers=1 by default) but the tensors are missing: plain serving works,
    speculation names what is missing."""
    from pdserve.engine.model.weights import WeightsError

    save_checkpoint("glm4_moe", tmp_path)
    cfg = read_hf_config(tmp_path)
    with pytest.raises(WeightsError, match=r"incomplete MTP layers.*missing tensors.*enorm"):
        load_hf_mtp(tmp_path, replace(cfg, num_mtp_layers=1), torch.float32, "cpu")


@pytest.mark.parametrize("checkpoint", ["glm4_moe"], indirect=True)
@pytest.mark.parametrize("k", [1, 2])
def test_disaggregated_mtp_equals_colocated_greedy(checkpoint, k: int) -> None:
    """P runs the MTP layer over the prompt (its KV travels in the same blocks) and D drafts
    at k from its first step: two workers, KV over real NIXL (UCX, host memory), greedy
    equal to plain colocated."""
    _, folder, _, _ = checkpoint
    from tests.workers.test_disagg_inproc import disagg_greedy, inproc_pair

    want = _greedy(build_engine(str(folder), **TINY), PROMPTS, 10)
    with inproc_pair(str(folder), kv_transport="nixl", speculative="mtp",
                     num_speculative_tokens=k) as (P, D, ps, ds):
        got = [disagg_greedy(ps, ds, f"r{i}", p, 10) for i, p in enumerate(PROMPTS)]
        assert got == want
        assert D.engine.spec_stats.num_drafts > 0
        assert P.rt.health().num_pinned_blocks == 0

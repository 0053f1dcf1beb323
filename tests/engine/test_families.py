"""Qwen2, MiMo, Qwen3-MoE and GLM-4.5 (glm4_moe, with and without QK-norm) vs transformers'
own classes, fp32 on CPU.

Each tiny checkpoint is written by transformers' save_pretrained (tests/engine/hf_families.py)
and loaded through our HF-folder loader, then driven as the engine drives it (varlen batches,
chunked prefill, prefix-cache hits, decode steps over shuffled blocks of 4): logits within 1e-4
of transformers' full-sequence logits. The whole engine's greedy tokens equal transformers'
generate(do_sample=False). Also: the config fields each family refuses by name, the presets,
the Triton path (interpreter) and the fused-MoE seam.
"""
from __future__ import annotations

import pytest
import torch

from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.llm import LLM
from pdserve.engine.model.moe import MoEBlock
from pdserve.engine.model.presets import get_preset, mlp_param_count, param_count
from pdserve.engine.model.weights import WeightsError, config_from_hf, load_hf, random_model
from pdserve.kernels.reference import moe_experts_ref, moe_route_ref

from tests.engine.hf_families import (
    CONFIGS,
    VOCAB,
    Paged,
    assert_match,
    hf_logits,
    prompt,
    save_checkpoint,
)

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(family, transformers model, our model, checkpoint folder): the same weights."""
    folder = tmp_path_factory.mktemp(request.param)
    hf, _ = save_checkpoint(request.param, folder)
    ours, _ = load_hf(folder)
    return request.param, hf, ours, folder


def test_config_read_from_the_checkpoint(pair) -> None:
    family, hf, ours, _ = pair
    cfg = ours.config
    assert cfg.arch == family.removesuffix("_air")
    assert cfg.attention_bias == (family in ("qwen2", "mimo", "glm4_moe", "glm4_moe_air"))
    assert cfg.qk_norm == (family in ("qwen3_moe", "glm4_moe"))
    assert cfg.rotary_dim == (cfg.head_dim // 2 if family.startswith("glm") else cfg.head_dim)
    moe = cfg.moe
    if family == "qwen3_moe":
        assert (moe.scoring, moe.num_experts, moe.top_k, moe.dense_layers) == ("softmax", 16, 2, (1,))
    elif family.startswith("glm"):
        assert (moe.scoring, moe.correction_bias, moe.num_shared_experts, moe.dense_layers) == (
            "sigmoid", True, 1, (0,))
        assert (moe.n_group, moe.topk_group) == ((4, 2) if family == "glm4_moe" else (1, 1))
        bias = ours.layers[1].mlp.gate.e_score_correction_bias
        torch.testing.assert_close(bias, hf.model.layers[1].mlp.gate.e_score_correction_bias)
        assert bias.abs().min() > 0  # really non-zero
    else:
        assert moe is None
    # the parameter arithmetic agrees with what was built
    assert sum(p.numel() for p in ours.parameters()) == param_count(cfg)


def test_batched_prefill(pair) -> None:
    _, hf, ours, _ = pair
    prompts = [prompt(5, 1), prompt(11, 2), prompt(3, 3)]
    tables = [[7, 2], [12, 0, 9], [3]]  # shuffled, not contiguous
    out = Paged(ours).step([(p, 0, t) for p, t in zip(prompts, tables)])
    for p, logits in zip(prompts, out):
        assert_match(logits, hf_logits(hf, p))


def test_chunked_prefill_mixed_with_decode(pair) -> None:
    """A 13-token prompt in chunks of 5, 4, 4 while another sequence decodes beside it."""
    _, hf, ours, _ = pair
    run = Paged(ours)
    a, b = prompt(13, 4), prompt(6, 5)
    table_a, table_b = [9, 3, 14, 6], [11, 1, 20]
    got = run.step([(a[:5], 0, table_a), (b, 0, table_b)])
    assert_match(got[1], hf_logits(hf, b))
    got_a = [got[0]]
    for start, end in ((5, 9), (9, 13)):
        b.append(prompt(1, 100 + start)[0])
        out = run.step([(a[start:end], start, table_a), (b[-1:], len(b) - 1, table_b)])
        got_a.append(out[0])
        assert_match(out[1], hf_logits(hf, b)[-1:])
    assert_match(torch.cat(got_a), hf_logits(hf, a))


def test_prefix_cache_hit(pair) -> None:
    """B shares A's first two blocks: only B's suffix is computed, over A's cached KV."""
    _, hf, ours, _ = pair
    run = Paged(ours)
    a = prompt(12, 6)
    run.step([(a, 0, [5, 2, 8])])
    b = a[:8] + prompt(5, 7)
    out = run.step([(b[8:], 8, [5, 2, 10, 7])])[0]
    assert_match(out, hf_logits(hf, b)[8:])


def test_decode_steps_leave_experts_idle(pair) -> None:
    """Three sequences decode one token each: 3 tokens x top-k leave most of the 16 experts
    without a token, which the expert loop (and a fused kernel) must handle."""
    _, hf, ours, _ = pair
    run = Paged(ours)
    seqs = [prompt(3, 9), prompt(7, 10), prompt(5, 11)]
    tables = [[4, 13], [8, 1, 22, 6], [19, 2, 30]]
    run.step([(s, 0, t) for s, t in zip(seqs, tables)])
    routed: list[torch.Tensor] = []
    blocks = [m for m in ours.modules() if isinstance(m, MoEBlock)]
    hooks = [m.register_forward_hook(lambda m, args, out: routed.append(_expert_ids(m, args[0])))
             for m in blocks]
    g = torch.Generator().manual_seed(12)
    try:
        for _ in range(4):
            for s in seqs:
                s.append(int(torch.randint(0, VOCAB, (), generator=g)))
            out = run.step([(s[-1:], len(s) - 1, t) for s, t in zip(seqs, tables)])
            for s, logits in zip(seqs, out):
                assert_match(logits, hf_logits(hf, s)[-1:])
    finally:
        for h in hooks:
            h.remove()
    assert len(routed) == 4 * len(blocks)
    assert all(len(ids.unique()) < blocks[0].gate.weight.shape[0] for ids in routed)


def _expert_ids(block: MoEBlock, x: torch.Tensor) -> torch.Tensor:
    return moe_route_ref(x, block.gate.weight, block.top_k,
                         correction_bias=block.gate.e_score_correction_bias, **block.routing)[1]


def test_engine_greedy_equals_transformers_generate(pair) -> None:
    """The whole engine (8-token budget: chunked prefill beside decodes; prefix caching)
    against transformers' generate(do_sample=False)."""
    _, hf, _, folder = pair
    llm = LLM(str(folder), device="cpu", dtype="float32", block_size=4, num_blocks=96,
              max_num_seqs=4, max_num_batched_tokens=8, max_model_len=128)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    a = prompt(13, 21)
    prompts = [a, prompt(3, 22), prompt(9, 23)]
    got = [r.outputs[0].token_ids for r in llm.generate(prompts, greedy)]
    [again] = llm.generate([a[:8] + prompt(6, 24)], greedy)  # shares A's first two blocks
    assert again.num_cached_tokens >= 8
    for p, toks in zip(prompts + [again.prompt_token_ids], got + [again.outputs[0].token_ids]):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False,
                              pad_token_id=0)[0, len(p):].tolist()
        assert toks == ref


# -- config fields a family refuses, by name -----------------------------------------------------

@pytest.mark.parametrize("family, change, field", [
    ("qwen2", {"use_sliding_window": True}, "use_sliding_window"),
    ("qwen2", {"hidden_act": "gelu"}, "hidden_act"),
    ("mimo", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
     "rope_type"),
    ("mimo", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ("qwen3_moe", {"attention_bias": True}, "attention_bias"),
    ("qwen3_moe", {"num_experts_per_tok": 17}, "num_experts_per_tok"),
    ("glm4_moe", {"scoring_func": "softmax"}, "scoring_func"),
    ("glm4_moe", {"n_group": 3}, "n_group"),
    ("glm4_moe", {"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
])
def test_unsupported_fields_are_refused_by_name(family: str, change: dict, field: str) -> None:
    d = CONFIGS[family]().to_dict()
    if family == "mimo":
        d["model_type"] = "mimo"
    config_from_hf(d, "config.json")  # as transformers writes it: accepted
    with pytest.raises(WeightsError, match=rf"config.json: {field}\b"):
        config_from_hf({**d, **change}, "config.json")


# -- presets -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,total,active", [
    ("qwen2.5-7b", 7_615_616_512, 7_615_616_512),
    ("mimo-7b", 7_622_619_136, 7_622_619_136),  # + its MTP layer: MiMo-7B's 7.8B
    ("qwen3-30b-a3b", 30_532_122_624, 3_353_032_704),  # published 30.5B, 3.3B active
    ("qwen3-235b-a22b", 235_093_634_560, 22_190_763_520),  # 235B, 22B active
    ("glm-4.5-air", 106_852_251_264, 13_424_129_664),  # 106B, 12B active w/o embeddings
    ("glm-4.5", 352_797_829_024, 33_632_266_144),  # 355B with the MTP layer, 32B active
])
def test_big_moe_preset_param_counts(name: str, total: int, active: int) -> None:
    cfg = get_preset(name)
    idle = sum(mlp_param_count(cfg, i) - mlp_param_count(cfg, i, active=True)
               for i in range(cfg.num_layers))
    assert (param_count(cfg), param_count(cfg) - idle) == (total, active)


def test_moe_preset_builds_on_meta_with_float32_routers() -> None:
    model = random_model(get_preset("glm-4.5-air"), torch.bfloat16, "meta")
    assert sum(p.numel() for p in model.parameters()) == param_count(get_preset("glm-4.5-air"))
    block = model.layers[1].mlp
    assert block.experts.w13.shape == (128, 2 * 1408, 4096) and block.experts.w2.dtype == torch.bfloat16
    assert block.gate.weight.dtype == block.gate.e_score_correction_bias.dtype == torch.float32
    assert not isinstance(model.layers[0].mlp, MoEBlock)  # first_k_dense_replace = 1


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-mimo", "tiny-qwen3-moe", "tiny-glm4-moe"])
def test_tiny_presets_generate(name: str) -> None:
    cfg = get_preset(name)
    assert sum(p.numel() for p in random_model(cfg, seed=3).parameters()) == param_count(cfg)
    [res] = LLM(name, device="cpu", block_size=4, num_blocks=64).generate(
        [list(range(1, 20))], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(res.outputs[0].token_ids) == 4


# -- the Triton path (interpreter on CPU) and the fused-MoE seam --------------------------------

@pytest.mark.parametrize("preset, spec", [("tiny-qwen2", None), ("tiny-glm4-moe", 2)])
def test_triton_path_greedy_equal(preset: str, spec: int | None) -> None:
    """use_triton: q/k/v biases ride after the qkv GEMV, no-QK-norm Qwen2 takes the fused
    prologue, GLM's partial rotary keeps the torch RoPE before the Triton KV write and
    attention, MoE layers take their own norm + experts after the GEMV attention; GLM also
    drafts through its (random, MoE) MTP layer at k = 2 on that path."""
    kw = dict(device="cpu", dtype="float32", block_size=4, num_blocks=64, max_num_seqs=4,
              max_num_batched_tokens=12, max_model_len=128)
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    prompts = [prompt(n, 40 + n) for n in (3, 14)]
    want = [r.outputs[0].token_ids for r in LLM(preset, **kw).generate(prompts, greedy)]
    if spec is not None:
        kw.update(speculative="mtp", num_speculative_tokens=spec)
    fast = LLM(preset, use_triton=True, **kw)
    assert fast.engine.runner.model.backend.name == "triton"
    got = [r.outputs[0].token_ids for r in fast.generate(prompts, greedy)]
    assert got == want
    assert spec is None or fast.engine.spec_stats.num_drafts > 0


def test_fused_moe_seam(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the fused path on, a MoE block calls kernels.ops.fused_moe (once kernels/ has it)
    with the model's routing arguments; the torch references stand in for it here."""
    from pdserve.kernels import ops

    calls: list[dict] = []

    def fake(x, router_weight, w13, w2, top_k, **routing):
        calls.append({"top_k": top_k, **routing})
        weights, ids = moe_route_ref(x, router_weight, top_k, **routing)
        return moe_experts_ref(x, w13, w2, weights, ids)

    model = random_model(get_preset("tiny-glm4-moe"), seed=1)
    block = model.layers[1].mlp
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    want = block(x)
    monkeypatch.setattr(ops, "fused_moe", fake, raising=False)
    block.fused = True
    torch.testing.assert_close(block(x), want)
    assert calls == [{"top_k": 4, "correction_bias": block.gate.e_score_correction_bias,
                      "scoring": "sigmoid", "n_group": 4, "topk_group": 2, "renormalize": True,
                      "routed_scaling": 2.5}]

"""FP8 weights (engine/model/fp8.py), fp32 on CPU.

Tiny Qwen3 / Qwen3-MoE checkpoints (transformers' classes; hidden 160 and intermediate 200,
not multiples of 128, so blocks are partial) are quantized here, independently of pdserve,
block by block (scale = amax / 448, stored as weight_scale_inv) or per channel / per tensor
(compressed-tensors weight_scale), and written in the HF layout. pdserve loads them as FP8 and
must compute the function the checkpoint represents: transformers' model with the dequantized
float32 weights, logits within 1e-4 absolute (logits are O(1..10): ~1e-5 relative; both sides
compute the same float32 products, only summation order differs). In the dense Qwen3 the
q/k/v sources start on 128-row block boundaries (head_dim 64: q 256 rows, k/v 128) and their
grids concatenate, while gate/up (200 rows each) do not and keep per-row scales.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pdserve.engine.core.config import ConfigError
from pdserve.engine.core.engine_args import EngineArgs
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.llm import LLM
from pdserve.engine.model.fp8 import (
    FP8_DTYPE,
    Fp8Linear,
    dequantize,
    fp8_linear,
    quantize_blockwise,
    quantize_sources,
)
from pdserve.engine.model.loader import load_model
from pdserve.engine.model.weights import WeightsError, load_hf

from tests.engine.hf_families import VOCAB, Paged, assert_match, hf_logits, prompt

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
_SHAPE = dict(vocab_size=VOCAB, hidden_size=160, intermediate_size=200, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6,
              max_position_embeddings=512, tie_word_embeddings=False, rope_parameters=_ROPE)


def tiny(family: str, seed: int = 0, **shape: object):
    """A transformers Qwen3 (or Qwen3-MoE: layer 1 dense, 4 experts of 72, top 2) with O(1)
    random weights, as tests/engine/hf_families.py tiny_hf makes them; `shape`: config
    fields that replace this file's."""
    torch.manual_seed(seed)
    fields = {**_SHAPE, **shape}
    if family == "qwen3":
        cfg = transformers.Qwen3Config(**fields)
    else:
        cfg = transformers.Qwen3MoeConfig(**fields, moe_intermediate_size=72, num_experts=4,
                                          num_experts_per_tok=2, norm_topk_prob=True,
                                          mlp_only_layers=[1])
    cfg._attn_implementation = "eager"
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name
                    else torch.randn_like(p) / p.shape[-1] ** 0.5)
    return hf


# -- the checkpoint writer: quantization done here, by loops over blocks --------------------------

def quantize_ref(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], scales [ceil(N/bn), ceil(K/bk)]): scale = amax / 448."""
    n, k = w.shape
    w8 = torch.empty(n, k, dtype=FP8_DTYPE)
    scales = torch.empty(-(-n // bn), -(-k // bk))
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            tile = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            scales[i, j] = tile.abs().max() / 448.0
            w8[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (tile / scales[i, j]).to(FP8_DTYPE)
    return w8, scales


def dequantize_ref(w8: torch.Tensor, scales: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    w = w8.float()
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] *= scales[i, j].float()
    return w


def _per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's stacked experts -> the per-expert names real checkpoints use."""
    out = {}
    for key, t in state.items():
        if key.endswith("experts.gate_up_proj"):
            base, i = key.removesuffix("gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :i]
                out[f"{base}{e}.up_proj.weight"] = t[e, i:]
        elif key.endswith("experts.down_proj"):
            base = key.removesuffix("down_proj")
            out.update({f"{base}{e}.down_proj.weight": t[e] for e in range(t.shape[0])})
        else:
            out[key] = t
    return out


def _restack(state: dict[str, torch.Tensor], hf) -> dict[str, torch.Tensor]:
    """The inverse of _per_expert, into hf's own state-dict keys."""
    out = dict(state)
    for key in hf.state_dict():
        for leaf, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
            if key.endswith("experts." + leaf):
                base, e = key.removesuffix(leaf), 0
                stack = []
                while f"{base}{e}.{parts[0]}.weight" in out:
                    stack.append(torch.cat([out.pop(f"{base}{e}.{p}.weight") for p in parts]))
                    e += 1
                out[key] = torch.stack(stack)
    return out


def write_fp8(hf, folder: Path, strategy: str, ignore: tuple[str, ...] = (),
              scale_dtype: torch.dtype = torch.float32, listed: tuple[str, ...] = ()) -> None:
    """Save hf as an FP8 checkpoint (strategy "block": 128x128 weight_scale_inv; "channel" /
    "tensor": compressed-tensors weight_scale), skipping modules named in `ignore`; `listed`:
    more names in the config's list that are not linears (norms, routers); then put
    the dequantized weights into hf, so that hf is exactly the function the file represents."""
    hf.save_pretrained(folder)
    tensors, dequantized = {}, {}
    for key, w in _per_expert(hf.state_dict()).items():
        module = key.removesuffix(".weight")
        if ".layers." not in key or not key.endswith("proj.weight") or \
                any(s in module for s in ignore):
            tensors[key] = dequantized[key] = w
            continue
        bn, bk = {"block": (128, 128), "channel": (1, w.shape[1]), "tensor": w.shape}[strategy]
        w8, scales = quantize_ref(w.float(), bn, bk)
        scales = scales.to(scale_dtype)
        tensors[key] = w8
        name = "weight_scale_inv" if strategy == "block" else "weight_scale"
        tensors[f"{module}.{name}"] = scales.reshape(1) if strategy == "tensor" else scales
        dequantized[key] = dequantize_ref(w8, scales, bn, bk)
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors",
              metadata={"format": "pt"})
    hf.load_state_dict(_restack(dequantized, hf))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = _quant_config(strategy, [*ignore, *listed])
    (folder / "config.json").write_text(json.dumps(config))


def _quant_config(strategy: str, ignore: list[str]) -> dict:
    if strategy == "block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head", *ignore]}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "ignore": ["lm_head", *(f"re:.*{s}" for s in ignore)],
            "config_groups": {"group_0": {
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy,
                            "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                      "dynamic": True},
                "targets": ["Linear"]}}}


def compare(hf, ours) -> None:
    """Batched prefill, then a decode step over shuffled blocks: logits within 1e-4."""
    prompts, tables = [prompt(5, 1), prompt(11, 2)], [[7, 2], [12, 0, 9]]
    run = Paged(ours)
    for p, logits in zip(prompts, run.step([(p, 0, t) for p, t in zip(prompts, tables)])):
        assert_match(logits, hf_logits(hf, p))
    nxt = [3, 17]
    out = run.step([([n], len(p), t) for n, p, t in zip(nxt, prompts, tables)])
    for n, p, logits in zip(nxt, prompts, out):
        assert_match(logits[0], hf_logits(hf, p + [n])[-1])


# -- checkpoints ---------------------------------------------------------------------------------

@pytest.mark.parametrize("family, scale_dtype", [
    ("qwen3", torch.float32), ("qwen3", torch.bfloat16), ("qwen3_moe", torch.float32)])
def test_block_fp8_checkpoint_is_the_dequantized_model(family: str, scale_dtype: torch.dtype,
                                                       tmp_path: Path) -> None:
    hf = tiny(family)
    # like Qwen3-30B-A3B-FP8's modules_to_not_convert: norms and routers are listed too, and
    # "model.layers.1.mlp.gate" must not catch layer 1's (dense) gate_proj
    listed = ("model.layers.1.mlp.gate", "model.layers.0.mlp.gate", "model.norm",
              "model.layers.0.input_layernorm")
    write_fp8(hf, tmp_path, "block", ignore=("layers.1.self_attn.o_proj",),
              scale_dtype=scale_dtype, listed=listed)
    ours, _ = load_hf(tmp_path)
    attn0, attn1 = ours.layers[0].self_attn, ours.layers[1].self_attn
    assert attn0.qkv_proj.block == (128, 128)  # q/k/v rows start at 0, 256, 384: aligned
    assert attn0.qkv_proj.weight.dtype == FP8_DTYPE and attn0.qkv_proj.weight_scale.shape == (4, 2)
    assert type(attn1.o_proj) is torch.nn.Linear  # modules_to_not_convert is honoured
    assert type(ours.lm_head) is torch.nn.Linear and ours.embed_tokens.weight.dtype == torch.float32
    dense = ours.layers[1].mlp
    assert dense.gate_up_proj.block == (1, 128)  # up starts at row 200: per-row scales
    if family == "qwen3_moe":
        experts = ours.layers[0].mlp.experts
        assert experts.w13.dtype == FP8_DTYPE and experts.w13_scale.shape == (4, 144, 2)
        assert experts.w2_scale.shape == (4, 2, 1) and experts.blocks[1] == (128, 128)
        assert ours.layers[0].mlp.gate.weight.dtype == torch.float32  # the router stays float
    compare(hf, ours)


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_compressed_tensors_checkpoint_is_the_dequantized_model(strategy: str,
                                                                tmp_path: Path) -> None:
    hf = tiny("qwen3")
    write_fp8(hf, tmp_path, strategy, ignore=("layers.1.mlp.down_proj",))
    ours, _ = load_hf(tmp_path)
    qkv = ours.layers[0].self_attn.qkv_proj
    # per tensor, q/k/v's three scales become per-row ones; o_proj keeps its one scale
    assert qkv.block == (1, 160) and qkv.weight_scale.shape == (512, 1)
    o = ours.layers[0].self_attn.o_proj
    assert o.weight_scale.shape == ((1, 1) if strategy == "tensor" else (160, 1))
    assert type(ours.layers[1].mlp.down_proj) is torch.nn.Linear
    compare(hf, ours)


# -- --quantization fp8 --------------------------------------------------------------------------

def test_seam_and_quantizer_round_trip() -> None:
    """fp8_linear = x @ dequantized W; quantize_blockwise's dequantized weight within e4m3's
    half step (2^-4 relative to the block's largest value, times 448/256 for the scale)."""
    w = torch.randn(200, 160)
    w8, s = quantize_blockwise(w, (128, 128))
    assert w8.dtype == FP8_DTYPE and s.shape == (2, 2)
    back = dequantize(w8, s, (128, 128))
    torch.testing.assert_close(back, dequantize_ref(w8, s, 128, 128))
    assert ((back - w).abs() <= w.abs().max() * 2 ** -4 + 1e-6).all()
    x = torch.randn(3, 160)
    torch.testing.assert_close(fp8_linear(x, w8, s, (128, 128)), x @ back.T)


def test_merged_sources_are_quantized_on_their_own_grids() -> None:
    """q rows 1e5 times larger than k's: quantized as one matrix, the 128-row block over
    q's last and k's first rows takes q's amax and k's rows there lose all precision; per
    source (quantize_sources), every k row stays within half an e4m3 step of k's own amax.
    Sources on block boundaries keep the block."""
    gen = torch.Generator().manual_seed(0)
    q, k = 1e3 * torch.randn(100, 160, generator=gen), 1e-2 * torch.randn(60, 160, generator=gen)
    w = torch.cat([q, k])
    w8, s, block = quantize_sources(w, [0, 100], (128, 128))
    assert block == (1, 128) and s.shape == (160, 2)
    back = dequantize(w8, s, block)
    assert ((back[100:] - k).abs() <= k.abs().max() * 2 ** -4 + 1e-9).all()
    mixed = dequantize(*quantize_blockwise(w, (128, 128)), (128, 128))
    assert not ((mixed[100:] - k).abs() <= k.abs().max() * 2 ** -4 + 1e-9).all()
    aligned = quantize_sources(torch.cat([q[:64], k]), [0, 64], (64, 128))
    assert aligned[2] == (64, 128) and aligned[1].shape == (2, 2)


def _relative_error(folder: Path, seeds: range) -> list[float]:
    """||fp8 logits - float logits|| / ||float logits|| over 12-token prompts."""
    ref, _, _ = load_model(str(folder))
    q, _, _ = load_model(str(folder), quantization="fp8")
    assert isinstance(q.layers[0].self_attn.qkv_proj, Fp8Linear)
    assert type(q.lm_head) is torch.nn.Linear
    out = []
    for seed in seeds:
        p = prompt(12, seed)
        [a], [b] = Paged(ref).step([(p, 0, [0, 1, 2])]), Paged(q).step([(p, 0, [0, 1, 2])])
        out.append(((a - b).norm() / a.norm()).item())
    return out


def test_quantize_at_load_stays_close(tmp_path: Path) -> None:
    """A float checkpoint with quantization="fp8": every decoder linear FP8 (the head not).
    Each weight is rounded by at most half an e4m3 step, 2^-4 relative, so each quantized
    matmul's output is off by <= 2^-4 of its size; eight of them lie in series in these two
    layers and their errors add roughly independently: logits within sqrt(8) * 2^-4 = 0.18
    relative (L2 over a prompt; measured 0.08-0.09). These O(1) random models amplify
    perturbations more than trained ones do. Greedy tokens: mostly the same (measured below)."""
    hf = tiny("qwen3")
    hf.save_pretrained(tmp_path)
    errors = _relative_error(tmp_path, range(5, 8))
    assert max(errors) <= 8 ** 0.5 * 2 ** -4, errors
    kw = dict(device="cpu", dtype="float32", block_size=4, num_blocks=96, max_model_len=128)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [prompt(9, 30 + i) for i in range(4)]
    toks = [[r.outputs[0].token_ids for r in LLM(str(tmp_path), quantization=qn, **kw)
             .generate(prompts, greedy)] for qn in (None, "fp8")]
    # free-running: once one token differs the contexts differ, so count the equal prefix;
    # teacher-forced: the FP8 model's argmax along the float model's own greedy sequences
    prefix = [next((i for i, (x, y) in enumerate(zip(f, g)) if x != y), 8) for f, g in zip(*toks)]
    q, _, _ = load_model(str(tmp_path), quantization="fp8")
    hits = 0
    for p, f in zip(prompts, toks[0]):
        [logits] = Paged(q).step([(p + f[:-1], 0, list(range(5)))])
        hits += (logits[len(p) - 1:].argmax(-1) == torch.tensor(f)).sum().item()
    forced = hits / (8 * len(prompts))
    print(f"FP8 vs float greedy: equal prefixes {prefix} of 8, teacher-forced {forced:.2f}")
    assert forced >= 0.75 and sum(prefix) >= 8


def test_quantize_at_load_of_moe_experts(tmp_path: Path) -> None:
    """Qwen3-MoE: the stacked experts quantized per expert; routing may flip where two experts
    score within the error, so the bound is looser: 0.35 (measured 0.09-0.21)."""
    tiny("qwen3_moe").save_pretrained(tmp_path)
    q, _, _ = load_model(str(tmp_path), quantization="fp8")
    assert q.layers[0].mlp.experts.w13.dtype == FP8_DTYPE
    # gate/up each on its own grid; up starts at row 72, inside a block: per-row scales
    assert q.layers[0].mlp.experts.blocks == ((1, 128), (128, 128))
    assert q.layers[0].mlp.experts.w13_scale.shape == (4, 144, 2)  # [E, 2I, ceil(160/128)]
    assert max(_relative_error(tmp_path, range(5, 8))) <= 0.35


def test_quantize_at_load_of_a_preset() -> None:
    model, cfg, _ = load_model("tiny-qwen3", quantization="fp8")
    assert isinstance(model.layers[0].mlp.down_proj, Fp8Linear)
    with pytest.raises(ConfigError, match="quantization"):
        EngineArgs(quantization="int4")


# -- refusals ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("fp8")
    write_fp8(tiny("qwen3"), folder, "block")
    return folder


def _damaged(src: Path, dst: Path, tensors: dict | None = None, config: dict | None = None) -> Path:
    dst.mkdir()
    state = load_file(src / "model.safetensors")
    for k, v in (tensors or {}).items():
        if v is None:
            del state[k]
        else:
            state[k] = v
    save_file(state, dst / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"].update(config or {})
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


_SCALE = "model.layers.0.self_attn.k_proj.weight_scale_inv"


@pytest.mark.parametrize("tensors, config, match", [
    ({_SCALE: None}, None, r"missing tensors .*qkv_proj\.weight_scale\[1\].*weight_scale_inv"),
    ({_SCALE: torch.ones(2, 2)}, None, rf"'{_SCALE[6:]}' has shape \(2, 2\), expected \(1, 2\)"),
    ({_SCALE: torch.tensor([[1.0, float("nan")]])}, None, f"'{_SCALE[6:]}' has non-finite"),
    ({"model.layers.0.mlp.down_proj.weight": torch.zeros(160, 200)}, None,
     r"down_proj\.weight' is torch\.float32, expected torch\.float8_e4m3fn"),
    (None, {"quant_method": "awq"}, r"quantization_config\.quant_method: 'awq'"),
    (None, {"fmt": "e5m2"}, r"quantization_config\.fmt: 'e5m2'"),
    (None, {"weight_block_size": [128]}, r"quantization_config\.weight_block_size"),
    (None, {"modules_to_not_convert": ["layers.0.self_attn.k_proj"]},
     r"quantization_config: ignores some but not all"),
])
def test_malformed_checkpoints_are_refused_by_name(fp8_folder: Path, tmp_path: Path,
                                                   tensors: dict | None, config: dict | None,
                                                   match: str) -> None:
    folder = _damaged(fp8_folder, tmp_path / "bad", tensors, config)
    with pytest.raises(WeightsError, match=match):
        load_hf(folder)


def test_compressed_tensors_fields_are_refused_by_name(tmp_path: Path) -> None:
    hf = tiny("qwen3")
    write_fp8(hf, tmp_path, "channel")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "group"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightsError, match=r"config_groups\.group_0\.weights\.strategy: 'group'"):
        load_hf(tmp_path)

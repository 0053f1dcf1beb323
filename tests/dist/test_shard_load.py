"""A tensor-parallel rank loads only its shard (engine/model/shard_load.py): each rank's
directly loaded Model is bitwise shard_model(the full model)'s for that rank, for tiny
transformers checkpoints (Qwen3, Llama with 1 KV head, Qwen3-MoE, GLM-4.5-MoE with its MTP
layer), a block-FP8 checkpoint (aligned and per-row scale pieces), SmolLM2-135M's GGUF at TP 3
and random presets (FP8 ones too); and the full model is never allocated: the bytes that torch
ops hold at once while a rank loads stay within its shard plus one full tensor."""
from __future__ import annotations

import json
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from pdserve.engine.core.config import ConfigError
from pdserve.engine.dist.shard import fp8_split_problem, shard_model, shard_mtp_head
from pdserve.engine.model.fp8 import quantize_blockwise
from pdserve.engine.model.fp8_convert import scale_blocks
from pdserve.engine.model.gguf_weights import load_gguf, open_gguf
from pdserve.engine.model.loader import (
    embedded_gguf_path,
    load_model,
    load_tokenizer_and_config,
    resolve_model,
)
from pdserve.engine.model.presets import get_preset
from pdserve.engine.model.shard_load import load_hf_mtp_shard, rank_shard, resolve_mtp_shard
from pdserve.engine.model.weights import WeightsError, empty_model, read_hf_config
from pdserve.engine.spec.mtp_head import load_hf_mtp, random_head

from tests.dist.tp_models import save_tiny

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _block(block: tuple[int, int], weight: torch.Tensor) -> tuple[int, int]:
    """A scale block as far as it matters: a side covering the whole weight is that side
    (per-channel (1, K) and (1, K / tp) are the same layout of a K / tp-column shard)."""
    return min(block[0], weight.shape[-2]), min(block[1], weight.shape[-1])


def assert_same(mine: torch.nn.Module, ref: torch.nn.Module) -> None:
    """Same config, parameter names, dtypes, shapes and bytes; same FP8 blocks, ties and KV
    scales."""
    assert mine.config == ref.config
    a, b = mine.state_dict(), ref.state_dict()
    assert list(a) == list(b)
    for name in a:
        assert (a[name].dtype, a[name].shape) == (b[name].dtype, b[name].shape), name
        assert torch.equal(_bytes(a[name]), _bytes(b[name])), name
    blocks = [{k: _block(v, m.get_parameter(k.removesuffix("_scale")))
               for k, v in scale_blocks(m).items()} for m in (mine, ref)]
    assert blocks[0] == blocks[1]
    if hasattr(ref, "lm_head") and ref.config.tie_word_embeddings:
        assert mine.lm_head.weight is mine.embed_tokens.weight
    for x, y in zip(getattr(mine, "layers", []), getattr(ref, "layers", [])):
        if hasattr(y, "self_attn"):
            assert x.self_attn.kv_static_scales == y.self_attn.kv_static_scales


def _each_rank(model: str | Path | None, tp: int, **kw: object) -> None:
    full, cfg, _ = load_model(None if model is None else str(model), **kw)
    for r in range(tp):
        mine, mine_cfg, _ = load_model(None if model is None else str(model), tp=tp, rank=r, **kw)
        assert mine_cfg == cfg  # the FULL config: the compat hash is the same at every TP
        assert_same(mine, shard_model(full, tp, r))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("shard_load")
    from tests.engine.hf_families import save_checkpoint

    out = {f: save_tiny(f, root / f) for f in ("qwen3", "llama_1kv", "qwen3_moe")}
    save_checkpoint("glm4_moe", root / "glm4_moe", mtp=True)
    out["glm4_moe"] = root / "glm4_moe"
    return out


@pytest.mark.parametrize("family", ["qwen3", "llama_1kv", "qwen3_moe", "glm4_moe"])
def test_checkpoint_shard_is_shard_model_of_the_full_model(tiny: dict[str, Path],
                                                          family: str) -> None:
    _each_rank(tiny[family], 2)


def test_glm4_moe_mtp_layer_shard(tiny: dict[str, Path]) -> None:
    """The checkpoint's MTP layer (a MoE decoder block, enorm / hnorm / eh_proj / norm) cut as
    it streams equals shard_mtp_head of the whole head; resolve_mtp_shard gives TP 1's id."""
    folder = tiny["glm4_moe"]
    cfg = read_hf_config(folder)
    assert cfg.num_mtp_layers == 1
    full = load_hf_mtp(folder, cfg, torch.float32, "cpu")
    source = resolve_model(str(folder))
    for r in range(2):
        assert_same(load_hf_mtp_shard(folder, cfg, 2, r, torch.float32, "cpu"),
                    shard_mtp_head(full, cfg, 2, r))
        head, head_cfg, head_id = resolve_mtp_shard(source, cfg, 2, r, torch.float32, "cpu")
        assert (head_cfg, head_id) == (cfg, f"hf:{source.name}:1")


def _write_fp8(src: Path, dst: Path, block: tuple[int, int]) -> Path:
    """The checkpoint in `src` as a block-FP8 one (weight_scale_inv per block) in `dst`,
    with static KV-cache scales (k_scale / v_scale) per layer."""
    dst.mkdir()
    tensors = {}
    for name, w in load_file(src / "model.safetensors").items():
        if ".layers." in name and name.endswith("proj.weight"):
            tensors[name], scales = quantize_blockwise(w.float(), block)
            tensors[name.removesuffix("weight") + "weight_scale_inv"] = scales
        else:
            tensors[name] = w
        if name.endswith("self_attn.q_proj.weight"):
            attn = name.removesuffix("q_proj.weight")
            tensors[attn + "k_scale"], tensors[attn + "v_scale"] = (torch.tensor(0.25),
                                                                     torch.tensor(0.5))
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_block_fp8_checkpoint_shard(tiny: dict[str, Path], tmp_path: Path, family: str) -> None:
    """Blocks (32, 16): q (32 rows per rank) keeps whole blocks, k / v (16 rows), gate / up
    (48 rows) and the experts' gate / up (16 rows) get per-row scales; o_proj, down_proj and
    the experts' w2 split their columns on 16-column blocks."""
    folder = _write_fp8(tiny[family], tmp_path / "fp8", (32, 16))
    _each_rank(folder, 2)
    assert load_model(str(folder), tp=2, rank=1)[0].layers[1].self_attn.kv_static_scales == \
        (0.25, 0.5)


def test_quantize_at_load_of_a_shard_equals_the_quantized_full_model(tmp_path: Path) -> None:
    """--quantization fp8 with TP quantizes the rank's shard: the same as quantizing the full
    model and sharding it where the rank's rows and columns fall on the 128x128 blocks (head
    dim 128, intermediate 256 at TP 2: each rank's part is one block wide)."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=101, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, head_dim=128, tie_word_embeddings=False)
    folder = tmp_path / "q"
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    _each_rank(folder, 2, quantization="fp8")


def test_fp8_column_split_inside_a_block_is_refused_naming_the_scale(
        tiny: dict[str, Path], tmp_path: Path) -> None:
    """Before any tensor is read (checked on the full model's meta-device shapes)."""
    folder = _write_fp8(tiny["qwen3"], tmp_path / "fp8", (16, 32))  # down_proj: 48 columns
    with pytest.raises(ConfigError, match=r"^layers\.0\.mlp\.down_proj\.weight_scale: "
                                          r"columns \[48, 96\)"):
        load_model(str(folder), tp=2, rank=1)


def test_serve_refuses_an_fp8_split_inside_a_block_before_any_worker(
        tiny: dict[str, Path], tmp_path: Path) -> None:
    """`pdserve serve` finds that refusal from the shapes alone (fp8_split_problem) and exits
    2 naming the flag and the scale before Ray starts, instead of launching workers that fail
    at load and get relaunched. Real shapes: GLM-4.5-Air's dense down_proj (10944 columns) and
    Qwen3-30B-A3B's experts at TP 4 (768 / 4 = 192) cut 128-column blocks; Qwen3-8B does not."""
    folder = _write_fp8(tiny["qwen3"], tmp_path / "fp8", (16, 32))  # down_proj: 48 columns
    cfg = read_hf_config(folder)
    assert fp8_split_problem(cfg, 2, (16, 32)).startswith(
        "down_proj.weight_scale: columns [0, 48)")
    assert fp8_split_problem(cfg, 2, (16, 16)) is None  # 48 columns = 3 whole blocks
    assert "down_proj.weight_scale" in fp8_split_problem(get_preset("glm-4.5-air"), 2, (128, 128))
    assert "experts.w2_scale" in fp8_split_problem(get_preset("qwen3-30b-a3b"), 4, (128, 128))
    assert fp8_split_problem(get_preset("qwen3-30b-a3b"), 2, (128, 128)) is None
    assert fp8_split_problem(get_preset("qwen3-8b"), 8, (128, 128)) is None
    r = subprocess.run([sys.executable, "-m", "pdserve.router.cli", "serve", "--model",
                        str(folder), "--port", "0", "--grpc-port", "0", "--decode-tp", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "--decode-tp 2: down_proj.weight_scale: columns [0, 48)" in r.stderr


def test_a_misshapen_tensor_is_refused_with_its_full_shape(tiny: dict[str, Path],
                                                           tmp_path: Path) -> None:
    folder = tmp_path / "bad"
    folder.mkdir()
    tensors = load_file(tiny["qwen3"] / "model.safetensors")
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text((tiny["qwen3"] / "config.json").read_text())
    with pytest.raises(WeightsError, match=r"'layers\.1\.self_attn\.k_proj\.weight' has "
                                           r"shape \(16, 64\), expected \(32, 64\)"):
        load_model(str(folder), tp=2, rank=0)


def test_smollm2_gguf_shards_at_tp3() -> None:
    """The embedded SmolLM2-135M GGUF (9 heads, 3 KV heads, tied embeddings, vocabulary
    49152): llama.cpp's q/k row order undone on the full tensor, then cut."""
    reader = open_gguf(embedded_gguf_path())  # parsed once, read by every load below
    full, cfg = load_gguf(reader)
    for r in range(3):
        mine, mine_cfg = load_gguf(reader, shard=rank_shard(3, r, torch.float32))
        assert mine_cfg == cfg
        assert_same(mine, shard_model(full, 3, r))
    with pytest.raises(ConfigError, match="^num_heads: 9 attention heads"):
        load_gguf(reader, shard=rank_shard(2, 0, torch.float32))


@pytest.mark.parametrize("preset,quantization", [
    ("tiny-llama", None), ("tiny-qwen3-moe", None), ("tiny-glm4-moe", None),
    ("tiny-qwen3-moe", "fp8")])
def test_random_preset_shard(preset: str, quantization: str | None) -> None:
    _each_rank(preset, 2, seed=5, quantization=quantization)


def test_random_preset_mtp_head_shard() -> None:
    source = resolve_model("tiny-glm4-moe")
    cfg = load_tokenizer_and_config(source)[1]
    full = random_head(cfg, torch.float32, "cpu", seed=5)
    for r in range(2):
        head, head_cfg, head_id = resolve_mtp_shard(source, cfg, 2, r, torch.float32, "cpu",
                                                    seed=5)
        assert (head_cfg, head_id) == (cfg, "random:5")
        assert_same(head, shard_mtp_head(full, cfg, 2, r))


# -- the full model is never allocated --------------------------------------------------------

class LiveBytes(TorchDispatchMode):
    """The most bytes of CPU storages that torch ops produced while active and that were
    alive at the same time (a storage counts once, from its first op to its last view)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self._track(t.untyped_storage())
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = storage.data_ptr()
        if key in self.live or storage.nbytes() == 0:
            return
        self.live[key] = storage.nbytes()
        self.now += storage.nbytes()
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)


def _param_bytes(m: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in m.parameters())


def _save_moe(folder: Path, layers: int) -> Path:
    """A Qwen3-MoE checkpoint of `layers` layers (16 experts each): many tensors, none big."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
        num_experts=16, num_experts_per_tok=2, tie_word_embeddings=False)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("model", ["checkpoint", "tiny-qwen3-moe:12l"])
def test_a_rank_never_holds_the_full_model(tmp_path: Path, model: str) -> None:
    """At TP 2 the live bytes peak within the rank's shard plus two full tensors (the one
    being cut and its part), well below the full model, which loading it whole does reach."""
    path = str(_save_moe(tmp_path / "moe", 12)) if model == "checkpoint" else model
    cfg = load_tokenizer_and_config(path)[1]
    meta_full = empty_model(cfg, torch.float32, "meta")
    full_bytes = _param_bytes(meta_full)
    largest = max(p.numel() * p.element_size() for p in meta_full.parameters())
    with LiveBytes() as direct:
        shard = load_model(path, tp=2, rank=1)[0]
    shard_bytes = _param_bytes(shard)
    assert shard_bytes < 0.6 * full_bytes
    assert direct.peak <= shard_bytes + 2 * largest < full_bytes, (direct.peak, full_bytes)
    with LiveBytes() as whole:  # the measure sees a full model when there is one
        shard_model(load_model(path)[0], 2, 1)
    assert whole.peak >= full_bytes


def test_a_shard_of_a_large_preset_is_built_on_meta_without_the_full_model() -> None:
    """Qwen3-235B-A22B at TP 8 on the meta device: the rank's shapes (8 heads, 1 KV head, a
    192-row expert intermediate, 18992 vocabulary rows), no tensor of the full size."""
    net = load_model("qwen3-235b-a22b:2l", device="meta", tp=8, rank=3)[0]
    c = net.config
    assert (c.num_heads, c.num_kv_heads, c.moe.intermediate_size, c.vocab_size) == \
        (8, 1, 192, 18992)
    assert net.layers[0].mlp.experts.w13.shape == (128, 384, 4096)
    assert all(p.is_meta for p in net.parameters())


# -- a directly loaded shard runs in a real group -----------------------------------------------

def _step(net: torch.nn.Module, kv: torch.Tensor):
    def step(b, rows):  # noqa: ANN001 - tp_harness's greedy step
        ids, pos, meta = b.to_device(torch.device("cpu"))
        return net.compute_logits(net(ids, pos, meta, kv)[torch.tensor(rows)])
    return step


def direct_rank(group, model: str, quantization: str | None) -> dict:  # noqa: ANN001
    """Spawned rank: load the shard directly, bind it to the group (bind_context, as
    load_rank does), greedy 3 prompts x 6 tokens."""
    from pdserve.engine.dist.parallel import TPContext
    from pdserve.engine.dist.shard import bind_context

    from tests.dist import tp_harness as h

    net, cfg, _ = load_model(model, tp=group.size, rank=group.rank, quantization=quantization)
    bound = bind_context(net, TPContext(group, cfg.vocab_size))
    kept = [a.data_ptr() == b.data_ptr() for a, b in zip(net.state_dict().values(),
                                                          bound.state_dict().values())]
    with torch.inference_mode():
        tokens = h.greedy_loop(_step(bound, h.kv_cache(bound.config, 3)), _PROMPTS, 6)
    return {"kept": all(kept), "tp": bound.tp is not None, "tokens": tokens}


_PROMPTS = [[5, 6, 7, 8, 9], [11, 3, 50], [99, 1, 2, 3, 4, 5, 6]]


def test_direct_shards_bound_to_a_gloo_group_generate_as_the_full_model() -> None:
    """Two ranks (spawned, real gloo) each load their FP8 shard of a MoE preset directly,
    keep its tensors when bound to the group, and generate the full model's greedy tokens."""
    from tests.dist import tp_harness as h

    full = load_model("tiny-qwen3-moe", quantization="fp8")[0]
    with torch.inference_mode():
        want = h.greedy_loop(_step(full, h.kv_cache(full.config, 3)), _PROMPTS, 6)
    got = h.run_ranks(direct_rank, 2, "tiny-qwen3-moe", "fp8")
    for r in range(2):
        assert got[r] == {"kept": True, "tp": True, "tokens": want}, got[r]

"""MTP (multi-token prediction) modules in the DeepSeek-V3 form, and where their weights come from.

One MTP layer predicts token t+2 from the target's hidden state at t and the token at t+1:

    x   = eh_proj(concat(enorm(embed(token[t+1])), hnorm(h[t])))     [T, 2H] -> [T, H]
    y   = DecoderLayer(x)           its own KV cache layer: kv_layer = num_layers + i
    out = norm(y)                   -> the target's shared lm_head gives the logits of t+2

h[t] is the target's hidden state after its final norm (what its lm_head reads, and what
vLLM feeds DeepSeek/MiMo MTP layers). Chained drafting reuses a layer: draft j+1 comes from
(out of draft j, draft j), at the next position. The embedding, rotary table and lm_head are
the target model's (passed in, never copied).

Weights, three sources:
  * our own safetensors (train-mtp output): this module's parameter names, merged qkv/gate_up,
    metadata {"format": "pdserve-mtp", shapes}; save_mtp_head / load_mtp_head;
  * Hugging Face checkpoints: DeepSeek names `model.layers.{num_layers + i}.{enorm, hnorm,
    eh_proj, shared_head.norm, <decoder layer>}` (DeepSeek-V3, GLM-4.5) or MiMo names
    `model.mtp_layers.{i}.{token_layernorm, hidden_layernorm, input_proj, final_layernorm,
    <decoder layer>}`; MiMo's input_proj reads [hidden | token], so its two column halves are
    swapped on load. The decoder layer is the target family's own (DecoderLayer with layer
    index num_layers + i): q/k/v biases for MiMo, GLM's partial rotary and its MoE block
    (routed + shared experts, since num_layers + i >= first_k_dense_replace);
  * seeded random weights (presets, benchmarks).
"""
from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from pdserve.engine.core.config import ConfigError, ModelConfig
from pdserve.engine.dist.parallel import TPContext
from pdserve.engine.dist.shard import _install, shard_mtp_head
from pdserve.engine.model.attention import AttentionBackend, AttentionMetadata, TorchAttentionBackend
from pdserve.engine.model.decoder import DecoderLayer, Model
from pdserve.engine.model.fp8_convert import scale_blocks
from pdserve.engine.model.layers import RMSNorm, fused_kernels
from pdserve.engine.model.moe import cast_model
from pdserve.engine.model.mtp_names import mtp_checkpoint_name
from pdserve.engine.model.weights import WeightsError, _iter_safetensors, _Sink, safetensors_files

MTP_FORMAT = "pdserve-mtp"
HEADS_DIR = Path(__file__).parent.parent / "mtp_heads"  # trained heads shipped with the package
# shape fields a head file must agree on with the target model
_SHAPE_FIELDS = ("arch", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "intermediate_size", "qk_norm")


class MTPLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, backend: AttentionBackend,
                 tp: TPContext | None = None) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)  # on the embedding of token t+1
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)  # on the hidden state of position t
        self.eh_proj = nn.Linear(2 * h, h, bias=False)  # input: [embedding | hidden]
        # with TP the block is split like a target layer (its all-reduces); the rest replicated
        self.block = DecoderLayer(cfg, cfg.num_layers + index, backend, tp)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)  # DeepSeek's shared_head.norm
        self.fused = False  # decode-sized batches: eh_proj as a PDL-chained GEMV kernel

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor,
                select: torch.Tensor | None = None) -> torch.Tensor:
        """embeds, hidden [T, H] -> normed output [T, H] (lm_head input, and the next draft's
        h); select int64 [B]: only those rows, [B, H], gathered by the final norm."""
        x = self._joined(embeds, hidden)  # [T, 2H]
        if self.fused and 0 < x.shape[0] <= fused_kernels().GEMV_ROWS:
            x = fused_kernels().gemv(x, self.eh_proj.weight)
        else:
            x = self.eh_proj(x)
        x, residual = self.block(x, None, cos, sin, meta, kv_cache)
        if residual is None:
            return self.norm(x, rows=select)
        return self.norm(x, residual, rows=select)[0]

    def _joined(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[enorm(embeds) | hnorm(hidden)] [T, 2H]: each norm writes its half in place (no
        cat kernel on the fused path)."""
        T, H = embeds.shape
        x = embeds.new_empty(T, 2 * H)
        self.enorm(embeds, out=x[:, :H])
        self.hnorm(hidden, out=x[:, H:])
        return x


class MTPHead(nn.Module):
    """The MTP layers of one target model. `config` is the target's (with num_mtp_layers > 0);
    with tp, the rank's shard of it (tp_mtp_head)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend | None = None,
                 tp: TPContext | None = None) -> None:
        super().__init__()
        if config.num_mtp_layers < 1:
            raise ConfigError("num_mtp_layers: an MTP head needs at least one layer")
        self.config = config
        self.tp = tp if tp is not None and tp.size > 1 else None
        backend = backend if backend is not None else TorchAttentionBackend()
        self.layers = nn.ModuleList(MTPLayer(config, i, backend, self.tp)
                                    for i in range(config.num_mtp_layers))
        # reduced draft vocabulary (use_draft_vocab): target ids [V'] and their lm_head rows
        self.draft_ids: torch.Tensor | None = None
        self.draft_weight: torch.Tensor | None = None

    def forward(self, target: Model, input_ids: torch.Tensor, hidden: torch.Tensor,
                positions: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor,
                step: int = 0, select: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T] (token t+1), hidden [T, H] (position t), positions [T] (= t) ->
        normed [T, H], or [B, H] at the rows `select` [B] picks. Chain step `step` uses
        layer step % num_mtp_layers."""
        cos, sin, meta = target.rope(positions, meta)
        layer = self.layers[step % len(self.layers)]
        return layer(target.embed(input_ids), hidden.to(target.embed_tokens.weight.dtype),
                     cos, sin, meta, kv_cache, select)

    def use_draft_vocab(self, target: Model, size: int, keep: tuple[int, ...] = ()) -> None:
        """Draft over `size` token ids only (FR-Spec / EAGLE-3's reduced draft vocabulary):
        the draft's LM head reads size x H instead of V x H (Qwen3-8B: 1.24 GB -> 0.27 GB per
        draft at 32K), while verification keeps the full head, so greedy output is unchanged
        and rejection sampling stays exact (the draft distribution is zero outside the set).
        The ids are the lowest ones (byte-level BPE numbers tokens in merge order, most
        frequent first) plus `keep` (EOS ids). A draft can only be accepted where the target's
        token is in the set: 93.9% of SmolLM2's held-out greedy tokens lie in its lowest 16K
        ids, 97.5% in the lowest 32K (bench/lab/bench_draft_vocab.py). 0 = the full vocabulary."""
        vocab = target.lm_head.weight.shape[0]
        if not 0 <= size <= vocab:
            raise ConfigError(f"speculative.draft_vocab: must be in [0, {vocab}] (0 = the full "
                              f"vocabulary), got {size}")
        if size in (0, vocab):
            self.draft_ids = self.draft_weight = None
            return
        keep = sorted({int(t) for t in keep if size <= int(t) < vocab})  # ids above the set
        ids = list(range(size - len(keep))) + keep
        dev = target.lm_head.weight.device
        self.draft_ids = torch.tensor(ids, dtype=torch.int64, device=dev)  # [V'] ascending
        self.draft_weight = target.lm_head.weight.detach().index_select(0, self.draft_ids)

    def draft_logits(self, target: Model, hidden: torch.Tensor,
                     as_float: bool = True) -> torch.Tensor:
        """hidden [N, H] -> draft logits [N, V] over the full vocabulary (-inf outside the
        draft vocabulary), for sampled drafts; the target's own head without one."""
        if self.draft_ids is None:
            return target.compute_logits(hidden, as_float)
        sub = target.compute_logits(hidden, as_float, weight=self.draft_weight)  # [N, V']
        full = sub.new_full((sub.shape[0], target.lm_head.weight.shape[0]), float("-inf"))
        return full.index_copy_(1, self.draft_ids, sub)

    def draft_greedy(self, target: Model, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> int64 [N] target ids: the argmax of the draft logits."""
        if self.draft_ids is None:
            return target.greedy(hidden)
        return self.draft_ids[target.greedy(hidden, weight=self.draft_weight)]

    def set_fused(self, enabled: bool) -> MTPHead:
        """Same switch as Model.use_fused_ops, for this head's norms, MLP and prologue."""
        for module in self.modules():
            if hasattr(module, "fused") and isinstance(module.fused, bool):
                module.fused = enabled
        return self


# -- building ----------------------------------------------------------------------------------

def tp_mtp_head(head: MTPHead, target: Model) -> MTPHead:
    """The head a (possibly tensor-parallel) target drafts with: `head` itself without TP;
    with TP, the rank's shard (the decoder blocks split like the target's layers; enorm,
    hnorm, eh_proj and the final norm replicated) as an MTPHead whose blocks all-reduce on
    the target's group. `head` may be the full head (sharded here) or the rank's shard as
    loaded (engine/model/shard_load.py resolve_mtp_shard; its tensors are taken over)."""
    tp = target.tp
    if tp is None or head.tp is tp:
        return head
    full, local = head.config.num_heads, target.config.num_heads
    if head.tp is None and full == local * tp.size:
        head = shard_mtp_head(head, head.config, tp.size, tp.rank, target.backend)
    elif head.tp is not None or full != local:
        raise ConfigError(f"speculative: the MTP head ({full} heads) is neither the full head "
                          f"nor the shard of this rank's target ({local} heads x "
                          f"tensor_parallel_size={tp.size})")
    # as engine/dist/shard.py bind_context does for the Model: the same tensors, assigned
    dtype = next(head.parameters()).dtype
    with torch.device("meta"):
        bound = cast_model(MTPHead(head.config, target.backend, tp), dtype)
    bound = _install(head, bound, head.state_dict(), scale_blocks(head))
    bound.draft_ids, bound.draft_weight = head.draft_ids, head.draft_weight
    return bound.set_fused(head.layers[0].fused)


def with_mtp_layers(cfg: ModelConfig, n: int) -> ModelConfig:
    """The target's config with room for n MTP layers in every KV block."""
    return replace(cfg, num_mtp_layers=n)


def empty_head(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str,
               backend: AttentionBackend | None = None) -> MTPHead:
    """An uninitialised head allocated once in dtype on device (built on meta first)."""
    with torch.device("meta"):
        head = MTPHead(cfg, backend)
    head = cast_model(head, dtype)  # a MoE block's router stays float32, as in the target
    return head.to_empty(device=torch.device(device)).requires_grad_(False).eval()


def random_head(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                seed: int = 0, std: float = 0.02, backend: AttentionBackend | None = None) -> MTPHead:
    """Seeded N(0, std) matrices and unit norms, like pdserve.engine.model.weights.random_model."""
    head = empty_head(cfg, dtype, device, backend)
    gen = torch.Generator(device=torch.device(device)).manual_seed(seed + 7919)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=gen)
    return head


# -- our own files -----------------------------------------------------------------------------

def _shape_metadata(cfg: ModelConfig) -> dict[str, str]:
    meta = {f: str(getattr(cfg, f)) for f in _SHAPE_FIELDS}
    meta["num_mtp_layers"] = str(cfg.num_mtp_layers)
    return meta


def save_mtp_head(head: MTPHead, path: str | Path, dtype: torch.dtype = torch.float16,
                  extra: dict[str, str] | None = None) -> None:
    """Write the head as safetensors (our parameter names) with shape metadata."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in head.state_dict().items()}
    meta = {"format": MTP_FORMAT, **_shape_metadata(head.config), **(extra or {})}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)


def file_digest(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def check_head_file(path: str | Path, cfg: ModelConfig) -> dict[str, str]:
    """A head file's metadata, read without its tensors; ConfigError unless it is a
    pdserve-mtp file whose shape metadata matches the target `cfg`."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"mtp_head: {str(path)!r} does not exist")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
    except Exception as e:  # safetensors raises its own types for bad headers
        raise ConfigError(f"mtp_head: cannot read {str(path)!r}: {e}") from e
    if meta.get("format") != MTP_FORMAT:
        raise ConfigError(f"mtp_head: {str(path)!r} is not a {MTP_FORMAT} file")
    want = _shape_metadata(cfg)
    want.pop("num_mtp_layers")
    bad = [f"{k}: {meta.get(k)!r} != {v!r}" for k, v in want.items() if meta.get(k) != v]
    if bad:
        raise ConfigError(f"mtp_head: {str(path)!r} was trained for another model "
                          f"({'; '.join(bad)})")
    return meta


def load_mtp_head(path: str | Path, cfg: ModelConfig, dtype: torch.dtype,
                  device: torch.device | str, backend: AttentionBackend | None = None) -> MTPHead:
    """A head saved by save_mtp_head; its shape metadata must match the target `cfg`."""
    from safetensors import safe_open

    path = Path(path)
    meta = check_head_file(path, cfg)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own types for bad headers
        raise ConfigError(f"mtp_head: cannot read {str(path)!r}: {e}") from e
    cfg = with_mtp_layers(cfg, int(meta.get("num_mtp_layers", "1")))
    head = empty_head(cfg, dtype, device, backend)
    try:
        head.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=True)
    except RuntimeError as e:
        raise ConfigError(f"mtp_head: {str(path)!r} does not fit this model: {e}") from e
    return head


# -- Hugging Face checkpoints --------------------------------------------------------------------

def load_hf_mtp(folder: str | Path, cfg: ModelConfig, dtype: torch.dtype,
                device: torch.device | str, backend: AttentionBackend | None = None) -> MTPHead:
    """The MTP layers of a Hugging Face checkpoint folder (cfg.num_mtp_layers of them)."""

    return fill_mtp_head(empty_head(cfg, dtype, device, backend), cfg, folder)


def fill_mtp_head(head: MTPHead, cfg: ModelConfig, folder: str | Path,
                  cut: object | None = None) -> MTPHead:
    """Stream the checkpoint's MTP tensors into `head` through weights._Sink (`cut`: a
    tensor-parallel rank's SourceCut, engine/model/shard_load.py)."""
    sink = _Sink(head, str(folder), cut=cut)
    for name, tensor in _iter_safetensors(safetensors_files(Path(folder))):
        mapped = mtp_checkpoint_name(name, cfg.num_layers)
        if mapped is None or mapped[1] is None or mapped[0] >= cfg.num_mtp_layers:
            continue
        index, ours = mapped
        if ours.endswith("#mimo"):  # [hidden | token] -> [token | hidden]
            ours = ours.removesuffix("#mimo")
            h = cfg.hidden_size
            tensor = torch.cat([tensor[:, h:], tensor[:, :h]], dim=1)
        sink.load(f"layers.{index}.{ours}", tensor)
    try:
        sink.finish()
    except WeightsError as e:
        raise WeightsError(f"{folder}: incomplete MTP layers: {e}") from e
    return head


def resolve_mtp_head(source: object, cfg: ModelConfig, dtype: torch.dtype,
                     device: torch.device | str, backend: AttentionBackend | None = None, seed: int = 0,
                     path: str | Path | None = None) -> tuple[MTPHead, ModelConfig, str]:
    """The MTP head for a model source (engine.model.loader.ModelSource): `path` if given
    (our format), else the checkpoint's own MTP layers (Hugging Face folder), random weights
    for a preset, or the trained head shipped in engine/mtp_heads/<model name>.safetensors.
    Returns (head, target config with num_mtp_layers set, head id for the compat hash)."""
    kind, name = getattr(source, "kind", None), getattr(source, "name", "")
    if path is not None:
        head = load_mtp_head(path, cfg, dtype, device, backend)
        return head, head.config, f"file:{file_digest(path)}"
    if kind == "hf" and cfg.num_mtp_layers > 0:
        head = load_hf_mtp(source.path, cfg, dtype, device, backend)  # type: ignore[attr-defined]
        return head, cfg, f"hf:{name}:{cfg.num_mtp_layers}"
    if kind == "preset":
        cfg = with_mtp_layers(cfg, max(1, cfg.num_mtp_layers))
        return random_head(cfg, dtype, device, seed, backend=backend), cfg, f"random:{seed}"
    shipped = HEADS_DIR / f"{name}.safetensors"
    if shipped.is_file():
        head = load_mtp_head(shipped, cfg, dtype, device, backend)
        return head, head.config, f"file:{file_digest(shipped)}"
    raise ConfigError(f"speculative: model {name!r} has no MTP layers and no trained head in "
                      f"{HEADS_DIR}; train one with `pdserve train-mtp` and pass it (mtp_head, --mtp-head)")


def check_mtp_head(source: object, cfg: ModelConfig, path: str | Path | None = None) -> str:
    """What resolve_mtp_head would load for this source, checked without loading weights
    (the router checks --speculative before it starts workers). Returns a short description;
    raises ConfigError where resolve_mtp_head would."""
    kind, name = getattr(source, "kind", None), getattr(source, "name", "")
    if path is not None:
        check_head_file(path, cfg)
        return f"file {path}"
    if kind == "hf" and cfg.num_mtp_layers > 0:
        return f"the checkpoint's {cfg.num_mtp_layers} MTP layer(s)"
    if kind == "preset":
        return "random weights"
    shipped = HEADS_DIR / f"{name}.safetensors"
    if shipped.is_file():
        check_head_file(shipped, cfg)
        return f"shipped head {shipped.name}"
    raise ConfigError(f"speculative: model {name!r} has no MTP layers and no trained head in "
                      f"{HEADS_DIR}; train one with `pdserve train-mtp` and pass it (mtp_head, --mtp-head)")

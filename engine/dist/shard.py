"""Cut a full model's tensors into one tensor-parallel rank's shard (pure functions: a full
tensor in, the rank's tensor out), and build a rank's Model or MTP head from a full one.

By parameter (names as engine/model/decoder.py, moe.py and spec/mtp_head.py give them):
  * column-parallel, rows split: qkv_proj (weight, bias; q rows of the rank's heads, then k
    and v rows of its KV heads: a shard, or the replicated head its q heads use),
    gate_up_proj (the gate half's rows, then the up half's), the experts' w13 [E, 2I, H];
  * row-parallel, columns split: o_proj, down_proj, the experts' w2 [E, H, I]; a bias (none
    in today's families) is kept by rank 0 only, so the all-reduce adds it once;
  * vocabulary-parallel: embed_tokens and lm_head, ceil(V / tp) rows per rank, zero-padded;
  * replicated: every norm (QK-norm too), the MoE router and its correction bias, and the MTP
    layers' enorm, hnorm, eh_proj and final norm (eh_proj is [H, 2H] and its output feeds the
    block whole: splitting it would cost one more all-reduce per draft for little memory).

MoE: tensor parallelism inside every expert (each rank holds all E experts with I / tp of
their intermediate rows), not expert parallelism. Every rank then does the same routing and
the same work per token whatever the routing picks, needs no all-to-all token dispatch, and
ends the MoE block with the one all-reduce a dense MLP has (routed and shared experts summed
locally first); the fused MoE kernel runs unchanged on a smaller I. Expert parallelism pays
when E is large and I / tp would get skinny (GLM-4.5's 160 experts at TP 8), across nodes
or with data-parallel attention; it is left for then.

FP8 (engine/model/fp8.py: e4m3 weight [.., N, K], float32 scales per (bn, bk) block): a row
split keeps whole row-blocks when every piece starts on a block boundary; otherwise the
rank's scales become per-row (block (1, bk), exact: the loader's own form for merged
projections). A column split must start and end on bk boundaries (a scale block cannot be
split without requantizing): otherwise ConfigError names the scale parameter.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from pdserve.engine.core.config import ConfigError, ModelConfig
from pdserve.engine.dist.heads import HeadSplit, even_split, local_shapes, vocab_shard
from pdserve.engine.dist.parallel import TPContext
from pdserve.engine.model import fp8_convert
from pdserve.engine.model.attention import AttentionBackend
from pdserve.engine.model.decoder import Model
from pdserve.engine.model.fp8 import Block, Fp8Linear
from pdserve.engine.model.moe import Experts, cast_model

Pieces = list[tuple[int, int]]  # (first row or column, count) in the full tensor's split dim

_ROW_SPLIT = ("qkv_proj", "gate_up_proj")
_COL_SPLIT = ("o_proj", "down_proj")


@dataclass(frozen=True)
class ShardPlan:
    """How the full model `cfg` splits for rank `rank` of `tp` (checked on construction)."""

    cfg: ModelConfig
    tp: int
    rank: int

    def __post_init__(self) -> None:
        local_shapes(self.cfg, self.tp)  # every split checked, the field named
        if not 0 <= self.rank < self.tp:
            raise ConfigError(f"rank: must be in [0, {self.tp}), got {self.rank}")

    @property
    def heads(self) -> HeadSplit:
        return HeadSplit(self.cfg.num_heads, self.cfg.num_kv_heads, self.tp)

    def local_config(self) -> ModelConfig:
        """The rank's Model shape: its heads, KV heads, MLP and vocabulary rows."""
        cfg = dataclasses.replace(self.cfg, **local_shapes(self.cfg, self.tp))
        if cfg.moe is not None:
            moe = dataclasses.replace(cfg.moe, intermediate_size=cfg.moe.intermediate_size // self.tp)
            cfg = dataclasses.replace(cfg, moe=moe)
        return cfg

    # -- which rows / columns ---------------------------------------------------------------
    def qkv_pieces(self) -> Pieces:
        d, hq, hkv = self.cfg.head_dim, self.cfg.num_heads, self.cfg.num_kv_heads
        q, kv = self.heads.q_heads(self.rank), self.heads.kv_heads(self.rank)
        return [(q.start * d, len(q) * d), ((hq + kv.start) * d, len(kv) * d),
                ((hq + hkv + kv.start) * d, len(kv) * d)]

    def pair_pieces(self, rows: int, field: str) -> Pieces:
        """gate ++ up [2I, ...]: the rank's rows of each half."""
        own = even_split(rows // 2, self.tp, self.rank, field)
        return [(own.start, len(own)), (rows // 2 + own.start, len(own))]

    def row_pieces(self, name: str, rows: int) -> Pieces | None:
        """The rank's rows of a row-split parameter `name` [.., rows, K] (qkv_proj's weight
        and bias, gate_up_proj, the experts' w13), in the full parameter's rows; None when
        `name` is not row-split."""
        module, param = _leaf(name)
        if module == "qkv_proj" and param in ("weight", "bias"):
            return self.qkv_pieces()
        if module == "gate_up_proj" and param == "weight":
            return self.pair_pieces(rows, name)
        if module == "experts" and param == "w13":
            return self.pair_pieces(rows, "moe_intermediate_size")
        return None

    def _span_rows(self, name: str, rows: int, span: tuple[int, int]) -> Pieces:
        """The rank's rows inside rows span = (start, size) of the full parameter `name`,
        counted from start (in the source tensor that fills that span)."""
        start, size = span
        out = []
        for s, c in self.row_pieces(name, rows) or [(0, rows)]:
            lo, hi = max(s, start), min(s + c, start + size)
            if lo < hi:
                out.append((lo - start, hi - lo))
        return out

    def col_pieces(self, name: str, cols: int) -> Pieces:
        if name.endswith("o_proj.weight") or name.endswith("o_proj.weight_scale"):
            q = self.heads.q_heads(self.rank)
            return [(q.start * self.cfg.head_dim, len(q) * self.cfg.head_dim)]
        own = even_split(cols, self.tp, self.rank, name)
        return [(own.start, len(own))]

    # -- one tensor -----------------------------------------------------------------------
    def shard(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """The rank's part of the full float/FP8 tensor `name` (scales: shard_scale)."""
        module, param = _leaf(name)
        if module in ("embed_tokens", "lm_head"):
            start, valid, rows = vocab_shard(self.cfg.vocab_size, self.tp, self.rank)
            out = t.new_zeros(rows, *t.shape[1:])
            out[:valid] = t[start:start + valid]
            return out
        if module == "qkv_proj" and param in ("weight", "bias"):
            return _take(t, 0, self.qkv_pieces())
        if module == "gate_up_proj" and param == "weight":
            return _take(t, 0, self.pair_pieces(t.shape[0], name))
        if module == "experts" and param == "w13":
            return _take(t, -2, self.pair_pieces(t.shape[-2], "moe_intermediate_size"))
        if module in _COL_SPLIT and param == "weight":
            return _take(t, -1, self.col_pieces(name, t.shape[-1]))
        if module == "experts" and param == "w2":
            return _take(t, -1, self.col_pieces("moe_intermediate_size", t.shape[-1]))
        if module in _COL_SPLIT and param == "bias":  # added once, by rank 0
            return t.clone() if self.rank == 0 else torch.zeros_like(t)
        return t.clone()

    def shard_scale(self, name: str, scale: torch.Tensor, weight_shape: torch.Size,
                    block: Block) -> tuple[torch.Tensor, Block]:
        """The rank's scale grid of the FP8 weight `name`'s scales (weight_scale, w13_scale,
        w2_scale) and its block, which becomes (1, bk) where row pieces leave blocks."""
        module, param = _leaf(name)
        n, k = weight_shape[-2], weight_shape[-1]
        if module == "qkv_proj":
            return _row_scales(name, scale, self.qkv_pieces(), n, block)
        if module == "gate_up_proj" or param == "w13_scale":
            field = "moe_intermediate_size" if param == "w13_scale" else name
            return _row_scales(name, scale, self.pair_pieces(n, field), n, block)
        if module in _COL_SPLIT or param == "w2_scale":
            field = "moe_intermediate_size" if param == "w2_scale" else name
            return _col_scales(name, scale, self.col_pieces(field, k), k, block), block
        return scale.clone(), block

    # -- one checkpoint tensor: a source of a merged parameter ----------------------------
    def shard_part(self, name: str, t: torch.Tensor, span: tuple[int, int] | None,
                   rows: int) -> torch.Tensor:
        """The rank's part of checkpoint tensor `t`, which fills rows span = (start, size) of
        the full parameter `name` [.., rows, K]: q, k or v of qkv_proj, gate or up of
        gate_up_proj, one expert's gate / up of w13 ([size, K]) or its down of w2 ([H, I],
        columns split). span None: `t` is the whole parameter (shard). Merged parameters
        keep their row order: the rank's q ++ k ++ v, gate ++ up, as `shard` cuts them."""
        if span is None:
            return self.shard(name, t)
        if _leaf(name)[1] == "w2":
            return _take(t, -1, self.col_pieces("moe_intermediate_size", t.shape[-1]))
        return _take(t, 0, self._span_rows(name, rows, span))

    def shard_part_scale(self, name: str, scale: torch.Tensor, span: tuple[int, int] | None,
                         shape: tuple[int, int], block: Block) -> tuple[torch.Tensor, Block]:
        """shard_part for the scale grid `scale` [gn, gk] (block `block`) of such a source;
        shape: the full parameter's weight [rows, K]. Returns the rank's grid and its block
        (per-row (1, bk) where a row piece leaves a block, shard_scale's rules)."""
        if span is None:
            return self.shard_scale(name, scale, torch.Size(shape), block)
        rows, cols = shape
        if _leaf(name)[1] == "w2_scale":
            pieces = self.col_pieces("moe_intermediate_size", cols)
            return _col_scales(name, scale, pieces, cols, block), block
        pieces = self._span_rows(name.removesuffix("_scale"), rows, span)
        return _row_scales(name, scale, pieces, span[1], block)


def _leaf(name: str) -> tuple[str, str]:
    parts = name.split(".")
    return (parts[-2] if len(parts) > 1 else ""), parts[-1]


def _take(t: torch.Tensor, dim: int, pieces: Pieces) -> torch.Tensor:
    return torch.cat([t.narrow(dim, s, c) for s, c in pieces], dim=dim).contiguous()


def _row_scales(name: str, scale: torch.Tensor, pieces: Pieces, n: int, block: Block
                ) -> tuple[torch.Tensor, Block]:
    """Scale rows [.., gn, gk] for weight rows `pieces` of n: whole blocks when aligned,
    else per-row scales (exact)."""
    bn, bk = block
    if bn == 1:
        return _take(scale, -2, pieces), block
    last = len(pieces) - 1
    aligned = all(s % bn == 0 and (c % bn == 0 or (i == last and s + c == n))
                  for i, (s, c) in enumerate(pieces))
    if aligned:
        return _take(scale, -2, [(s // bn, -(-c // bn)) for s, c in pieces]), block
    if bn >= n and len(pieces) == 1:  # one scale row covers the whole weight (per tensor)
        return scale.clone(), block
    per_row = scale.repeat_interleave(bn, dim=-2).narrow(-2, 0, n)
    return _take(per_row, -2, pieces), (1, bk)


def _col_scales(name: str, scale: torch.Tensor, pieces: Pieces, k: int, block: Block
                ) -> torch.Tensor:
    bk = block[1]
    if bk >= k:  # one scale column (per channel / per tensor): every column split shares it
        return scale.clone()
    out = []
    for s, c in pieces:
        if s % bk or (c % bk and s + c != k):
            raise ConfigError(f"{name}: columns [{s}, {s + c}) of this rank's shard do not "
                              f"fall on the FP8 scale blocks of {bk} columns (block {block}); "
                              f"choose a tensor_parallel_size that keeps each rank's part a "
                              f"multiple of {bk}")
        out.append((s // bk, -(-c // bk)))
    return _take(scale, -1, out)


# -- whole modules --------------------------------------------------------------------------

def fp8_split_problem(cfg: ModelConfig, tp: int, block: Block) -> str | None:
    """What _col_scales would refuse at load, found from the shape alone: the first
    column-split FP8 weight (o_proj; down_proj of the dense layers; the shared and routed
    experts' down) whose columns on some rank would cut a scale block of `block`, with the
    field named; None when every rank's part is whole blocks. Lets a launcher refuse before
    any worker starts (router/cli.py check_tp)."""
    widths = {"o_proj.weight": cfg.num_heads * cfg.head_dim}
    layers = range(cfg.num_layers + cfg.num_mtp_layers)
    if cfg.moe is None or not all(cfg.moe.is_moe_layer(i) for i in layers):
        widths["down_proj.weight"] = cfg.intermediate_size
    if cfg.moe is not None:
        widths["experts.w2"] = cfg.moe.intermediate_size
        if cfg.moe.num_shared_experts:
            widths["shared_experts.down_proj.weight"] = (cfg.moe.intermediate_size
                                                         * cfg.moe.num_shared_experts)
    try:
        for rank in range(tp):
            plan = ShardPlan(cfg, tp, rank)
            for name, k in widths.items():
                field = "moe_intermediate_size" if name == "experts.w2" else name
                grid = torch.empty(1, -(-k // block[1]), device="meta")
                _col_scales(f"{name}_scale", grid, plan.col_pieces(field, k), k, block)
    except ConfigError as e:
        return str(e)
    return None


def _fp8_blocks(full: nn.Module) -> dict[str, tuple[str, ...]]:
    """FP8 module name -> its scale parameter names (weight_scale / w13_scale, w2_scale)."""
    out: dict[str, tuple[str, ...]] = {}
    for name, m in full.named_modules():
        if isinstance(m, Fp8Linear):
            out[name] = ("weight_scale",)
        elif isinstance(m, Experts) and m.w13_scale is not None:
            out[name] = ("w13_scale", "w2_scale")
    return out


def shard_state(full: nn.Module, plan: ShardPlan) -> tuple[dict[str, torch.Tensor],
                                                            dict[str, Block]]:
    """(the rank's state dict, block of each FP8 scale parameter) of a loaded full module."""
    fp8 = _fp8_blocks(full)
    state = full.state_dict()
    out: dict[str, torch.Tensor] = {}
    blocks: dict[str, Block] = {}
    for name, t in state.items():
        module, param = name.rsplit(".", 1) if "." in name else ("", name)
        if module in fp8 and param in fp8[module]:
            m = full.get_submodule(module)
            if param == "weight_scale":
                block, shape = m.block, m.weight.shape
            else:
                i = 0 if param == "w13_scale" else 1
                block, shape = m.blocks[i], (m.w13 if i == 0 else m.w2).shape
            out[name], blocks[name] = plan.shard_scale(name, t, shape, block)
        else:
            out[name] = plan.shard(name, t)
    return out, blocks


def _install(full: nn.Module, local: nn.Module, state: dict[str, torch.Tensor],
             blocks: dict[str, Block]) -> nn.Module:
    """Give the (meta) local module FP8 modules where the full one has them, then the state."""
    for name, scales in _fp8_blocks(full).items():
        parent, leaf = name.rsplit(".", 1)
        target = local.get_submodule(parent)
        if scales == ("weight_scale",):
            w = state[f"{name}.weight"]
            bias = state.get(f"{name}.bias")
            with torch.device("meta"):
                fp8 = Fp8Linear(w.shape[1], w.shape[0], blocks[f"{name}.weight_scale"],
                                None if bias is None else nn.Parameter(bias, requires_grad=False))
            setattr(target, leaf, fp8)
        else:
            experts = getattr(target, leaf)
            for p in ("w13", "w2", "w13_scale", "w2_scale"):
                setattr(experts, p, nn.Parameter(state[f"{name}.{p}"], requires_grad=False))
            experts.blocks = (blocks[f"{name}.w13_scale"], blocks[f"{name}.w2_scale"])
    local.load_state_dict(state, assign=True, strict=True)
    return local.requires_grad_(False).eval()


def shard_model(full: Model, tp: int, rank: int, backend: AttentionBackend | None = None,
                ctx: TPContext | None = None) -> Model:
    """Rank `rank`'s Model of a loaded full Model: built from the plan's local config,
    holding the rank's tensors (tied embeddings stay tied). ctx: the rank's group, which the
    Model's forward then uses for its collectives (engine/model/decoder.py)."""
    plan = ShardPlan(full.config, tp, rank)
    state, blocks = shard_state(full, plan)
    dtype = full.embed_tokens.weight.dtype
    with torch.device("meta"):
        local = cast_model(Model(plan.local_config(), backend, tp=ctx), dtype)
    local = _install(full, local, state, blocks)
    local.tie_weights()
    for mine, theirs in zip(local.layers, full.layers):  # an fp8 checkpoint's KV scales
        mine.self_attn.kv_static_scales = theirs.self_attn.kv_static_scales
    return local


def bind_context(net: Model, ctx: TPContext) -> Model:
    """The loaded shard `net` as a Model that runs ctx's collectives (the group is joined
    after the weights load, engine/llm.py load_rank): a Model of the same config is built on
    the meta device with `tp=ctx` and takes over net's tensors (assigned, not copied)."""
    with torch.device("meta"):
        bound = cast_model(Model(net.config, net.backend, tp=ctx), net.embed_tokens.weight.dtype)
    bound = _install(net, bound, net.state_dict(), fp8_convert.scale_blocks(net))
    bound.tie_weights()
    for mine, theirs in zip(bound.layers, net.layers):  # an fp8 checkpoint's KV scales
        mine.self_attn.kv_static_scales = theirs.self_attn.kv_static_scales
    return bound


def shard_mtp_head(full_head: nn.Module, target_cfg: ModelConfig, tp: int, rank: int,
                   backend: AttentionBackend | None = None) -> nn.Module:
    """Rank `rank`'s MTP head (engine/spec/mtp_head.py MTPHead) of a loaded full one: its
    decoder blocks split like the target's layers, the rest replicated. The shard is built
    as the full head's own class (MTPHead(config, backend)): engine/spec imports this module,
    so importing it back would make a cycle."""
    plan = ShardPlan(target_cfg, tp, rank)
    state, blocks = shard_state(full_head, plan)
    dtype = next(full_head.parameters()).dtype
    with torch.device("meta"):
        local = cast_model(type(full_head)(plan.local_config(), backend), dtype)
    return _install(full_head, local, state, blocks)

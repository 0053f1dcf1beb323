"""Loading one tensor-parallel rank's shard directly: the rank never holds the full model.

The rank's Model (its heads, KV heads, MLP / expert rows and vocabulary rows:
engine/dist/shard.py ShardPlan.local_config) is built on the meta device and allocated once
on the rank's device; the full model exists only on the meta device, for its shapes. Then:

  * checkpoints (Hugging Face safetensors, block-FP8 ones too, and GGUF): each tensor, as
    stored, goes through weights._Sink with a SourceCut, which cuts it to the rank's part
    (ShardPlan.shard_part / shard_part_scale: q, k and v rows of the rank's heads, gate and
    up rows, each expert's rows / columns, vocabulary rows, FP8 scale grids with their
    blocks) before the sink places it;
  * random presets: every full tensor is drawn in random_model's order with its generator,
    one at a time, and cut (so rank r of TP N holds exactly TP 1's shard r);
  * the MTP layers of a Hugging Face checkpoint, and a preset's random MTP head, the same.

Peak memory beyond the shard: one full tensor (the one being cut) and its rank's part.
The result equals shard_model(load_model(...)) bitwise (tests/dist/test_shard_load.py).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from pdserve.engine.core.config import ModelConfig
from pdserve.engine.dist.shard import ShardPlan, shard_mtp_head, shard_state
from pdserve.engine.model import fp8
from pdserve.engine.model.attention import AttentionBackend
from pdserve.engine.model.decoder import Model
from pdserve.engine.model.fp8_convert import scale_blocks
from pdserve.engine.model.weights import (
    ShardOf,
    WeightsError,
    _random_fp8,
    _show_progress,
    _Sink,
    empty_model,
)


class SourceCut:
    """weights.Cut for one rank: the full model's geometry (a meta-device Model or MTP head,
    read through a _Sink of its own) says which rows of which full parameter a checkpoint
    tensor fills; the plan cuts the tensor to the rank's part. Checks each tensor's full
    shape first (WeightsError naming it, as the sink would)."""

    def __init__(self, plan: ShardPlan, full: nn.Module, source: str,
                 quant: fp8.QuantSpec | None = None) -> None:
        self.plan, self.source, self.quant = plan, source, quant
        self.geo = _Sink(full, source, quant)  # the full model's slices and shapes (meta)

    def __call__(self, name: str, pname: str, shard: int, t: torch.Tensor
                 ) -> tuple[torch.Tensor, fp8.Block | None]:
        is_scale = pname in self.geo.blocks
        wname = pname.removesuffix("_scale") if is_scale else pname
        shape = tuple(self.geo.params[wname].shape)  # the full parameter, [.., N, K] or [N]
        span = None
        if shard >= 0:  # one source of a merged parameter: rows [start, start + size)
            _, _, start, size = self.geo._slices(wname)[shard]
            span = (start, size)
        if not is_scale:  # a weight [size, K] (of an expert's too) or a bias [size]
            want = shape if span is None else (span[1],) + (shape[-1:] if len(shape) > 1 else ())
            if tuple(t.shape) != want:
                raise WeightsError(f"{self.source}: tensor {name!r} has shape "
                                   f"{tuple(t.shape)}, expected {want}")
            rows = shape[-2] if len(shape) > 1 else shape[0]
            return self.plan.shard_part(pname, t, span, rows), None
        rows, cols = shape[-2:]
        src_rows = rows if span is None else span[1]
        src = self.quant.source_block(src_rows, cols)
        problem = fp8.source_scale_problem(t, src_rows, cols, src)
        if problem is not None:
            raise WeightsError(f"{self.source}: tensor {name!r} {problem}")
        grid = t.reshape(fp8.grid_shape(src_rows, cols, src))
        return self.plan.shard_part_scale(pname, grid, span, (rows, cols), src)


def rank_shard(tp: int, rank: int, dtype: torch.dtype,
               backend: AttentionBackend | None = None) -> ShardOf:
    """weights.ShardOf for rank `rank` of `tp` (load_hf / load_gguf's `shard`)."""
    def of(cfg: ModelConfig, quant: fp8.QuantSpec | None, source: str
           ) -> tuple[ModelConfig, SourceCut]:
        plan = ShardPlan(cfg, tp, rank)  # every split checked, naming the field
        full = empty_model(cfg, dtype, "meta", backend, quant)
        shard_state(full, plan)  # on meta: an FP8 column split off the scale blocks fails now
        return plan.local_config(), SourceCut(plan, full, source, quant)
    return of


# -- random weights ----------------------------------------------------------------------------

def _draw_cut(full: nn.Module, local: nn.Module, plan: ShardPlan, gen: torch.Generator,
              std: float, progress: bool) -> None:
    """Fill `local` (the rank's shard) with what random_model / random_head would draw for
    `full` (meta) and the plan would cut: each full tensor drawn in turn on local's device
    with `gen` (the draws must follow the full model's order and sizes), then cut."""
    params = dict(local.named_parameters())
    scales = set(scale_blocks(full))
    for name, p in tqdm(list(full.named_parameters()), desc="random init", unit="tensor",
                        disable=not progress):
        mine = params[name]
        if name.endswith("norm.weight"):
            mine.fill_(1.0)
        elif name in scales:  # constant: the rank's grid (its own block) holds the same value
            mine.fill_(std / 16)
        else:
            tmp = torch.empty(p.shape, dtype=p.dtype, device=mine.device)  # one full tensor
            if p.dtype == fp8.FP8_DTYPE:
                _random_fp8(tmp, gen)
            else:
                tmp.normal_(0.0, std, generator=gen)
            mine.copy_(plan.shard(name, tmp))
            del tmp


@torch.no_grad()
def random_shard(cfg: ModelConfig, tp: int, rank: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", seed: int = 0, std: float = 0.02,
                 backend: AttentionBackend | None = None, progress: bool | None = None,
                 quant: fp8.QuantSpec | None = None) -> Model:
    """Rank `rank`'s shard of weights.random_model(cfg, ..., seed, std, quant): equal to
    shard_model(random_model(...), tp, rank) bitwise, holding one full tensor at a time."""
    plan = ShardPlan(cfg, tp, rank)
    full = empty_model(cfg, dtype, "meta", backend, quant)
    if quant is not None:  # an FP8 column split off the scale blocks: refused, as a checkpoint's
        shard_state(full, plan)
    device = torch.device(device)
    local = empty_model(plan.local_config(), dtype, device, backend, quant)
    if device.type == "meta":
        return local
    gen = torch.Generator(device=device).manual_seed(seed)
    _draw_cut(full, local, plan, gen, std, _show_progress(cfg, progress))
    return local


# -- MTP layers ---------------------------------------------------------------------------------

def load_hf_mtp_shard(folder: str | Path, cfg: ModelConfig, tp: int, rank: int,
                      dtype: torch.dtype, device: torch.device | str,
                      backend: AttentionBackend | None = None) -> nn.Module:
    """Rank `rank`'s MTP head of a Hugging Face checkpoint's MTP layers (what
    spec/mtp_head.py load_hf_mtp loads, cut as each tensor streams)."""
    from pdserve.engine.spec.mtp_head import empty_head, fill_mtp_head

    plan = ShardPlan(cfg, tp, rank)
    head = empty_head(plan.local_config(), dtype, device, backend)
    cut = SourceCut(plan, empty_head(cfg, dtype, "meta", backend), str(folder))
    return fill_mtp_head(head, cfg, folder, cut=cut)


@torch.no_grad()
def random_head_shard(cfg: ModelConfig, tp: int, rank: int, dtype: torch.dtype,
                      device: torch.device | str, seed: int = 0, std: float = 0.02,
                      backend: AttentionBackend | None = None) -> nn.Module:
    """Rank `rank`'s shard of spec/mtp_head.py random_head(cfg, ..., seed, std)."""
    from pdserve.engine.spec.mtp_head import empty_head

    plan = ShardPlan(cfg, tp, rank)
    head = empty_head(plan.local_config(), dtype, device, backend)
    gen = torch.Generator(device=torch.device(device)).manual_seed(seed + 7919)  # random_head's
    _draw_cut(empty_head(cfg, dtype, "meta", backend), head, plan, gen, std, False)
    return head


def resolve_mtp_shard(source: object, cfg: ModelConfig, tp: int, rank: int,
                      dtype: torch.dtype, device: torch.device | str,
                      backend: AttentionBackend | None = None, seed: int = 0,
                      path: str | Path | None = None) -> tuple[nn.Module, ModelConfig, str]:
    """spec/mtp_head.py resolve_mtp_head for rank `rank` of `tp`: the same (head, config,
    head id), the head being the rank's shard. A checkpoint's MTP layers and a preset's
    random head are cut as they load; a trained head file (one small layer, engine/mtp_heads
    or mtp_head=PATH) loads whole and is sharded (shard_mtp_head)."""
    from pdserve.engine.spec.mtp_head import resolve_mtp_head, with_mtp_layers

    kind, name = getattr(source, "kind", None), getattr(source, "name", "")
    if path is None and kind == "hf" and cfg.num_mtp_layers > 0:
        head = load_hf_mtp_shard(source.path, cfg, tp, rank, dtype, device, backend)  # type: ignore[attr-defined]
        return head, cfg, f"hf:{name}:{cfg.num_mtp_layers}"
    if path is None and kind == "preset":
        cfg = with_mtp_layers(cfg, max(1, cfg.num_mtp_layers))
        return random_head_shard(cfg, tp, rank, dtype, device, seed, backend=backend), cfg, \
            f"random:{seed}"
    head, cfg, head_id = resolve_mtp_head(source, cfg, dtype, device, backend, seed, path)
    return shard_mtp_head(head, cfg, tp, rank, backend), cfg, head_id

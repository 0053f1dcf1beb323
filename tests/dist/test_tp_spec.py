"""MTP speculative decoding across a tensor-parallel split (engine/spec/mtp_plan.py, the MTP
step message): the offline engine at TP 2 (this process rank 0, one spawned follower on a
real gloo group) drafting through a checkpoint's own MTP layer (a tiny transformers GLM-4.5
with its MTP layer: MoE decoder block, shared expert; a tiny MiMo: a Qwen2 block with
q/k/v biases) generates the same greedy tokens as without MTP at TP 1, and drafts exactly
as TP 1 with MTP does (the same drafts accepted: acceptance > 0). Sampled requests draft
at TP 2 too (rank 0 draws, the followers get its drafts). What TP still refuses (offline and
in a serving worker) is named."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pdserve.engine.core.config import ConfigError, SpecConfig
from pdserve.engine.core.engine_args import EngineArgs
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.dist.config import ParallelConfig
from pdserve.engine.dist.rank import engine_args_of, follower_argv
from pdserve.engine.llm import LLM

from tests.engine.hf_families import BLOCK, prompt, save_checkpoint

pytest.importorskip("transformers")

# block size 4 and an 8-token budget: prompts cross blocks, prefill chunks share steps with
# verify steps (catch-up rows of a chunk beside a verify's accepted rows)
ARGS = dict(device="cpu", dtype="float32", block_size=BLOCK, num_blocks=128,
            max_num_batched_tokens=8)
PROMPTS = [prompt(n, 50 + n) for n in (6, 13, 9)]
HIDDEN = 64  # tests/engine/hf_families.py's hidden_size


def drafting_mtp_layer(family: str, folder: Path) -> None:
    """Make the checkpoint's random MTP layer draft something the target accepts: its
    hidden half of eh_proj (MiMo: input_proj) the identity, hnorm and the final norm unit,
    the token half, o_proj and down_proj (every expert's) scaled by 0.05. The layer then
    drafts about the target's own prediction at t (token t + 1: accepted where the target
    repeats a token), while every part of it (embedding, attention, MoE, collectives) still
    adds to the result."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    n = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    prefix = "model.mtp_layers.0." if family == "mimo" else f"model.layers.{n}."
    h = HIDDEN
    hid, tok = (slice(0, h), slice(h, 2 * h)) if family == "mimo" else (slice(h, 2 * h),
                                                                          slice(0, h))
    for name, t in tensors.items():
        leaf = name.removeprefix(prefix)
        if leaf == name:
            continue
        if leaf in ("eh_proj.weight", "input_proj.weight"):
            t[:, tok] *= 0.05
            t[:, hid] = torch.eye(h)
        elif leaf in ("hnorm.weight", "hidden_layernorm.weight", "shared_head.norm.weight",
                      "final_layernorm.weight"):
            t.fill_(1.0)
        elif "o_proj" in leaf or "down_proj" in leaf:
            t *= 0.05
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module", params=["glm4_moe", "mimo"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp(f"{request.param}-tp-mtp")
    save_checkpoint(request.param, folder, mtp=True)
    drafting_mtp_layer(request.param, folder)
    return folder


def _run(folder: Path, tp: int, k: int | None, n: int = 12, temperature: float = 0.0,
         **args: object) -> tuple[list[list[int]], tuple[int, int, int] | None]:
    """(tokens per prompt, (verifies, drafts, accepted) or None without MTP)."""
    spec = None if k is None else SpecConfig(num_speculative_tokens=k, batch_k_caps=())
    params = SamplingParams(max_tokens=n, temperature=temperature, ignore_eos=True, seed=7)
    with LLM(str(folder), tensor_parallel_size=tp, speculative=spec, **ARGS, **args) as llm:
        out = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, params)]
        s = llm.engine.spec_stats
        return out, None if s is None else (s.num_drafts, s.num_draft_tokens,
                                            s.num_accepted_tokens)


@pytest.mark.parametrize("k", [1, 2])
def test_tp2_greedy_with_mtp_equals_tp1(checkpoint: Path, k: int) -> None:
    want, _ = _run(checkpoint, 1, None)
    ref, ref_stats = _run(checkpoint, 1, k)
    got, stats = _run(checkpoint, 2, k)
    assert ref == want and got == want
    assert all(len(t) == 12 for t in got)
    # the same drafts made and accepted as at TP 1 (the cross-rank argmax of the MTP head)
    assert stats == ref_stats
    assert stats[1] > 0 and stats[2] > 0, stats


def test_tp2_sampled_requests_draft_from_rank0(checkpoint: Path) -> None:
    """Random requests: rank 0 draws each draft from its own generators and shares the ids;
    the output is TP 1's (the same draws, logits equal to within all-gather rounding)."""
    ref, ref_stats = _run(checkpoint, 1, 2, n=8, temperature=0.8)
    got, stats = _run(checkpoint, 2, 2, n=8, temperature=0.8)
    assert got == ref
    assert stats[1] > 0 and stats == ref_stats


def test_tp2_mtp_with_overlapped_decode(checkpoint: Path) -> None:
    """overlap_decode='on' beside MTP at TP 2: steps that draft verify as before (nothing is
    launched ahead from them without static drafting), the output is TP 1's."""
    want, _ = _run(checkpoint, 1, None)
    got, stats = _run(checkpoint, 2, 1, overlap_decode="on")
    assert got == want and stats[1] > 0


def _remote_drafts(folder: Path, tp: int) -> tuple[list[int], list[int]]:
    """(the drafts the engine made after the first token, the drafts propose_remote makes
    from the step's shipped pre-norm hidden state: a decode worker's first drafts)."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    spec = SpecConfig(num_speculative_tokens=2, batch_k_caps=())
    with LLM(str(folder), tensor_parallel_size=tp, speculative=spec, **ARGS) as llm:
        engine = llm.engine
        engine.keep_hidden = True  # as a prefill worker
        [rid] = engine.add_request(PROMPTS[1], params)
        hidden = None
        while hidden is None:
            hidden = next((o.hidden for o in engine.step() if o.hidden is not None), None)
        own = engine.scheduler.spec_tokens[rid]
        req = engine.scheduler.get_request(rid)
        return own, engine.runner.propose_remote(req, hidden, 2)


def test_tp2_drafts_from_a_shipped_hidden_state(checkpoint: Path) -> None:
    """A decode worker drafts its first tokens from the prefill worker's hidden state: rank
    0's own rows, shared with the followers (the MTP message's SHARED_HIDDEN); the drafts
    are the ones the engine made from its forward's rows, and TP 1's."""
    own, remote = _remote_drafts(checkpoint, 2)
    assert len(remote) == 2 and remote == own
    assert _remote_drafts(checkpoint, 1) == (own, remote)


def test_spec_config_reaches_the_follower_and_refusals_name_the_field() -> None:
    spec = SpecConfig(num_speculative_tokens=2, batch_k_caps=((4, 2), (8, 1)))
    args = EngineArgs(model="x", tensor_parallel_size=2, speculative=spec)
    argv = follower_argv(args, ParallelConfig(2, 1, "gloo", "tcp://127.0.0.1:1"))
    assert engine_args_of(json.loads(argv[-2])) == args
    from pdserve.engine.dist.rank import check_tp_args

    check_tp_args(args)  # MTP runs at TP 2: offline and in a serving worker
    check_tp_args(args.replace(use_cuda_graphs=True))  # graphs too (GpuWatchdog bounds them)
    for bad, field in ((dict(draft_vocab=16), "draft_vocab"),
                       (dict(speculative=SpecConfig(draft_graphs="on")),
                        "speculative.draft_graphs")):
        with pytest.raises(ConfigError, match=f"^{field}"):
            check_tp_args(args.replace(**bad))

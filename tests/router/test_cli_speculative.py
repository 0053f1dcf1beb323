"""`--speculative mtp [--num-speculative-tokens K] [--mtp-head PATH]` on `pdserve generate` and
`pdserve serve`: parse errors name the flag, WorkerConfig validates the fields, serve hands
the setting to every worker (prefill included), and greedy output is unchanged."""
from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

from pdserve.engine.core.engine_args import EngineArgs
from pdserve.engine.spec.mtp_head import HEADS_DIR
from pdserve.router.cli import main
from pdserve.worker.config import WorkerConfig

from tests.cluster_secret import SECRET
from tests.router.harness import REPO

HEAD = HEADS_DIR / "smollm2-135m-instruct.safetensors"
QUESTION = "What is the capital of France?"


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "pdserve.router.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("args, flag", [
    (["--speculative", "eagle"], "--speculative"),
    (["--speculative", "mtp", "--num-speculative-tokens", "0"], "--num-speculative-tokens"),
    (["--speculative", "mtp", "--num-speculative-tokens", "17"], "--num-speculative-tokens"),
    (["--speculative", "mtp", "--num-speculative-tokens", "two"], "--num-speculative-tokens"),
    (["--num-speculative-tokens", "2"], "--num-speculative-tokens"),
    (["--mtp-head", str(HEAD)], "--mtp-head"),
    (["--speculative", "mtp", "--mtp-head", "/no/such/head.safetensors"], "--mtp-head"),
    (["--draft-vocab", "4096"], "--draft-vocab"),
    (["--speculative", "mtp", "--draft-vocab", "-1"], "--draft-vocab"),
    (["--speculative", "mtp", "--draft-vocab", "many"], "--draft-vocab"),
    (["--device", "gpu"], "--device"),
])
def test_bad_speculative_flags_name_the_flag(command, args, flag, capsys) -> None:
    argv = [command, *(["hello"] if command == "generate" else []), *args]
    try:  # argparse exits on a parse error; the later checks return 2
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and flag in err, err


@pytest.mark.parametrize("kw, field", [
    (dict(speculative="eagle"), "speculative"),
    (dict(speculative="mtp", num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(speculative="mtp", num_speculative_tokens=17), "num_speculative_tokens"),
    (dict(speculative="mtp", num_speculative_tokens=True), "num_speculative_tokens"),
    (dict(num_speculative_tokens=2), "num_speculative_tokens"),
    (dict(mtp_head="/x.safetensors"), "mtp_head"),
    (dict(speculative="mtp", mtp_head=""), "mtp_head"),
    (dict(draft_vocab=4096), "draft_vocab"),
    (dict(speculative="mtp", draft_vocab=-1), "draft_vocab"),
    (dict(speculative="mtp", draft_vocab="4096"), "draft_vocab"),
])
def test_engine_args_name_the_bad_field(kw, field) -> None:
    """The one place speculative settings are validated; WorkerConfig embeds the result."""
    with pytest.raises(ValueError, match=f"^{field}:"):
        EngineArgs(**kw)
    with pytest.raises(ValueError, match=f"^{field}:"):
        WorkerConfig.of("decode", "d0", SECRET, **kw)
    cfg = WorkerConfig(role="decode", worker_id="d0", cluster_secret=SECRET, engine=EngineArgs(
        speculative="mtp", num_speculative_tokens=3, mtp_head=str(HEAD)))
    assert (cfg.engine.speculative, cfg.engine.num_speculative_tokens) == ("mtp", 3)
    # default off
    assert WorkerConfig(role="prefill", worker_id="p0", cluster_secret=SECRET).engine.speculative is None


def test_serve_gives_every_worker_the_speculative_setting(monkeypatch) -> None:
    """Prefill workers too: they run the MTP layer over the prompt so its KV travels."""
    import ray

    import pdserve.worker.actor
    from pdserve.router.cli import build_parser
    from pdserve.router.launch import _launch_workers
    from pdserve.router.serve_args import check_serve_args as _check

    launched: list[WorkerConfig] = []
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2})
    monkeypatch.setattr(pdserve.worker.actor, "launch_worker",
                        lambda cfg, **kw: launched.append(cfg) or types.SimpleNamespace())
    args = build_parser().parse_args(["serve", "--prefill", "2", "--decode", "1", "--speculative",
                                      "mtp", "--num-speculative-tokens", "3", "--mtp-head",
                                      os.path.relpath(HEAD), "--draft-vocab", "16384",
                                      "--scheduling-policy", "priority", "--no-warmup"])
    assert _check(args) is None
    _launch_workers(args, SECRET)
    assert sorted(c.role for c in launched) == ["decode", "prefill", "prefill"]
    assert {c.cluster_secret for c in launched} == {SECRET}  # one credential for the cluster
    assert SECRET not in repr(launched[0])  # and it never shows in a log line
    assert {(c.engine.speculative, c.engine.num_speculative_tokens, c.engine.mtp_head,
             c.engine.draft_vocab) for c in launched} == {("mtp", 3, str(HEAD), 16384)}
    assert {(c.engine.scheduling_policy, c.engine.warmup) for c in launched} == {
        ("priority", False)}  # the same policy on both halves of the split
    # (an absolute head path: Ray workers may run elsewhere)
    launched.clear()
    args = build_parser().parse_args(["serve"])
    assert _check(args) is None
    _launch_workers(args, SECRET)
    assert {(c.engine.speculative, c.engine.num_speculative_tokens, c.engine.mtp_head,
             c.engine.scheduling_policy, c.engine.warmup)
            for c in launched} == {(None, None, None, "fcfs", True)}


def test_serve_refuses_a_head_of_another_model_before_starting_workers() -> None:
    res = cli("serve", "--model", "tiny-qwen3", "--speculative", "mtp", "--mtp-head", str(HEAD),
              timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "mtp_head" in res.stderr and "another model" in res.stderr
    assert "launched" not in res.stdout  # no Ray, no workers


@pytest.mark.slow
def test_generate_speculative_greedy_equals_plain() -> None:
    """`pdserve generate --speculative mtp --chat ...` (the shipped SmolLM2 head) prints what
    plain greedy decoding prints."""
    common = ["generate", "--device", "cpu", "--max-tokens", "48", "--chat", QUESTION]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", "pdserve.router.cli", *common, *extra], cwd=REPO,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for extra in ([], ["--speculative", "mtp", "--num-speculative-tokens", "2"])]
    # both at once: loading the model dominates, and it is single-threaded
    outs = [p.communicate(timeout=300) for p in procs]
    plain, spec = (subprocess.CompletedProcess(p.args, p.returncode, *o)
                   for p, o in zip(procs, outs))
    assert plain.returncode == 0 and spec.returncode == 0, plain.stderr + spec.stderr
    assert "Paris" in plain.stdout
    assert spec.stdout == plain.stdout

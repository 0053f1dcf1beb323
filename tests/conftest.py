"""Shared pytest setup: the `gpu` marker skips without CUDA; work units for pytest-xdist.

CI runs the suite on 2 pytest-xdist workers (`-n 2 --dist loadfile --no-loadscope-reorder`,
README.md's test command). Two settings there keep the two workers from starving each
other: OMP_NUM_THREADS=1 (two busy processes with 2 torch threads each on 2 cores spin
against each other: 5x slower) and RAY_worker_niceness=0 (Ray starts its workers at nice
15, so a cluster's workers got almost no CPU while the other test process computed, and
missed their deadlines). xdist hands out work by group (group_of):
- each test file is a group of its own, so a module's fixtures (a served cluster, a loaded
  model, a Prometheus) are built once, on one worker, as in a serial run;
- the files that use the test process's own Ray instance (RAY_FILES: they call
  tests.workers.cluster's start_ray) form one group, so one Ray instance serves them all,
  started once (a file missing from the list still passes: its worker starts a Ray instance
  of its own, which runs beside the other one);
- the longest groups are handed out first (SLOWEST_FIRST), so the run does not end with one
  worker busy on a long file while the other idles.
The same order is used without xdist. (xdist's own `--dist loadgroup` cannot do this here: it
tags node ids through an attribute pytest 9.2 no longer reads, so its groups are ignored.)
"""
from __future__ import annotations

import pytest

from pdserve.kernels.triton_mode import select_triton_mode

# Test setup is an entry point: Triton's CPU interpreter must be chosen before anything
# imports triton, and importing pdserve never chooses it (kernels/triton_mode.py).
select_triton_mode()

RAY_GROUP = "ray-in-process"
RAY_FILES = frozenset({
    "tests/dist/test_tp_group_ray.py",
    "tests/workers/test_disagg.py",
    "tests/workers/test_stall_restart.py",
    "tests/workers/test_stress.py",
    "tests/workers/test_tp_disagg.py",
    "tests/workers/test_tp_spec_serving.py",
})
# The groups that take longest on 2 CPU cores, longest first (measured 2026-11-25; the
# order only changes the run's wall time, never which tests run). The others follow in
# collection order.
SLOWEST_FIRST = (
    RAY_GROUP,
    "tests/router/test_e2e_failover.py",
    "tests/engine/test_engine.py",
    "tests/router/test_e2e_serve.py",
    "tests/engine/test_spec_decode_smollm.py",
    "tests/engine/test_draft_vocab.py",
    "tests/engine/test_overlap.py",
    "tests/router/test_e2e_continuation.py",
    "tests/dist/test_tp_engine.py",
    "tests/engine/test_mtp.py",
    "tests/deploy/test_cluster_observability.py",
    "tests/workers/test_tp_failover.py",
    "tests/engine/test_mtp_checkpoint.py",
    "tests/engine/test_spec_overlap.py",
)


@pytest.fixture(scope="session")
def hf_smollm2_dir(tmp_path_factory: pytest.TempPathFactory):
    """transformers' model + tokenizer of the embedded SmolLM2 GGUF, saved once per run
    (tests/hf_smollm2.py): load them with from_pretrained(this folder)."""
    from tests.hf_smollm2 import converted_dir

    return converted_dir(tmp_path_factory)


def group_of(nodeid: str) -> str:
    """A test's work unit: RAY_GROUP for the RAY_FILES, else its file."""
    path = nodeid.split("::", 1)[0]
    return RAY_GROUP if path in RAY_FILES else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadfile`, with group_of's units in place of plain files."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class GroupScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _skip_gpu_tests(items)
    _order_by_group(items)


def _skip_gpu_tests(items: list[pytest.Item]) -> None:
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _order_by_group(items: list[pytest.Item]) -> None:
    """Group by group: SLOWEST_FIRST's first, the others in the order they were collected
    (each group's tests keep their order). xdist takes its work queue from this order."""
    groups = [group_of(item.nodeid) for item in items]
    first_seen: dict[str, int] = {}
    for group in groups:
        first_seen.setdefault(group, len(first_seen))
    rank = {g: i for i, g in enumerate(SLOWEST_FIRST)}
    order = sorted(range(len(items)), key=lambda i: (rank.get(groups[i], len(rank)),
                                                     first_seen[groups[i]], i))
    items[:] = [items[i] for i in order]

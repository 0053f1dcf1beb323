"""What `pip install pdserve` puts into site-packages: one import name, `pdserve`, holding every
installed module, and nothing that shadows another distribution (Hugging Face's `kernels`,
PyPI's `router`, proto-plus's `proto`)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.package.import_graph import REPO, module_name, read_graph, source_files


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    # build from a copy: pip builds in the source tree, and a build/ left in the checkout
    # would carry stale modules into later wheels
    src = tmp_path_factory.mktemp("src") / "pdserve"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", "results", ".pytest_cache"))
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                          str(out), str(src)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    [path] = out.glob("pdserve-*.whl")
    return zipfile.ZipFile(path)


def test_wheel_has_exactly_one_top_level_name(wheel: zipfile.ZipFile) -> None:
    names = [n for n in wheel.namelist() if ".dist-info/" not in n]
    assert {n.split("/")[0] for n in names} == {"pdserve"}
    top_level = [n for n in wheel.namelist() if n.endswith(".dist-info/top_level.txt")]
    if top_level:  # setuptools writes it; it must name pdserve alone
        assert wheel.read(top_level[0]).decode().split() == ["pdserve"]


def test_wheel_holds_every_installed_module_and_no_lab_script(wheel: zipfile.ZipFile) -> None:
    files = set(wheel.namelist())
    expected = {p.relative_to(REPO).as_posix() for p in source_files()}
    missing = sorted(e for e in expected if f"pdserve/{e}" not in files)
    assert missing == []  # a package left out of pyproject's list would show here
    assert "pdserve/__init__.py" in files
    assert not any(n.startswith(("pdserve/bench/lab/", "pdserve/tests/")) for n in files)
    for data in ("pdserve/proto/pdserve.proto",
                 "pdserve/engine/mtp_heads/smollm2-135m-instruct.safetensors"):
        assert data in files
    py = {n for n in files if n.endswith(".py")}
    assert py == {f"pdserve/{e}" for e in expected}  # nothing else, e.g. bench/lab


def test_module_names_follow_the_folders() -> None:
    assert module_name(REPO / "engine" / "core" / "scheduler.py") == \
        "pdserve.engine.core.scheduler"
    assert module_name(REPO / "kernels" / "__init__.py") == "pdserve.kernels"


def _run(code: str, cwd: Path, env: dict[str, str] | None = None) -> str:
    res = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                         timeout=300, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def test_hf_kernels_pdserve_and_transformers_in_one_environment(tmp_path: Path) -> None:
    """Hugging Face's `kernels` (which transformers looks for) and pdserve's kernels are two
    packages now. Run from a neutral directory, as an installed pdserve is used."""
    out = _run("import kernels, pdserve.kernels, transformers, pdserve.kernels.reference\n"
               "print(kernels.__file__); print(pdserve.kernels.__file__)\n"
               "print(hasattr(kernels, 'get_kernel'))", tmp_path)
    hf, ours, has_get_kernel = out.split()
    assert Path(ours).parent == REPO / "kernels"
    assert Path(hf).parent != REPO / "kernels" and has_get_kernel == "True"


def test_public_api_and_generated_grpc_code(tmp_path: Path) -> None:
    out = _run("from pdserve import LLM, SamplingParams\n"
               "import pdserve.proto.pdserve_pb2_grpc as g, sys\n"
               "print(LLM.__module__, SamplingParams.__module__)\n"
               "print(sorted(m for m in sys.modules if m.split('.')[0] in "
               "('engine', 'kernels', 'router', 'proto', 'worker')))", tmp_path)
    modules, leaked = out.strip().split("\n")
    assert modules == "pdserve.engine.llm pdserve.engine.core.sampling_params"
    assert leaked == "[]"  # nothing imported under the old top-level names


def test_importing_every_module_leaves_the_environment_unchanged(tmp_path: Path) -> None:
    """Triton's interpreter is chosen by an explicit call (kernels/triton_mode.py), never as a
    side effect of an import. Third-party packages are imported first: their own import-time
    settings (`import ray` sets RAY_CLIENT_MODE) are theirs, not pdserve's."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    mods = read_graph()
    names = sorted(mods)
    third = sorted({i.split(".")[0] for m in mods.values() for i in m.imports
                    if not i.startswith("pdserve") and i.split(".")[0] != "triton"})
    code = ("import importlib, os, sys, json\n"
            f"for name in {third!r}:\n"
            "    try:\n"
            "        importlib.import_module(name)\n"
            "    except ImportError:\n"
            "        pass\n"
            "before = dict(os.environ)\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            "after = dict(os.environ)\n"
            "changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))\n"
            "print(json.dumps([len(sys.modules), 'triton' in sys.modules, changed]))")
    count, triton_imported, changed = json.loads(_run(code, tmp_path, env))
    assert count > len(names) and triton_imported  # the kernels were imported too
    assert changed == []


def test_select_triton_mode_is_the_explicit_switch(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = _run("import os, torch\n"
               "from pdserve.kernels.triton_mode import select_triton_mode\n"
               "assert 'TRITON_INTERPRET' not in os.environ\n"
               "print(select_triton_mode(), os.environ.get('TRITON_INTERPRET'), "
               "torch.cuda.is_available())\n"
               "from pdserve.kernels import _triton\n"
               "print(_triton.interpreting(), _triton.interpreter_problem())", tmp_path, env)
    first, second = out.strip().split("\n")
    if first.endswith("False"):  # no CUDA: the interpreter, usable
        assert first == "True 1 False" and second == "True None"
    else:  # a GPU machine: compiled kernels
        assert first == "False None True" and second == "False None"

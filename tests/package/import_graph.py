"""pdserve's module import graph, read from the source (ast), imports inside functions and
under TYPE_CHECKING included: what tests/package/test_import_graph.py checks."""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# the folders installed as pdserve.<name> (pyproject [tool.setuptools] packages)
SUBPACKAGES = ("bench", "decode_worker", "engine", "kernels", "kv_transfer", "prefill_worker",
               "proto", "router", "worker")
NOT_INSTALLED = ("bench/lab",)  # lab scripts stay in the repository only


@dataclass
class Module:
    name: str  # pdserve.engine.core.config
    path: Path
    imports: set[str] = field(default_factory=set)  # every dotted name imported, resolved


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["pdserve", *parts])


def source_files() -> list[Path]:
    files = [REPO / "__init__.py"]
    for sub in SUBPACKAGES:
        for p in sorted((REPO / sub).rglob("*.py")):
            rel = p.relative_to(REPO).as_posix()
            if not rel.startswith(NOT_INSTALLED):
                files.append(p)
    return files


def _imported_names(tree: ast.AST, name: str, is_package: bool) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)  # kept if it is a module
    return out


def read_graph() -> dict[str, Module]:
    mods: dict[str, Module] = {}
    for p in source_files():
        name = module_name(p)
        tree = ast.parse(p.read_text(), filename=str(p))
        mods[name] = Module(name, p, _imported_names(tree, name, p.name == "__init__.py"))
    for m in mods.values():  # pdserve names: only those that are modules; others stay
        m.imports = {i for i in m.imports if not i.startswith("pdserve") or i in mods} | \
            {i for i in m.imports if i.startswith("pdserve.") and i not in mods
             and i.rsplit(".", 1)[0] not in mods}
    return mods


def edges(mods: dict[str, Module]) -> dict[str, set[str]]:
    """pdserve module -> pdserve modules it imports (a parent package's __init__ is not an
    edge of its own: importing pdserve.engine.core.config runs pdserve/__init__, which
    imports nothing eagerly)."""
    return {n: {i for i in m.imports if i in mods and i != n} for n, m in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out

"""The arrows of docs/design.md, read from the source: router -> proto -> workers -> engine ->
kernels, workers -> kv_transfer; the engine without networking, its core without torch, and
no import cycles, imports inside functions and under TYPE_CHECKING included."""
from __future__ import annotations

import pytest

from tests.package.import_graph import cycles, edges, read_graph

MODS = read_graph()
GRAPH = edges(MODS)
WORKERS = ("pdserve.worker", "pdserve.prefill_worker", "pdserve.decode_worker")
# what each part may import of pdserve (besides itself); the first matching prefix decides
ALLOWED: list[tuple[str, tuple[str, ...]]] = [
    ("pdserve.kernels", ()),
    ("pdserve.engine.core", ()),
    ("pdserve.engine", ("pdserve.kernels", "pdserve.engine.core")),
    ("pdserve.kv_transfer", ("pdserve.engine.core",)),
    ("pdserve.proto", ("pdserve.engine.core",)),
    ("pdserve.worker", ("pdserve.proto", "pdserve.engine", "pdserve.kv_transfer",
                        "pdserve.kernels", *WORKERS)),
    ("pdserve.prefill_worker", ("pdserve.proto", "pdserve.engine", "pdserve.kv_transfer",
                                "pdserve.worker")),
    ("pdserve.decode_worker", ("pdserve.proto", "pdserve.engine", "pdserve.kv_transfer",
                               "pdserve.worker")),
    # the router reaches workers through proto; it imports pdserve.worker only to launch them
    ("pdserve.router", ("pdserve.proto", "pdserve.engine", "pdserve.kv_transfer",
                        "pdserve.kernels.triton_mode", "pdserve.worker")),
    ("pdserve.bench", ()),
    ("pdserve", ("pdserve.engine",)),  # the package face: LLM, SamplingParams (lazily)
]
NETWORKING = ("grpc", "ray", "nixl", "fastapi", "uvicorn", "starlette", "httpx")


def _part(name: str) -> str:
    for prefix, _ in ALLOWED:
        if name == prefix or name.startswith(prefix + "."):
            return prefix
    raise AssertionError(f"{name}: in no part of the layering table")


def _allowed(src: str, dst: str) -> bool:
    part = _part(src)
    if _part(dst) == part:
        return True
    return any(dst == a or dst.startswith(a + ".") for a in dict(ALLOWED)[part])


def test_graph_covers_the_package() -> None:
    assert len(MODS) > 100
    assert "pdserve.engine.core.scheduler" in MODS and "pdserve.bench.lab" not in str(MODS)


def test_arrows_point_one_way() -> None:
    bad = sorted(f"{s} -> {d}" for s, ds in GRAPH.items() for d in ds if not _allowed(s, d))
    assert bad == []


def test_router_reaches_workers_only_to_launch_them() -> None:
    users = sorted(s for s, ds in GRAPH.items() if s.startswith("pdserve.router.")
                   and any(d.startswith(WORKERS) for d in ds))
    assert users == ["pdserve.router.launch"]


def test_no_cycles() -> None:
    assert cycles(GRAPH) == []


def _third_party(name: str) -> set[str]:
    return {i.split(".")[0] for i in MODS[name].imports if not i.startswith("pdserve")}


@pytest.mark.parametrize("prefix, banned", [
    ("pdserve.engine", NETWORKING),
    ("pdserve.engine.core", ("torch", "triton", "numpy")),
    ("pdserve.kernels", NETWORKING),
])
def test_third_party_imports(prefix: str, banned: tuple[str, ...]) -> None:
    bad = sorted(f"{n}: {sorted(_third_party(n) & set(banned))}" for n in MODS
                 if (n == prefix or n.startswith(prefix + ".")) and _third_party(n) & set(banned))
    assert bad == []


def test_the_checker_sees_imports_inside_functions() -> None:
    # engine/model/layers.py imports the kernels only inside fused_kernels()
    assert "pdserve.kernels.ops" in GRAPH["pdserve.engine.model.layers"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]

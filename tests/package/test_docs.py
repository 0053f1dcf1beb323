"""docs/ is the map of the repository: every file it names exists, and README points to it."""
from __future__ import annotations

import re

import pytest

from tests.package.import_graph import REPO

PATH = re.compile(r"`([A-Za-z0-9_./-]+)`")


def named_paths(doc: str) -> list[str]:
    """Backticked names that are paths: contain a '/' or end in '.py' (commands, flags and
    module names like pdserve.engine are not)."""
    text = (REPO / doc).read_text()
    names = [m.group(1) for m in PATH.finditer(text)]
    return sorted({n.rstrip("/") for n in names if "/" in n or n.endswith(".py")})


@pytest.mark.parametrize("doc", ["docs/request_flow.md", "docs/design.md"])
def test_every_path_a_doc_names_exists(doc: str) -> None:
    paths = named_paths(doc)
    assert len(paths) >= 10
    missing = [p for p in paths if not (REPO / p).exists()]
    assert missing == []


def test_request_flow_has_at_most_ten_stops() -> None:
    text = (REPO / "docs" / "request_flow.md").read_text()
    stops = re.findall(r"^#{2,3} *(\d+)[.)]", text, flags=re.M) or \
        re.findall(r"^(\d+)\. ", text, flags=re.M)
    assert 3 <= len(stops) <= 10, stops


def test_readme_links_docs_not_shared() -> None:
    readme = (REPO / "README.md").read_text()
    assert "docs/design.md" in readme and "docs/request_flow.md" in readme
    assert "../shared" not in readme

"""Fixtures for router tests: the embedded model's frontend (tokenizer + config, no weights)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def frontend():
    from pdserve.router.frontend import load_frontend

    return load_frontend(None)

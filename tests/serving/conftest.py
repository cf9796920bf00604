"""Fixtures for serving tests (helpers live in servinghelp.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from servinghelp import BackendProcess


@pytest.fixture
def backend_procs() -> Iterator[list[BackendProcess]]:
    """A list to put BackendProcess objects in; all are stopped afterwards."""
    procs: list[BackendProcess] = []
    yield procs
    for p in procs:
        p.stop()

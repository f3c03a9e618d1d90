"""What the operator-view tests share: a scratch store of each kind (`store`)."""

from __future__ import annotations

import pytest

from tests.gateway.sessions.support import ScratchStore, pg_available

STORES = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
]


@pytest.fixture(params=STORES)
def store(request, tmp_path):
    """A fresh SQLite file, or a PostgreSQL schema of its own (skipped without PostgreSQL)."""
    if request.param == "postgres" and not pg_available():
        pytest.skip("PostgreSQL is not running on 127.0.0.1:5432")
    s = ScratchStore(request.param, tmp_path)
    yield s
    s.drop()

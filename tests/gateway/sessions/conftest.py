"""One gateway per store kind (SQLite file, PostgreSQL schema), with auth on; both
run every test."""

from __future__ import annotations

import pytest

from tests.gateway.sessions.support import (
    MASTER_KEY,
    ScratchStore,
    create_key,
    gateway_config,
    pg_available,
    start_gateway,
)

STORES = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
]


@pytest.fixture(scope="module", params=STORES)
def store(request, tmp_path_factory):
    if request.param == "postgres" and not pg_available():
        pytest.skip("PostgreSQL is not running on 127.0.0.1:5432")
    s = ScratchStore(request.param, tmp_path_factory.mktemp(request.param))
    yield s
    s.drop()


@pytest.fixture(scope="module")
def gw(upstreams, store, tmp_path_factory):
    server = start_gateway(gateway_config(upstreams, store, tmp_path_factory.mktemp("state")))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def key_a(gw):
    return create_key(gw.url, name="alice")["key"]


@pytest.fixture(scope="module")
def key_b(gw):
    return create_key(gw.url, name="bob")["key"]


@pytest.fixture(scope="module")
def master():
    return MASTER_KEY

"""Fixtures for flashstack.cuda tests: a fresh fake driver per test, the leak-check fixture."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from flashstack.cuda import use_backend
from tests.fakes.cuda_driver import FakeBackend
from tests.fakes.cuda_leak_check import cuda_leak_check  # noqa: F401  (re-exported fixture)


@pytest.fixture
def fake() -> Iterator[FakeBackend]:
    """A fresh fake driver installed as the backend for the test."""
    backend = FakeBackend()
    with use_backend(backend):
        yield backend

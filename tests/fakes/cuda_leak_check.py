"""pytest fixture `cuda_leak_check`: fails a test that leaves flashstack.cuda resources alive."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from flashstack.cuda import tracker


@pytest.fixture
def cuda_leak_check() -> Iterator[None]:
    """Fail the test if any resource it created is still alive after it and a gc.collect()."""
    leak = None
    try:
        with tracker.leak_check():
            yield
    except tracker.LeakError as exc:
        leak = str(exc)
    if leak is not None:  # outside the except block, so the report is not a chained traceback
        pytest.fail(f"test leaked CUDA resources:\n{leak}", pytrace=False)

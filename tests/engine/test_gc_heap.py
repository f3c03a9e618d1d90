"""The start-up heap is frozen out of the collector's reach."""

from __future__ import annotations

import gc

from flashstack.engine.gc_heap import freeze_startup_heap


def test_freeze_moves_the_live_heap_out_of_collections() -> None:
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() > 10_000  # torch's modules and the test session
        assert sum(gc.get_count()) < 10  # nothing left in the young generations
    finally:
        gc.unfreeze()

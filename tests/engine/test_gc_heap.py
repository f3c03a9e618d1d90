"""The start-up heap is frozen out of the collector's reach."""

from __future__ import annotations

import gc
import weakref

from flashstack.engine.gc_heap import freeze_startup_heap


class _Node:
    me: _Node


def test_freeze_collects_then_moves_the_live_heap_out_of_collections() -> None:
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    garbage = _Node()
    garbage.me = garbage  # a cycle only the collector frees
    dead = weakref.ref(garbage)
    del garbage
    live = _Node()
    live.me = live
    try:
        freeze_startup_heap()
        assert dead() is None  # collected first, not frozen with the rest
        assert gc.get_freeze_count() > 10_000  # torch's modules and the test session
        # in no generation: what other threads allocate meanwhile does not matter to the check
        assert not any(o is live for g in range(3) for o in gc.get_objects(g))
    finally:
        gc.unfreeze()

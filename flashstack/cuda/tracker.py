"""Live-resource tracker: counts by kind and creation site, leak reports, a leak check."""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True, slots=True)
class Record:
    """One live resource: its kind, the caller's file:line, and (opt-in) the full stack."""

    kind: str
    site: str
    stack: str | None


class LeakError(AssertionError):
    """Resources created inside a leak check were still alive at its end."""


_lock = threading.Lock()
_live: dict[int, Record] = {}
_ids = itertools.count(1)
_capture_stacks = os.environ.get("FLASHSTACK_CUDA_TRACK_STACKS", "") == "1"


def capture_stacks(enabled: bool = True) -> None:
    """Record a full creation stack for each resource (costs ~10 µs per creation)."""
    global _capture_stacks
    _capture_stacks = enabled


def _site() -> str:
    """The first frame outside flashstack/cuda: where the user created the resource."""
    frame = sys._getframe(2)
    while frame is not None and os.path.dirname(frame.f_code.co_filename) == _PACKAGE_DIR:
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def register(kind: str) -> int:
    """Record a new live resource; returns the token that unregisters it."""
    stack = "".join(traceback.format_stack()[:-2]) if _capture_stacks else None
    record = Record(kind, _site(), stack)
    with _lock:
        token = next(_ids)
        _live[token] = record
    return token


def unregister(token: int) -> None:
    """Forget a released resource; unknown tokens are ignored (release paths are idempotent)."""
    with _lock:
        _live.pop(token, None)


def live() -> dict[str, int]:
    """Number of live resources by kind."""
    with _lock:
        return dict(Counter(r.kind for r in _live.values()))


def live_by_site() -> dict[tuple[str, str], int]:
    """Number of live resources by (kind, creation site)."""
    with _lock:
        return dict(Counter((r.kind, r.site) for r in _live.values()))


def total() -> int:
    """Number of live resources of every kind."""
    with _lock:
        return len(_live)


def report(since: int = 0) -> str:
    """Human-readable list of live resources (created after token `since`), grouped by site."""
    with _lock:
        records = [r for t, r in _live.items() if t > since]
    if not records:
        return "no live CUDA resources"
    lines = [f"{len(records)} live CUDA resource(s):"]
    for (kind, site), n in Counter((r.kind, r.site) for r in records).most_common():
        lines.append(f"  {n:6d} x {kind:<12} created at {site}")
    stacks = [r.stack for r in records if r.stack]
    if stacks:
        lines.append("first creation stack:\n" + stacks[0])
    return "\n".join(lines)


@contextlib.contextmanager
def leak_check() -> Iterator[None]:
    """Raise LeakError if resources created inside the block are alive after a gc.collect()."""
    import gc

    with _lock:
        start = next(_ids)
    yield
    gc.collect()
    with _lock:
        leaked = [t for t in _live if t > start]
    if leaked:
        raise LeakError(report(since=start))

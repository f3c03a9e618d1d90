"""A one-writer, many-reader ring of fixed-size int64 messages in shared memory.

Rank 0 posts every step's header here; the other ranks poll it. A rank that starts its step late
holds up rank 0's first collective, so the header should arrive with no wake-up through the
network stack (as a gloo broadcast over TCP has) and with no timeout while a server idles.

Layout (int64): [write count, read count of reader 1..N-1, pad to 8] then `slots` messages of
`width` values. The writer fills a slot and only then bumps the write count; a reader copies the
slot and only then bumps its read count; the writer never laps the slowest reader.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

_HEAD = 8  # write count, up to 7 read counts
_fence_lock = threading.Lock()


def _fence() -> None:
    # A lock round trip is an atomic read-modify-write: a full memory barrier on every CPU Python
    # runs on, so the slot's stores are visible before the count's (x86 keeps that order anyway).
    with _fence_lock:
        pass


def _check_readers(num_readers: int) -> None:
    if num_readers >= _HEAD:
        raise ValueError(f"at most {_HEAD - 1} readers (tensor_parallel_size ≤ {_HEAD})")


class Mailbox:
    """The shared ring; `create` on rank 0, `attach` on the other ranks (by path)."""

    def __init__(self, path: Path, num_readers: int, width: int, slots: int, owner: bool) -> None:
        _check_readers(num_readers)
        self.path, self.width, self.slots, self.owner = path, width, slots, owner
        size = (_HEAD + width * slots) * 8
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        words = np.frombuffer(self._map, dtype=np.int64)
        self._counts = words[:_HEAD]
        self._ring = words[_HEAD:].reshape(slots, width)
        self.num_readers = num_readers

    @classmethod
    def create(cls, num_readers: int, width: int, slots: int = 16) -> Mailbox:
        """A new zeroed ring in shared memory (/dev/shm where it exists)."""
        _check_readers(num_readers)
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, name = tempfile.mkstemp(prefix="flashstack-tp-", dir=folder)
        try:
            os.ftruncate(fd, (_HEAD + width * slots) * 8)
        finally:
            os.close(fd)
        return cls(Path(name), num_readers, width, slots, owner=True)

    @classmethod
    def attach(cls, path: str, num_readers: int, width: int, slots: int = 16) -> Mailbox:
        return cls(Path(path), num_readers, width, slots, owner=False)

    def post(self, values: list[int]) -> None:
        """Write one message (≤ width values; the rest of the slot keeps stale values)."""
        written = int(self._counts[0])
        backoff = _Backoff()
        while written - int(self._counts[1 : 1 + self.num_readers].min()) >= self.slots:
            backoff.wait()  # the ring is full: a reader is behind by a whole ring
        self._ring[written % self.slots, : len(values)] = values
        _fence()
        self._counts[0] = written + 1

    def take(self, reader: int) -> np.ndarray:
        """The next message for `reader` (1..num_readers), waiting as long as it takes."""
        read = int(self._counts[reader])
        backoff = _Backoff()
        while int(self._counts[0]) <= read:
            backoff.wait()
        _fence()
        message = self._ring[read % self.slots].copy()
        _fence()
        self._counts[reader] = read + 1
        return message

    def unlink(self) -> None:
        """Remove the file (the creator, once every reader has attached); mappings stay valid."""
        if self.owner:
            self.path.unlink(missing_ok=True)

    def close(self) -> None:
        """Unmap; the creator also removes the file if it is still there."""
        del self._counts, self._ring
        self._map.close()
        self.unlink()


class _Backoff:
    """Poll without sleeping for the first 50 ms (decode steps come every few ms, and even a short
    sleep would delay the step it wakes for), yielding the CPU on each poll so a busy host still
    runs everything else; then sleep up to 1 ms at a time, so an idle server's ranks cost no CPU."""

    SPIN_S = 0.05

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.sleep = 0.0

    def wait(self) -> None:
        if time.perf_counter() - self.start < self.SPIN_S:
            os.sched_yield()
            return
        self.sleep = min(0.001, self.sleep * 2 or 0.00005)
        time.sleep(self.sleep)

"""Shared lifetime machinery: explicit close() that raises, GC finalizers that only warn."""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any, ClassVar, Self

from flashstack.cuda import tracker


class CudaResourceError(RuntimeError):
    """A CUDA resource was used wrongly (closed, still in use, wrong device)."""


class ResourceClosedError(CudaResourceError):
    """The resource was closed; create a new one instead of reusing it."""


class ResourceInUseError(CudaResourceError):
    """close() was called while something that must outlive it still references it."""


class CudaResourceWarning(ResourceWarning):
    """A garbage-collected resource failed to release; the error is reported, not raised."""


Release = Callable[[], None]


def _gc_release(kind: str, release: Release, token: int, keep: object) -> None:
    """Finalizer body: release, never raise (it may run on any thread or inside gc)."""
    try:
        release()
    except BaseException as exc:  # a finalizer that raises is swallowed by Python anyway
        warnings.warn(
            f"flashstack.cuda: releasing a garbage-collected {kind} failed: {exc!r}",
            CudaResourceWarning,
            stacklevel=2,
        )
    finally:
        tracker.unregister(token)


class Resource:
    """Base of every owned CUDA resource: a context manager with close() and a GC finalizer."""

    kind: ClassVar[str] = "resource"

    def __init__(self, release: Release, keep: object = None) -> None:
        # `keep` (parents, pinned references) lives in the finalizer's arguments, so it
        # outlives the release call even when this object is collected first.
        self._token = tracker.register(self.kind)
        self._finalizer = weakref.finalize(self, _gc_release, self.kind, release, self._token, keep)
        # At interpreter exit the driver reclaims everything; calling it during teardown is
        # where crashes come from, so exit-time finalizers are skipped.
        self._finalizer.atexit = False
        self._pins = 0
        self._pin_lock = threading.Lock()

    @property
    def closed(self) -> bool:
        """True after close() or collection."""
        return not self._finalizer.alive

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise ResourceClosedError(f"this {self.kind} is closed; create a new one")

    def close(self) -> None:
        """Release now; raises if already closed, still pinned, or the driver reports an error."""
        self._check_open()
        with self._pin_lock:
            if self._pins:
                raise ResourceInUseError(
                    f"this {self.kind} is referenced by {self._pins} live executable graph(s) or "
                    "leases; close those first"
                )
        detached = self._finalizer.detach()
        if detached is None:  # collected or closed on another thread between the checks
            raise ResourceClosedError(f"this {self.kind} is closed; create a new one")
        _, _, (_, release, token, _keep), _ = detached
        try:
            release()
        finally:
            tracker.unregister(token)

    def _pin(self) -> None:
        self._check_open()
        with self._pin_lock:
            self._pins += 1

    def _unpin(self) -> None:
        with self._pin_lock:
            self._pins -= 1

    def __enter__(self) -> Self:
        self._check_open()
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if self.closed:
            return
        if exc_type is None:
            self.close()
            return
        try:  # an exception is already propagating: do not hide it behind a close() error
            self.close()
        except CudaResourceError as err:
            warnings.warn(
                f"flashstack.cuda: {self.kind} left to the garbage collector: {err}",
                CudaResourceWarning,
                stacklevel=2,
            )

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<{type(self).__name__} {state}>"


def unpin_all(resources: list[Resource]) -> None:
    """Drop the pins an executable graph held; used from close() and from finalizers."""
    for res in resources:
        res._unpin()

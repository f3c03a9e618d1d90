"""Stream and Event: owned driver objects with explicit close() and GC-safe release."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flashstack.cuda._resource import Resource
from flashstack.cuda.device import Device

if TYPE_CHECKING:
    from flashstack.cuda.graph import GraphCapture


class Stream(Resource):
    """A CUDA stream (non-blocking by default); holds its device, supports `__cuda_stream__`."""

    kind = "stream"

    def __init__(
        self, device: Device | None = None, *, nonblocking: bool = True, priority: int = 0
    ) -> None:
        self.device = device or Device(0)
        backend = self.device.backend
        with self.device:
            self._h = backend.stream_create(self.device.ordinal, nonblocking, priority)
        self.priority = priority
        self._capture: GraphCapture | None = None
        # cuStreamDestroy with pending work returns at once; the driver frees it when done.
        super().__init__(self.device.releaser(backend.stream_destroy, self._h), keep=self.device)

    @classmethod
    def borrow(cls, device: Device, raw: int, owner: object) -> Stream:
        """Wrap someone else's stream (e.g. torch's); close() forgets it, never destroys it."""
        self = cls.__new__(cls)
        self.device, self.priority, self._capture = device, 0, None
        self._h = device.backend.stream_wrap(device.ordinal, raw, owner)
        Resource.__init__(self, _noop, keep=(device, owner))
        return self

    @property
    def handle(self) -> Any:
        """The backend handle; raises if closed."""
        self._check_open()
        return self._h

    @property
    def raw(self) -> int:
        """The CUstream address as an int."""
        return self.device.backend.stream_raw(self.handle)

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.raw)

    def synchronize(self) -> None:
        """Block the host until this stream's work is done (scope: this stream only)."""
        with self.device:
            self.device.backend.stream_synchronize(self.handle)

    def wait(self, event: Event) -> None:
        """Make later work on this stream wait for `event`, without blocking the host."""
        with self.device:
            self.device.backend.stream_wait_event(self.handle, event.handle)

    def record(self, event: Event | None = None, *, timing: bool = False) -> Event:
        """Record `event` (or a new one) on this stream and return it."""
        event = event or Event(self.device, timing=timing)
        event.record(self)
        return event


class Event(Resource):
    """A CUDA event; timing off by default (cheaper), blocking sync optional."""

    kind = "event"

    def __init__(
        self, device: Device | None = None, *, timing: bool = False, blocking: bool = False
    ) -> None:
        self.device = device or Device(0)
        backend = self.device.backend
        with self.device:
            self._h = backend.event_create(self.device.ordinal, timing, blocking)
        self.timing, self.blocking = timing, blocking
        super().__init__(self.device.releaser(backend.event_destroy, self._h), keep=self.device)

    @property
    def handle(self) -> Any:
        """The backend handle; raises if closed."""
        self._check_open()
        return self._h

    def record(self, stream: Stream) -> None:
        """Capture the point reached by `stream`'s queued work."""
        with self.device:
            self.device.backend.event_record(self.handle, stream.handle)

    def synchronize(self) -> None:
        """Block the host until the recorded work is done (scope: work before the record)."""
        with self.device:
            self.device.backend.event_synchronize(self.handle)

    def query(self) -> bool:
        """True when the recorded work is done; never blocks."""
        with self.device:
            return self.device.backend.event_query(self.handle)


def elapsed_ms(start: Event, end: Event) -> float:
    """Milliseconds between two recorded timing events."""
    if not (start.timing and end.timing):
        raise ValueError("elapsed_ms needs events created with timing=True")
    with start.device:
        return start.device.backend.event_elapsed_ms(start.handle, end.handle)


def _noop() -> None:
    """Release for borrowed handles: the owner frees them."""


Event.elapsed_ms = staticmethod(elapsed_ms)  # type: ignore[attr-defined]

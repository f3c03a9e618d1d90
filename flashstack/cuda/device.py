"""Device: properties, and `with device:` that binds its primary context, then restores the
caller's."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flashstack.cuda.backend import Backend, get_backend


@dataclass(frozen=True, slots=True)
class DeviceProperties:
    """What a kernel author asks about a device."""

    name: str
    compute_capability: tuple[int, int]
    total_memory: int
    sm_count: int
    l2_cache_size: int
    # what one SM holds at once: a kernel's occupancy is bounded by each
    registers_per_sm: int
    shared_memory_per_sm: int
    threads_per_sm: int
    blocks_per_sm: int


class Device:
    """One GPU by ordinal; uses only its primary context (the one torch and cuda.core share)."""

    def __init__(self, ordinal: int = 0, backend: Backend | None = None) -> None:
        self.backend = backend or get_backend()
        count = self.backend.device_count()
        if not 0 <= ordinal < count:
            raise ValueError(
                f"device {ordinal} does not exist: this process sees {count} device(s)"
            )
        self.ordinal = ordinal
        self._saved = threading.local()  # each thread restores its own caller's context
        self._props: DeviceProperties | None = None

    @property
    def properties(self) -> DeviceProperties:
        """Static properties, read once."""
        if self._props is None:
            self._props = DeviceProperties(**self.backend.device_properties(self.ordinal))
        return self._props

    @property
    def name(self) -> str:
        """Marketing name, e.g. 'NVIDIA H200'."""
        return self.properties.name

    @property
    def compute_capability(self) -> tuple[int, int]:
        """(major, minor), e.g. (9, 0) on Hopper."""
        return self.properties.compute_capability

    @property
    def total_memory(self) -> int:
        """Device memory in bytes."""
        return self.properties.total_memory

    @property
    def sm_count(self) -> int:
        """Number of streaming multiprocessors."""
        return self.properties.sm_count

    @property
    def l2_cache_size(self) -> int:
        """L2 cache in bytes."""
        return self.properties.l2_cache_size

    def resident_blocks(self, threads: int, registers: int, shared_memory: int) -> int:
        """Blocks of a kernel (`threads` a block, `registers` a thread, `shared_memory` bytes a
        block) one SM holds at once: registers are handed out 256 a warp, from each of the SM's
        four quarters."""
        p = self.properties
        warps = -(-threads // 32)
        per_warp = -(-max(registers, 1) * 32 // 256) * 256
        quarter_warps = p.registers_per_sm // 4 // per_warp
        by_registers = 4 * quarter_warps // warps
        by_threads = p.threads_per_sm // (warps * 32)
        by_shared = p.shared_memory_per_sm // shared_memory if shared_memory else p.blocks_per_sm
        return max(0, min(by_registers, by_threads, by_shared, p.blocks_per_sm))

    @property
    def free_memory(self) -> int:
        """Free device memory in bytes right now (driver's view, all processes)."""
        with self:
            return self.backend.mem_info(self.ordinal)[0]

    def synchronize(self) -> None:
        """Wait for all work on this device."""
        with self:
            self.backend.device_synchronize(self.ordinal)

    def __enter__(self) -> Device:
        stack = self._saved.__dict__.setdefault("stack", [])
        stack.append(self.backend.ctx_get_current())
        try:
            self.backend.ctx_activate(self.ordinal)
        except BaseException:
            stack.pop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.backend.ctx_set_current(self._saved.stack.pop())

    def releaser(self, fn: Callable[..., None], *handles: Any) -> Callable[[], None]:
        """A release closure that runs `fn(*handles)` with this device's context bound."""

        def release() -> None:
            with self:
                fn(*handles)

        return release

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Device) and (other.ordinal, other.backend) == (
            self.ordinal,
            self.backend,
        )

    def __hash__(self) -> int:
        return hash((self.ordinal, id(self.backend)))

    def __repr__(self) -> str:
        return f"<Device {self.ordinal} on {self.backend.name}>"


def device_count() -> int:
    """Number of devices the driver exposes."""
    return get_backend().device_count()


_shared: dict[tuple[int, int], Device] = {}
_shared_lock = threading.Lock()


def shared_device(ordinal: int = 0) -> Device:
    """The process's Device for `ordinal` on the active backend, so that properties asked on a hot
    path (capability, SM count) are read from the driver once."""
    backend = get_backend()
    key = (id(backend), ordinal)  # the Device held here keeps its backend (and so the id) alive
    with _shared_lock:
        if key not in _shared:
            _shared[key] = Device(ordinal, backend)
        return _shared[key]

"""Modules (NVRTC-compiled or loaded cubin / PTX / fatbin), kernels, and variant selection."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from flashstack.cuda._resource import Resource, ResourceClosedError
from flashstack.cuda.device import Device
from flashstack.cuda.memory import ArrayView, DeviceBuffer, PinnedBuffer
from flashstack.cuda.stream import Stream

T = TypeVar("T")
Dim = int | tuple[int, ...]
_SUFFIX_KIND = {".cubin": "cubin", ".ptx": "ptx", ".fatbin": "fatbin"}


class Module(Resource):
    """Loaded device code; kernels hold it alive, executable graphs pin it open."""

    kind = "module"

    def __init__(self, image: bytes, kind: str = "cubin", device: Device | None = None) -> None:
        self.device, self.image_kind = device or Device(0), kind
        backend = self.device.backend
        with self.device:
            self._h = backend.module_load(image, kind)
        super().__init__(self.device.releaser(backend.module_unload, self._h), keep=self.device)

    @classmethod
    def compile(
        cls,
        source: str,
        device: Device | None = None,
        *,
        arch: str | None = None,
        options: Sequence[str] = (),
        name_expressions: Sequence[str] = (),
    ) -> Module:
        """Compile CUDA C++ with NVRTC for the device's architecture (or `arch`) and load it."""
        device = device or Device(0)
        major, minor = device.compute_capability
        arch = arch or f"sm_{major}{minor}"
        with device:
            image = device.backend.compile(source, arch, options, name_expressions)
        return cls(image, "cubin", device)

    @classmethod
    def load(cls, path: str | Path, device: Device | None = None) -> Module:
        """Load a .cubin, .ptx or .fatbin file."""
        path = Path(path)
        kind = _SUFFIX_KIND.get(path.suffix)
        if kind is None:
            raise ValueError(f"{path}: expected a .cubin, .ptx or .fatbin file")
        return cls(path.read_bytes(), kind, device)

    def kernel(self, name: str) -> Kernel:
        """The kernel named `name` (use extern "C" or a name expression to avoid mangling)."""
        self._check_open()
        with self.device:
            return Kernel(self, self.device.backend.kernel_get(self._h, name), name)


class Kernel:
    """A kernel function; holds its module alive, fails cleanly once the module is closed."""

    def __init__(self, module: Module, handle: Any, name: str) -> None:
        self.module, self._h, self.name = module, handle, name

    def launch(
        self, grid: Dim, block: Dim, args: Sequence[Any], stream: Stream, shared_mem: int = 0
    ) -> None:
        """Queue one launch on `stream`; buffers pass as pointers, numpy scalars by value."""
        if self.module.closed:
            raise ResourceClosedError(f"kernel {self.name}: its module is closed")
        raw = [_arg(a) for a in args]
        if stream._capture is not None:
            stream._capture.keep(self.module, *[_owner(a) for a in args])
        with stream.device:
            stream.device.backend.launch(
                self._h, _dim3(grid), _dim3(block), raw, stream.handle, shared_mem
            )


def _dim3(d: Dim) -> tuple[int, int, int]:
    t = (d,) if isinstance(d, int) else tuple(d)
    if not 1 <= len(t) <= 3 or min(t) < 1:
        raise ValueError(f"grid/block must be 1-3 positive ints, got {d!r}")
    return (t + (1, 1))[:3]  # type: ignore[return-value]


def _owner(arg: Any) -> Any:
    return arg.buffer if isinstance(arg, ArrayView) else arg


def _arg(arg: Any) -> Any:
    if isinstance(arg, (DeviceBuffer, PinnedBuffer)):
        return arg.ptr
    if isinstance(arg, ArrayView):
        return arg.buffer.ptr
    return arg


def select_variant(
    variants: Mapping[tuple[int, int] | None, T], device: Device | tuple[int, int] | None = None
) -> T:
    """The variant for the highest compute capability <= the device's; `None` is the fallback."""
    cc = device if isinstance(device, tuple) else (device or Device(0)).compute_capability
    fits = [k for k in variants if k is not None and tuple(k) <= tuple(cc)]
    if fits:
        return variants[max(fits)]
    if None in variants:
        return variants[None]
    raise LookupError(
        f"no variant for compute capability {cc}; have {sorted(k for k in variants if k)}"
    )

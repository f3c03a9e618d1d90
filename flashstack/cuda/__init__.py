"""flashstack.cuda: CUDA resources that release themselves deterministically and never dangle.

Built on NVIDIA's cuda.core / cuda.bindings. Importing this package imports neither torch nor
the driver; the driver is touched on first use. See docs/cuda.md for the lifetime rules.
"""

from flashstack.cuda import tracker
from flashstack.cuda._resource import (
    CudaResourceError,
    CudaResourceWarning,
    Resource,
    ResourceClosedError,
    ResourceInUseError,
)
from flashstack.cuda.backend import (
    Backend,
    CudaUnavailableError,
    cuda_available,
    get_backend,
    set_backend,
    use_backend,
)
from flashstack.cuda.device import Device, DeviceProperties, device_count, shared_device
from flashstack.cuda.graph import Graph, GraphBuilder, GraphExec
from flashstack.cuda.memory import (
    ArrayView,
    DeviceBuffer,
    PinnedBuffer,
    PinnedLease,
    PinnedPool,
    copy_async,
)
from flashstack.cuda.module import Kernel, Module, select_variant
from flashstack.cuda.stream import Event, Stream, elapsed_ms

__all__ = [
    "ArrayView",
    "Backend",
    "CudaResourceError",
    "CudaResourceWarning",
    "CudaUnavailableError",
    "Device",
    "DeviceBuffer",
    "DeviceProperties",
    "Event",
    "Graph",
    "GraphBuilder",
    "GraphExec",
    "Kernel",
    "Module",
    "PinnedBuffer",
    "PinnedLease",
    "PinnedPool",
    "Resource",
    "ResourceClosedError",
    "ResourceInUseError",
    "Stream",
    "copy_async",
    "cuda_available",
    "device_count",
    "elapsed_ms",
    "get_backend",
    "select_variant",
    "set_backend",
    "shared_device",
    "tracker",
    "use_backend",
]

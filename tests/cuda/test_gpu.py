"""Real-GPU tests: skipped cleanly when no CUDA driver or device is present."""

from __future__ import annotations

import gc
import threading
import warnings

import numpy as np
import pytest

from flashstack import cuda as fc

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not fc.cuda_available(), reason="no CUDA driver or device"),
]

SAXPY = r"""
extern "C" __global__ void saxpy(float a, const float* x, float* y, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"""


@pytest.fixture
def dev() -> fc.Device:
    return fc.Device(0)


def test_properties(dev: fc.Device) -> None:
    assert dev.name and dev.sm_count > 0 and dev.l2_cache_size > 0
    p = dev.properties
    assert p.registers_per_sm >= 65536 and p.shared_memory_per_sm > 0 and p.blocks_per_sm > 0
    assert dev.resident_blocks(p.threads_per_sm, 32, 0) == 1
    assert dev.compute_capability >= (7, 0)
    assert 0 < dev.free_memory <= dev.total_memory


def test_with_device_restores_caller_context_in_a_fresh_thread(dev: fc.Device) -> None:
    seen = {}

    def body() -> None:
        seen["before"] = int(dev.backend.ctx_get_current())
        with dev:
            seen["inside"] = int(dev.backend.ctx_get_current())
        seen["after"] = int(dev.backend.ctx_get_current())

    t = threading.Thread(target=body)
    t.start(), t.join()
    assert seen["before"] == 0 and seen["inside"] != 0 and seen["after"] == 0


def test_copy_roundtrip_and_events(dev: fc.Device) -> None:
    with fc.Stream(dev) as s, fc.PinnedPool(dev) as pool, fc.DeviceBuffer(1 << 20, dev, s) as d:
        with pool.acquire(1 << 20) as a, pool.acquire(1 << 20) as b:
            a.numpy()[:] = np.arange(1 << 20) % 251
            start = s.record(timing=True)
            fc.copy_async(d, a, s)
            fc.copy_async(b, d, s)
            end = s.record(timing=True)
            end.synchronize()
            assert end.query() and fc.elapsed_ms(start, end) >= 0
            assert np.array_equal(a.numpy(), b.numpy())
            start.close(), end.close()


def test_saxpy_graph_keeps_buffers_alive_and_pinned(dev: fc.Device) -> None:
    n = 4096
    with fc.Stream(dev) as s, fc.Module.compile(SAXPY, dev) as mod, fc.PinnedPool(dev) as pool:
        x, y = fc.DeviceBuffer(4 * n, dev, s), fc.DeviceBuffer(4 * n, dev, s)
        with pool.acquire(4 * n) as h:
            h.numpy(np.float32)[:] = 1.0
            fc.copy_async(x, h, s), fc.copy_async(y, h, s)
            with fc.Graph.capture(s) as cap:
                mod.kernel("saxpy").launch(n // 256, 256, [np.float32(3), x, y, np.uint64(n)], s)
            exe = cap.graph.instantiate()
            cap.graph.close()
            with pytest.raises(fc.ResourceInUseError):
                y.close()
            del x, y, cap
            gc.collect()
            for _ in range(10):
                exe.launch(s)
            out = [r for r in exe.refs if isinstance(r, fc.DeviceBuffer)][1]  # y
            fc.copy_async(h, out, s)
            s.synchronize()
            assert np.all(h.numpy(np.float32) == 31.0)
            exe.close()
            out.close()


def test_use_after_close_raises_not_crashes(dev: fc.Device) -> None:
    s = fc.Stream(dev)
    buf = fc.DeviceBuffer(256, dev, s)
    buf.close()
    with pytest.raises(fc.ResourceClosedError):
        fc.copy_async(buf, buf, s)
    with pytest.raises(fc.ResourceClosedError):
        buf.close()
    s.close()
    with pytest.raises(fc.ResourceClosedError):
        s.synchronize()


def test_gc_from_another_thread_is_silent(dev: fc.Device) -> None:
    box: list[object] = []

    def make() -> None:
        s = fc.Stream(dev)
        box.extend([s, fc.DeviceBuffer(1 << 16, dev, s), fc.Event(dev), fc.PinnedBuffer(4096, dev)])

    t = threading.Thread(target=make)
    t.start(), t.join()
    before, caught = fc.tracker.total(), []

    def collect() -> None:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            box.clear()
            gc.collect()
        caught.extend(seen)

    t = threading.Thread(target=collect)
    t.start(), t.join()
    assert [str(w.message) for w in caught] == []
    assert fc.tracker.total() == before - 4


def test_variant_and_compile_for_device(dev: fc.Device) -> None:
    picked = fc.select_variant({(9, 0): "sm_90", (8, 0): "sm_80", None: "generic"}, dev)
    if dev.compute_capability[0] == 9:
        assert picked == "sm_90"
    with fc.Module.compile(SAXPY, dev) as mod:
        assert mod.kernel("saxpy").name == "saxpy"


# 64 MiB of module globals: the driver allocates them when the module loads into the context.
BIG_GLOBALS = r"""
__device__ char big[64 << 20];
extern "C" __global__ void touch(char* out) { out[threadIdx.x] = big[threadIdx.x << 20]; }
"""


def test_module_close_unloads_it_while_a_kernel_still_references_it(dev: fc.Device) -> None:
    with fc.Stream(dev) as s, fc.DeviceBuffer(64, dev, s) as out:
        s.synchronize()
        before = dev.free_memory
        mod = fc.Module.compile(BIG_GLOBALS, dev)
        kernel = mod.kernel("touch")
        kernel.launch(1, 32, [out], s)
        s.synchronize()
        loaded = dev.free_memory
        assert before - loaded >= 60 << 20  # the driver holds the module's globals
        mod.close()  # `kernel` (and cuda.core's kernel object) are still alive
        assert dev.free_memory - loaded >= 60 << 20  # unloaded: the globals are back
        with pytest.raises(fc.ResourceClosedError):
            kernel.launch(1, 32, [out], s)


def test_torch_interop_kernel_on_current_stream() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    from flashstack.cuda import torch_interop as ti

    dev = ti.device_of(torch.empty(1, device="cuda"))
    n = 1 << 16
    x = torch.full((n,), 2.0, device="cuda")
    y = torch.ones(n, device="cuda")
    with fc.Module.compile(SAXPY, dev) as mod, ti.current_stream(dev) as s:
        bx, by = ti.wrap_tensor(x), ti.wrap_tensor(y)
        mod.kernel("saxpy").launch(n // 256, 256, [np.float32(4), bx, by, np.uint64(n)], s)
        bx.close(), by.close()
    del bx, by
    gc.collect()
    assert torch.equal(y.cpu(), torch.full((n,), 9.0))  # torch memory still valid after close
    with fc.Stream(dev) as s, fc.DeviceBuffer(64, dev, s) as buf:
        t = torch.from_dlpack(buf)
        assert t.numel() == 64 and t.is_cuda
        del t
        view = ti.as_tensor(buf, torch.float32, (16,))
        view.fill_(1.5)
        torch.cuda.synchronize()
        assert float(view.sum()) == 24.0
        del view


def test_built_graph_kernel_then_copy(dev: fc.Device) -> None:
    n = 1024
    with fc.Stream(dev) as s, fc.Module.compile(SAXPY, dev) as mod, fc.PinnedPool(dev) as pool:
        with (
            pool.acquire(4 * n) as h,
            fc.DeviceBuffer(4 * n, dev, s) as x,
            fc.DeviceBuffer(4 * n, dev, s) as y,
        ):
            h.numpy(np.float32)[:] = 2.0
            fc.copy_async(x, h, s), fc.copy_async(y, h, s)
            s.synchronize()
            b = fc.Graph.build(dev)
            node = b.launch(mod.kernel("saxpy"), n // 256, 256, [np.float32(1), x, y, np.uint64(n)])
            b.copy(h, y, after=node)
            with b.finish() as g, g.instantiate() as exe:
                exe.launch(s)
                exe.launch(s)
                s.synchronize()
            assert np.all(h.numpy(np.float32) == 6.0)

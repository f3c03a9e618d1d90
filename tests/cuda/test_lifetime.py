"""Lifetime rules against the fake driver: ordering, threads, exceptions, misuse detection."""

from __future__ import annotations

import gc
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest

from flashstack import cuda as fc
from tests.fakes.cuda_driver import FakeBackend, FakeDriverError


def test_with_device_restores_caller_context_on_exception(fake: FakeBackend) -> None:
    dev = fc.Device(0)
    fake.ctx_set_current("callers-ctx")
    with pytest.raises(KeyError):
        with dev:
            assert fake.ctx_get_current() == "ctx0"
            raise KeyError("boom")
    assert fake.ctx_get_current() == "callers-ctx"


def test_with_device_nesting_is_per_thread(fake: FakeBackend) -> None:
    dev, seen, gate = fc.Device(0), {}, threading.Barrier(2)

    def worker(name: str, own: str) -> None:
        fake.ctx_set_current(own)
        with dev:
            gate.wait()  # both threads inside the same Device at once
            with dev:
                pass
            seen[name + "-inside"] = fake.ctx_get_current()
        seen[name] = fake.ctx_get_current()

    threads = [threading.Thread(target=worker, args=(f"t{i}", f"own{i}")) for i in range(2)]
    [t.start() for t in threads], [t.join() for t in threads]
    assert seen == {"t0": "own0", "t1": "own1", "t0-inside": "ctx0", "t1-inside": "ctx0"}


def test_bad_ordinal_says_how_many_devices(fake: FakeBackend) -> None:
    with pytest.raises(ValueError, match="sees 1 device"):
        fc.Device(3)


def test_close_releases_under_owning_context_and_restores(fake: FakeBackend) -> None:
    s = fc.Stream()
    fake.ctx_set_current(None)
    s.close()
    assert fake.violations == []  # the fake flags a destroy made without ctx0 current
    assert fake.ctx_get_current() is None
    assert fake.ops("stream_") == ["stream_create", "stream_destroy"]


def test_double_close_and_use_after_close_raise_python_errors(fake: FakeBackend) -> None:
    s = fc.Stream()
    buf = fc.DeviceBuffer(64, stream=s)
    buf.close()
    with pytest.raises(fc.ResourceClosedError):
        buf.close()
    with pytest.raises(fc.ResourceClosedError):
        _ = buf.ptr
    with pytest.raises(fc.ResourceClosedError):
        fc.copy_async(buf, buf, s)
    s.close()
    with pytest.raises(fc.ResourceClosedError):
        s.synchronize()
    assert fake.violations == []  # every misuse stopped before the driver saw it
    assert fake.ops().count("mem_free") == 1


def test_buffer_freed_on_its_stream_before_stream_destroy_when_collected(fake: FakeBackend) -> None:
    s = fc.Stream()
    buf = fc.DeviceBuffer(128, stream=s)
    del s  # the buffer holds its stream alive
    assert fake.ops("stream_destroy") == []
    del buf
    gc.collect()
    assert [op for op in fake.ops() if op in ("mem_free", "stream_destroy")] == [
        "mem_free",
        "stream_destroy",
    ]
    assert fake.violations == [] and fc.tracker.live() == {}


def test_buffer_outliving_closed_stream_frees_on_legacy_stream(fake: FakeBackend) -> None:
    s = fc.Stream()
    buf = fc.DeviceBuffer(128, stream=s)
    s.close()
    buf.close()
    assert fake.violations == []


def test_gc_from_another_thread_binds_context_and_is_silent(fake: FakeBackend) -> None:
    box: list[object] = []
    s = fc.Stream()
    box += [fc.DeviceBuffer(64, stream=s), fc.Event(), fc.PinnedBuffer(64), s]
    del s
    done = []

    def collect() -> None:
        fake.ctx_set_current(None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            box.clear()
            gc.collect()
        done.append((caught, fake.ctx_get_current()))

    t = threading.Thread(target=collect, name="collector")
    t.start(), t.join()
    caught, ctx_after = done[0]
    assert caught == [] and ctx_after is None
    assert fake.violations == [] and fc.tracker.live() == {}
    frees = [(op, th) for op, _, th in fake.log if op.endswith(("_free", "_destroy"))]
    assert len(frees) == 4 and {th for _, th in frees} == {"collector"}


def test_finalizer_warns_instead_of_raising(fake: FakeBackend) -> None:
    ev = fc.Event()
    fake.fail_next.add("event_destroy")
    with pytest.warns(fc.CudaResourceWarning, match="injected failure"):
        del ev
        gc.collect()
    assert fc.tracker.live() == {}


def test_explicit_close_raises_driver_error(fake: FakeBackend) -> None:
    ev = fc.Event()
    fake.fail_next.add("event_destroy")
    with pytest.raises(FakeDriverError):
        ev.close()
    assert ev.closed  # not retried by the finalizer: a failed release is not repeated


def test_exception_inside_with_is_not_masked(fake: FakeBackend) -> None:
    pool = fc.PinnedPool()
    with pytest.raises(ZeroDivisionError), pytest.warns(fc.CudaResourceWarning):
        with pool:
            lease = pool.acquire(10)
            1 / 0
    lease.close()
    pool.close()


def test_exec_graph_pins_what_it_references_and_destroys_first(fake: FakeBackend) -> None:
    fake.kernels["bump"] = lambda b, p, n: b.host_view(p, 4).__setitem__(
        0, b.host_view(p, 4)[0] + 1
    )
    s = fc.Stream()
    mod = fc.Module.compile('extern "C" __global__ void bump(int* p) {}')
    buf = fc.PinnedBuffer(4)
    with fc.Graph.capture(s) as cap:
        mod.kernel("bump").launch(1, 1, [buf, np.int32(1)], s)
    exe = cap.graph.instantiate()
    cap.graph.close()  # exec and graph are independent
    with pytest.raises(fc.ResourceInUseError):
        buf.close()
    with pytest.raises(fc.ResourceInUseError):
        mod.close()
    del buf, mod, cap
    gc.collect()
    for _ in range(3):
        exe.launch(s)
    assert exe.refs[1].numpy()[0] == 3
    exe.close()
    for res in exe.refs:
        res.close()  # unpinned by the exec's close
    ops = fake.ops()
    assert ops.index("graph_exec_destroy") < ops.index("module_unload")
    s.close()
    assert fake.violations == [] and fc.tracker.live() == {}


def test_collected_exec_releases_referenced_buffers_after_itself(fake: FakeBackend) -> None:
    s = fc.Stream()
    a, b = fc.DeviceBuffer(16, stream=s), fc.DeviceBuffer(16, stream=s)
    with fc.Graph.capture(s) as cap:
        fc.copy_async(a, b, s)
    with cap.graph as g:
        exe = g.instantiate()
    del a, b, cap, g
    gc.collect()
    assert fake.ops("mem_free") == []
    del exe
    gc.collect()
    ops = fake.ops()
    assert ops.index("graph_exec_destroy") < ops.index("mem_free")
    assert ops.count("mem_free") == 2


def test_update_moves_pins_to_new_graph(fake: FakeBackend) -> None:
    s = fc.Stream()
    a, b, c = (fc.DeviceBuffer(16, stream=s) for _ in range(3))
    with fc.Graph.capture(s) as one:
        fc.copy_async(a, b, s)
    with fc.Graph.capture(s) as two:
        fc.copy_async(a, c, s)
    exe = one.graph.instantiate()
    exe.update(two.graph)
    b.close()  # no longer pinned
    with pytest.raises(fc.ResourceInUseError):
        c.close()
    exe.close()
    for r in (a, c, one.graph, two.graph, s):
        r.close()
    assert fake.violations == []


def test_capture_error_ends_capture_and_keeps_stream_usable(fake: FakeBackend) -> None:
    s = fc.Stream()
    with pytest.raises(RuntimeError, match="inside"):
        with fc.Graph.capture(s):
            raise RuntimeError("inside")
    assert fake.ops("capture_") == ["capture_begin", "capture_end"]
    with fc.Graph.capture(s) as cap:
        pass
    cap.graph.close()
    s.close()
    assert fake.violations == [] and fc.tracker.live() == {}


def test_kernel_holds_module_and_fails_cleanly_after_close(fake: FakeBackend) -> None:
    s = fc.Stream()
    k = fc.Module.compile('extern "C" __global__ void k() {}').kernel("k")
    gc.collect()
    assert fake.ops("module_unload") == []  # the kernel keeps its module loaded
    k.module.close()
    assert fake.ops("module_unload") == ["module_unload"]  # close() unloads, kernels or not
    with pytest.raises(fc.ResourceClosedError):
        k.launch(1, 1, [], s)
    s.close()
    assert fake.violations == []


def test_pinned_pool_reuses_blocks_after_their_last_copy(fake: FakeBackend) -> None:
    s = fc.Stream()
    dev_buf = fc.DeviceBuffer(4096, stream=s)
    with fc.PinnedPool() as pool:
        with pool.acquire(1000) as lease:
            lease.numpy()[:3] = [1, 2, 3]
            fc.copy_async(dev_buf, lease, s, nbytes=1000)
        with pool.acquire(3000) as again:
            assert again.ptr == lease._ptr  # same 4 KiB block, no new host_alloc
        assert fake.ops("host_alloc") == ["host_alloc"] and pool.stats["hits"] == 1
        assert fake.ops("event_record")  # the release recorded the copy's end on its stream
    assert fake.ops("host_free") == ["host_free"]
    dev_buf.close(), s.close()
    assert fake.violations == [] and fc.tracker.live() == {}


def test_pinned_pool_never_hands_out_a_block_a_copy_still_uses(fake: FakeBackend) -> None:
    s = fc.Stream()
    dev_buf = fc.DeviceBuffer(4096, stream=s)
    with fc.PinnedPool() as pool:
        with pool.acquire(100) as first:
            fc.copy_async(dev_buf, first, s, nbytes=100)
        fake.work_pending = True  # the copy out of `first` has not run yet
        with pool.acquire(100) as second:
            assert second.ptr != first._ptr  # a new block instead of waiting for the copy
        assert pool.stats == {"hits": 0, "misses": 2, "bytes_held": 8192}
        fake.work_pending = False
        with pool.acquire(100) as third:
            assert third.ptr == first._ptr  # oldest idle block first
        assert fake.ops("event_synchronize") == []  # the host never waited
    assert fake.ops("host_free") == ["host_free", "host_free"]
    dev_buf.close(), s.close()
    assert fake.violations == [] and fc.tracker.live() == {}


def test_used_on_orders_a_lease_behind_work_the_pool_did_not_queue(fake: FakeBackend) -> None:
    s = fc.Stream()
    with fc.PinnedPool() as pool:
        lease = pool.acquire(64)
        lease.used_on(s)  # e.g. a copy torch queued on `s`
        lease.close()
        fake.work_pending = True
        with pool.acquire(64) as other:
            assert other.ptr != lease._ptr
    s.close()
    assert fake.violations == [] and fc.tracker.live() == {}


def test_shared_device_reads_properties_once_per_backend(fake: FakeBackend) -> None:
    dev = fc.shared_device(0)
    assert fc.shared_device(0) is dev and dev.compute_capability == (9, 0) and dev.sm_count == 132
    assert fake.ops("device_properties") == ["device_properties"]
    with fc.use_backend(FakeBackend(cc=(8, 0))):
        assert fc.shared_device(0).compute_capability == (8, 0)
    assert fc.shared_device(0) is dev


def test_pool_close_with_lease_out_raises(fake: FakeBackend) -> None:
    pool = fc.PinnedPool()
    lease = pool.acquire(10)
    with pytest.raises(fc.ResourceInUseError):
        pool.close()
    lease.close()
    pool.close()


def test_numpy_view_pins_pinned_buffer(fake: FakeBackend) -> None:
    buf = fc.PinnedBuffer(16)
    view = buf.numpy(np.int32)[1:]
    with pytest.raises(fc.ResourceInUseError):
        buf.close()
    del view
    buf.close()


def test_copy_roundtrip_through_fake_device(fake: FakeBackend) -> None:
    with (
        fc.Stream() as s,
        fc.PinnedBuffer(64) as src,
        fc.PinnedBuffer(64) as dst,
        fc.DeviceBuffer(64, stream=s) as d,
    ):
        src.numpy()[:] = np.arange(64, dtype=np.uint8)
        fc.copy_async(d, src, s)
        fc.copy_async(dst, d, s)
        assert np.array_equal(dst.numpy(), np.arange(64, dtype=np.uint8))
        with pytest.raises(ValueError, match="exceeds"):
            fc.copy_async(d, src, s, nbytes=65)


def test_array_interface_and_dlpack(fake: FakeBackend) -> None:
    with fc.DeviceBuffer(64) as buf:
        cai = buf.view(np.float32, (4, 4)).__cuda_array_interface__
        assert cai["shape"] == (4, 4) and cai["typestr"] == "<f4" and cai["data"][0] == buf.ptr
        assert buf.__dlpack_device__() == (2, 0)
        assert np.from_dlpack(_Capsule(buf)).nbytes == 64
        with pytest.raises(ValueError):
            buf.view(np.float32, 17)


class _Capsule:
    """Lets numpy consume the fake's host-backed DLPack export (numpy rejects CUDA devices)."""

    def __init__(self, buf: fc.DeviceBuffer) -> None:
        self.buf = buf

    def __dlpack__(self, **kw: object) -> object:
        return self.buf.__dlpack__()

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


def test_wrapped_memory_is_never_freed(fake: FakeBackend) -> None:
    owner = bytearray(8)
    buf = fc.DeviceBuffer.wrap(0x1000, 8, fc.Device(0), owner)
    assert buf.owner is owner
    buf.close()
    borrowed = fc.Stream.borrow(fc.Device(0), 0xABC, owner)
    assert borrowed.raw == 0xABC and borrowed.__cuda_stream__() == (0, 0xABC)
    borrowed.close()
    assert fake.ops("mem_free") == [] and fake.ops("stream_destroy") == []


def test_events_time_and_wait(fake: FakeBackend) -> None:
    with fc.Stream() as s, fc.Stream(priority=-1) as t:
        a, b = s.record(timing=True), s.record(timing=True)
        t.wait(b)
        assert fc.elapsed_ms(a, b) > 0 and fc.Event.elapsed_ms(a, b) > 0 and b.query()
        with fc.Event() as plain, pytest.raises(ValueError, match="timing=True"):
            fc.elapsed_ms(plain, b)
        a.close(), b.close()
    assert fake.violations == []


def test_select_variant_picks_highest_fitting_build() -> None:
    builds = {(9, 0): "sm90", (8, 0): "sm80", None: "generic"}
    assert fc.select_variant(builds, (9, 0)) == "sm90"
    assert fc.select_variant(builds, (8, 9)) == "sm80"
    assert fc.select_variant(builds, (7, 5)) == "generic"
    assert fc.select_variant(builds, (10, 0)) == "sm90"
    with pytest.raises(LookupError):
        fc.select_variant({(9, 0): 1}, (8, 0))


def test_select_variant_reads_device_and_compile_targets_it(fake: FakeBackend) -> None:
    assert fc.select_variant({(9, 0): "a", None: "b"}, fc.Device(0)) == "a"
    with fc.Module.compile('extern "C" __global__ void k() {}'):
        pass
    assert ("compile", "sm_90") in [(op, arg) for op, arg, _ in fake.log]
    with pytest.raises(FakeDriverError, match="COMPILATION"):
        fc.Module.compile("#error nope")


def test_module_load_from_file_checks_suffix(fake: FakeBackend, tmp_path: Path) -> None:
    path = tmp_path / "k.cubin"
    path.write_bytes(b'extern "C" k')
    with fc.Module.load(path) as mod:
        assert mod.image_kind == "cubin" and mod.kernel("k").name == "k"
    with pytest.raises(ValueError, match="cubin"):
        fc.Module.load(tmp_path / "k.so")


def test_built_graph_pins_its_nodes_resources_and_replays(fake: FakeBackend) -> None:
    fake.kernels["double"] = lambda b, p, n: b.host_view(p, 4).__setitem__(
        0, 2 * b.host_view(p, 4)[0]
    )
    mod = fc.Module.compile('extern "C" __global__ void double(int* p) {}')
    src, dst = fc.PinnedBuffer(4), fc.PinnedBuffer(4)
    src.numpy()[0] = 3
    builder = fc.Graph.build(fc.Device(0))
    node = builder.launch(mod.kernel("double"), 1, 1, [src, np.int32(1)])
    builder.copy(dst, src, after=node)
    graph = builder.finish()
    with pytest.raises(RuntimeError, match="finished"):
        builder.finish()
    with fc.Stream() as s, graph, graph.instantiate() as exe:
        with pytest.raises(fc.ResourceInUseError):
            dst.close()
        exe.launch(s)
        exe.launch(s)
    assert dst.numpy()[0] == 12 and fake.ops("graph_add_") == [
        "graph_add_kernel",
        "graph_add_memcpy",
    ]
    for r in (src, dst, mod):
        r.close()
    assert fake.violations == [] and fc.tracker.live() == {}


def test_resident_blocks_follow_registers_threads_and_shared_memory(fake: FakeBackend) -> None:
    """How many blocks of a kernel one SM holds at once (an H100/H200's limits in the fake):
    registers go out 256 a warp from each quarter of the SM."""
    dev = fc.Device(0)
    assert dev.resident_blocks(128, 255, 0) == 2  # 8,192 registers a warp: two warps a quarter
    assert dev.resident_blocks(128, 168, 20 << 10) == 3
    assert dev.resident_blocks(128, 128, 0) == 4
    assert dev.resident_blocks(128, 32, 100 << 10) == 2  # shared memory binds first
    assert dev.resident_blocks(1024, 32, 0) == 2  # 2,048 threads
    assert dev.resident_blocks(32, 16, 0) == 32  # the block limit

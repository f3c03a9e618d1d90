"""flashstack.cuda resource cycles, SAXPY, pinned H2D: docs/benchmarks.md, "CUDA resources"."""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Callable

import numpy as np

from flashstack import cuda as fc

SAXPY = r"""
extern "C" __global__ void saxpy(float a, const float* x, float* y, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"""


def _cycle(make: Callable[[], fc.Resource], n: int, dev: fc.Device) -> dict[str, float]:
    for _ in range(10):  # warm the pools so "before" already includes their steady state
        make().close()
    dev.synchronize()
    gc.collect()
    free0, live0 = dev.free_memory, fc.tracker.total()
    t0 = time.perf_counter()
    for _ in range(n):
        make().close()
    elapsed = time.perf_counter() - t0
    dev.synchronize()
    gc.collect()
    return {
        "us_per_cycle": round(elapsed / n * 1e6, 2),
        "free_mem_delta_bytes": dev.free_memory - free0,
        "tracker_delta": fc.tracker.total() - live0,
    }


def bench_cycles(dev: fc.Device, n: int) -> dict[str, dict[str, float]]:
    """n create/close cycles of every resource kind."""
    stream = fc.Stream(dev)
    pool = fc.PinnedPool(dev)
    image_mod = fc.Module.compile(SAXPY, dev)
    kernel = image_mod.kernel("saxpy")
    image = dev.backend.compile(SAXPY, "sm_%d%d" % dev.compute_capability, (), ())
    x, y = fc.DeviceBuffer(4096, dev, stream), fc.DeviceBuffer(4096, dev, stream)

    def graph_exec() -> fc.Resource:
        with fc.Graph.capture(stream) as cap:
            kernel.launch(4, 256, [np.float32(1), x, y, np.uint64(1024)], stream)
        exe = cap.graph.instantiate()
        cap.graph.close()
        return exe

    makers = {
        "stream": lambda: fc.Stream(dev),
        "event": lambda: fc.Event(dev, timing=True),
        "device_buffer_1MiB": lambda: fc.DeviceBuffer(1 << 20, dev, stream),
        "pinned_buffer_64KiB": lambda: fc.PinnedBuffer(1 << 16, dev),
        "pinned_lease_1MiB": lambda: pool.acquire(1 << 20),
        "module": lambda: fc.Module(image, "cubin", dev),
        "graph_exec": graph_exec,
    }
    out = {kind: _cycle(make, n, dev) for kind, make in makers.items()}
    for res in (x, y, image_mod, pool, stream):
        res.close()
    return out


def bench_saxpy_graph(dev: fc.Device, n: int = 1 << 20, replays: int = 1000) -> dict[str, object]:
    """NVRTC SAXPY: exact once, then captured in a graph and replayed `replays` times."""
    a = np.float32(2.0)
    with fc.Stream(dev) as s, fc.PinnedPool(dev) as pool, fc.Module.compile(SAXPY, dev) as mod:
        kernel = mod.kernel("saxpy")
        with (
            pool.acquire(4 * n) as hx,
            pool.acquire(4 * n) as hy,
            fc.DeviceBuffer(4 * n, dev, s) as dx,
            fc.DeviceBuffer(4 * n, dev, s) as dy,
        ):
            x = hx.numpy(np.float32)
            x[:] = np.arange(n, dtype=np.float32) % 1024  # integers: every result is exact
            hy.numpy(np.float32)[:] = 1.0
            fc.copy_async(dx, hx, s)
            fc.copy_async(dy, hy, s)
            args = [a, dx, dy, np.uint64(n)]
            grid = (n + 255) // 256
            kernel.launch(grid, 256, args, s)
            fc.copy_async(hy, dy, s)
            s.synchronize()
            once_exact = bool(np.array_equal(hy.numpy(np.float32), a * x + np.float32(1)))
            with fc.Graph.capture(s) as cap:
                kernel.launch(grid, 256, args, s)
            with cap.graph as graph, graph.instantiate() as exe:
                start, end = fc.Event(dev, timing=True), fc.Event(dev, timing=True)
                start.record(s)
                for _ in range(replays):
                    exe.launch(s)
                end.record(s)
                fc.copy_async(hy, dy, s)
                s.synchronize()
                ms = fc.elapsed_ms(start, end)
                start.close(), end.close()
            want = np.float32(1) + np.float32(replays + 1) * a * x
            replay_exact = bool(np.array_equal(hy.numpy(np.float32), want))
            del x
    return {
        "n": n,
        "once_exact": once_exact,
        "replays": replays,
        "graph_replays_exact": replay_exact,
        "us_per_replay": round(ms / replays * 1e3, 3),
    }


def _ours_h2d(dev: fc.Device, nbytes: int, iters: int) -> float:
    with fc.Stream(dev) as s, fc.PinnedPool(dev) as pool, fc.DeviceBuffer(nbytes, dev, s) as d:
        with pool.acquire(nbytes) as h:
            h.numpy()[:] = 1
            fc.copy_async(d, h, s)  # warm-up
            start, end = s.record(timing=True), fc.Event(dev, timing=True)
            start.record(s)
            for _ in range(iters):
                fc.copy_async(d, h, s)
            end.record(s)
            end.synchronize()
            ms = fc.elapsed_ms(start, end)
            start.close(), end.close()
    return nbytes * iters / (ms / 1e3) / 1e9


def _torch_h2d(nbytes: int, iters: int) -> float:
    import torch

    h = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
    d = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    d.copy_(h, non_blocking=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        d.copy_(h, non_blocking=True)
    end.record()
    end.synchronize()
    return nbytes * iters / (start.elapsed_time(end) / 1e3) / 1e9


def bench_h2d(dev: fc.Device, nbytes: int = 256 << 20, iters: int = 20) -> dict[str, float]:
    """Pinned-pool H2D bandwidth vs torch's pinned copy, interleaved, best of 3 each."""
    ours, theirs = [], []
    for _ in range(3):
        theirs.append(_torch_h2d(nbytes, iters))
        ours.append(_ours_h2d(dev, nbytes, iters))
    return {
        "bytes": nbytes,
        "iters": iters,
        "ours_GBps": round(max(ours), 2),
        "torch_GBps": round(max(theirs), 2),
        "ratio": round(max(ours) / max(theirs), 4),
    }


def bench_torch_stream(n: int = 1 << 20) -> dict[str, object]:
    """Our SAXPY on torch's current (non-default) stream over torch tensors, no extra sync."""
    import torch

    from flashstack.cuda import torch_interop as ti

    dev = fc.Device(torch.cuda.current_device())
    with fc.Module.compile(SAXPY, dev) as mod, torch.cuda.stream(torch.cuda.Stream()):
        x = torch.arange(n, dtype=torch.float32, device="cuda") % 1024
        y = torch.ones(n, dtype=torch.float32, device="cuda")
        y.mul_(3)  # queued on torch's stream just before our kernel
        with ti.current_stream(dev) as s, ti.wrap_tensor(x) as bx, ti.wrap_tensor(y) as by:
            mod.kernel("saxpy").launch(
                (n + 255) // 256, 256, [np.float32(2), bx, by, np.uint64(n)], s
            )
        y.add_(1)  # queued after it, on the same stream
        got = y.cpu()  # torch's own sync, nothing of ours
        want = (2 * (torch.arange(n, dtype=torch.float32) % 1024) + 3) + 1
    return {"n": n, "exact": bool(torch.equal(got, want)), "torch_memory_intact": bool(x.sum() > 0)}


def _per_call_us(fn: Callable[[], object], n: int) -> float:
    import torch

    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / n * 1e6


def bench_staging(n: int = 2000, values: int = 300) -> dict[str, object]:
    """Host time per engine staging call: a step's inputs up (`values` int64s) and its sampled
    tokens down, through HostStaging's pool vs torch's pinned tensors; interleaved, best of 3."""
    import torch

    from flashstack.cuda import torch_interop as ti

    staging = ti.HostStaging(fc.shared_device(torch.cuda.current_device()))
    host_values = list(range(values))
    tokens = torch.arange(8, device="cuda")

    def torch_up() -> object:
        return torch.tensor(host_values, dtype=torch.int64, pin_memory=True).to(
            "cuda", non_blocking=True
        )

    def torch_down() -> object:
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        ready.synchronize()
        return host.tolist()

    calls = {
        "up_ours": lambda: staging.to_device(host_values, torch.int64),
        "up_torch": torch_up,
        "down_ours": lambda: staging.to_host(tokens).wait(),
        "down_torch": torch_down,
    }
    best = {name: min(_per_call_us(fn, n) for _ in range(3)) for name, fn in calls.items()}
    out: dict[str, object] = {name + "_us": round(us, 2) for name, us in best.items()}
    out.update(values=values, pool=dict(staging.pool.stats))
    return out


def bench_variant(dev: fc.Device) -> dict[str, object]:
    """select_variant on this device: builds keyed by compute capability."""
    builds = {(9, 0): "sm_90", (8, 0): "sm_80", None: "generic"}
    return {
        "compute_capability": list(dev.compute_capability),
        "picked": fc.select_variant(builds, dev),
    }


def main() -> None:
    """Run every section and print JSON."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", help="also write the JSON here")
    ap.add_argument("--cycles", type=int, default=10_000)
    opts = ap.parse_args()
    dev = fc.Device(0)
    out: dict[str, object] = {"device": dev.name, "backend": dev.backend.name}
    sections = [
        ("variant", lambda: bench_variant(dev)),
        ("saxpy_graph", lambda: bench_saxpy_graph(dev)),
        ("torch_stream", bench_torch_stream),
        ("staging", bench_staging),
        ("h2d", lambda: bench_h2d(dev)),
        ("cycles", lambda: bench_cycles(dev, opts.cycles)),
    ]
    for name, fn in sections:
        t0 = time.perf_counter()
        try:
            out[name] = fn()
        except Exception as exc:  # one broken section must not hide the others' numbers
            out[name] = {"error": repr(exc)}
        print(f"# {name}: {time.perf_counter() - t0:.1f}s", flush=True)
    out["tracker_live_at_end"] = fc.tracker.live()
    text = json.dumps(out, indent=2)
    print(text)
    if opts.json:
        with open(opts.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()

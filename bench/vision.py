"""Base64 decode and the image path, CPU vs GPU: docs/benchmarks.md, "Vision"."""

from __future__ import annotations

import argparse
import base64
import binascii
import io
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import numpy as np
import pybase64
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flashstack.gateway.vision import gpu as vision_gpu
from flashstack.gateway.vision import pipeline, scaling
from flashstack.gateway.vision.payload import ImagePayload

MB = 1024 * 1024


def timeit(
    fn: Callable[[], Any], budget: float = 0.4, min_runs: int = 3, max_runs: int = 200
) -> float:
    """Median seconds per call, after one warm-up call."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_runs or (time.perf_counter() - start < budget and len(times) < max_runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def vision_config(gpu: str) -> Any:
    """VisionConfig when pydantic is there; the same fields otherwise (the GPU box may lack it)."""
    try:
        from flashstack.gateway.config import VisionConfig

        return VisionConfig(gpu=gpu, max_image_bytes=64 * MB)
    except ImportError:
        return SimpleNamespace(
            gpu=gpu, gpu_min_batch=2, max_image_bytes=64 * MB, max_pixels=64_000_000
        )


# ---- 1. base64 -------------------------------------------------------------------------------


def bench_base64(sizes: list[int], cuda: bool) -> list[dict[str, Any]]:
    rows = []
    staging = out_staging = None
    if cuda:
        import torch

        biggest = max(sizes)
        staging = torch.empty(biggest * 4 // 3 + 8, dtype=torch.uint8).pin_memory()
        out_staging = torch.empty(biggest + 8, dtype=torch.uint8).pin_memory()
    for size in sizes:
        raw = os.urandom(size)
        text = base64.b64encode(raw).decode("ascii")  # what the gateway holds: a str from JSON
        row: dict[str, Any] = {"decoded_bytes": size}
        paths: dict[str, Callable[[], bytes]] = {
            "stdlib": lambda text=text: base64.b64decode(text, validate=True),
            "pybase64": lambda text=text: pybase64.b64decode(text, validate=True),
        }
        if cuda:
            paths["gpu_triton_pageable"] = lambda text=text: vision_gpu.b64decode_gpu(text)
            paths["gpu_triton_pinned"] = lambda text=text: vision_gpu.b64decode_gpu(
                text, staging, out_staging
            )
        for name, fn in paths.items():
            try:
                assert fn() == raw, f"{name} decoded wrongly"
                row[name + "_gbps"] = round(size / timeit(fn) / 1e9, 3)
            except (AssertionError, RuntimeError, ValueError, binascii.Error) as e:
                row[name + "_error"] = f"{type(e).__name__}: {e}"[:200]
        rows.append(row)
    return rows


# ---- 2. the image path -----------------------------------------------------------------------


def photo_jpeg(width: int = 4000, height: int = 3000, seed: int = 0) -> bytes:
    """A photo-like 12-MP JPEG: smooth random structure plus sensor-like noise, quality 90."""
    rng = np.random.default_rng(seed)
    coarse = Image.fromarray(rng.integers(0, 255, (30, 40, 3), dtype=np.uint8)).resize(
        (width, height), Image.BICUBIC
    )
    pixels = np.asarray(coarse, dtype=np.int16) + rng.normal(0, 6, (height, width, 3)).astype(
        np.int16
    )
    buf = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _payloads(text: str, n: int) -> list[ImagePayload]:
    return [ImagePayload(media_type="image/jpeg", data=text) for _ in range(n)]


def bench_pipeline(cuda: bool, batch: int, runs_budget: float) -> dict[str, Any]:
    jpeg = photo_jpeg()
    text = base64.b64encode(jpeg).decode("ascii")
    no_resize = scaling.Target(None, 64 * MB)
    anthropic = scaling.Target(1568, 5 * MB)
    cpu, gpu = vision_config("off"), vision_config("auto")
    out: dict[str, Any] = {
        "jpeg_bytes": len(jpeg),
        "pixels": "4000x3000",
        "batch": batch,
        "target_long_edge": 1568,
    }

    out["no_resize_ms_per_image"] = 1e3 * timeit(
        lambda: pipeline.normalize(_payloads(text, 1), no_resize, cpu), runs_budget
    )
    out["no_resize_batch_ms_per_image"] = (
        1e3
        * timeit(lambda: pipeline.normalize(_payloads(text, batch), no_resize, cpu), runs_budget)
        / batch
    )
    out["cpu_resize_one_ms"] = 1e3 * timeit(
        lambda: pipeline.normalize(_payloads(text, 1), anthropic, cpu), runs_budget
    )
    out["cpu_resize_batch_ms"] = 1e3 * timeit(
        lambda: pipeline.normalize(_payloads(text, batch), anthropic, cpu), runs_budget
    )

    threads = os.cpu_count() or 1
    with ThreadPoolExecutor(threads) as pool:  # not what the gateway does per request; for scale
        out["cpu_resize_batch_threadpool_ms"] = 1e3 * timeit(
            lambda: list(
                pool.map(lambda p: pipeline.normalize([p], anthropic, cpu), _payloads(text, batch))
            ),
            runs_budget,
        )
    out["cpu_threads"] = threads
    out["pillow_full_decode_one_ms"] = 1e3 * timeit(
        lambda: Image.open(io.BytesIO(jpeg)).load(), runs_budget
    )

    if cuda:
        out.update(_gpu_pipeline(jpeg, text, batch, anthropic, gpu, runs_budget))
        out["gpu_speedup_batch"] = round(out["cpu_resize_batch_ms"] / out["gpu_resize_batch_ms"], 2)
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


def _gpu_pipeline(
    jpeg: bytes, text: str, batch: int, target: Any, gpu: Any, budget: float
) -> dict[str, Any]:
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    data = [torch.frombuffer(bytearray(jpeg), dtype=torch.uint8) for _ in range(batch)]

    def nvjpeg_decode() -> None:
        decode_jpeg(data, mode=ImageReadMode.RGB, device="cuda")
        torch.cuda.synchronize()

    payloads = _payloads(text, batch)
    pipeline.normalize(payloads, target, gpu)
    sent = base64.b64decode(payloads[0].data)
    with Image.open(io.BytesIO(sent)) as im:
        size = im.size
    progressive = io.BytesIO()
    Image.open(io.BytesIO(jpeg)).save(progressive, "JPEG", quality=90, progressive=True)
    try:
        ok = vision_gpu.resize_jpegs([progressive.getvalue()] * 2, [size] * 2, 90)
        nvjpeg_progressive = "decoded" if all(o is not None for o in ok) else "refused (None)"
    except Exception as e:  # noqa: BLE001 - a fact to record, whatever it is
        nvjpeg_progressive = f"{type(e).__name__}: {e}"[:200]
    return {
        "nvjpeg_progressive_jpeg": nvjpeg_progressive,
        "nvjpeg_decode_batch_ms": 1e3 * timeit(nvjpeg_decode, budget),
        "gpu_resize_one_ms": 1e3
        * timeit(lambda: pipeline.normalize(_payloads(text, 1), target, gpu), budget),
        "gpu_resize_batch_ms": 1e3
        * timeit(lambda: pipeline.normalize(_payloads(text, batch), target, gpu), budget),
        "gpu_output_size": f"{size[0]}x{size[1]}",
        "gpu_output_bytes": len(sent),
        "device": torch.cuda.get_device_name(),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", help="also write the result here")
    ap.add_argument("--quick", action="store_true", help="small sizes and budgets (a smoke run)")
    args = ap.parse_args()
    cuda = vision_gpu.available()
    sizes = (
        [4 * 1024, 64 * 1024, MB, 4 * MB]
        if args.quick
        else [4 * 1024, 64 * 1024, 256 * 1024, MB, 4 * MB, 16 * MB, 64 * MB]
    )
    result = {
        "machine": {
            "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "cuda": cuda,
            "pybase64": pybase64.__version__,
            "pillow": Image.__version__,
        },
        "base64": bench_base64(sizes, cuda),
        "pipeline": bench_pipeline(cuda, 4 if args.quick else 16, 0.3 if args.quick else 2.0),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()

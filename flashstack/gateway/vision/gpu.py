"""The GPU side of image payloads: nvJPEG decode + resize + encode for batches, base64 on the GPU.

Imported only when a batch could use it: torch, torchvision and triton are optional for the gateway.
`b64decode_torch` is the plain-torch reference of the Triton kernel (and runs on the CPU in tests).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import pybase64

_ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
# LUT value for bytes outside the alphabet ('=' included: padding is decoded on the host).
INVALID = 0x80

# Base64 payloads at least this large are decoded on the GPU; None: never. bench/vision.py measured
# it on an H200 (docs/benchmarks.md, "Vision"): pybase64 won at every size.
GPU_BASE64_MIN_BYTES: int | None = None


@functools.cache
def available() -> bool:
    """True when torch sees a CUDA device and torchvision has its nvJPEG ops."""
    try:
        import torch
        import torchvision.io  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


# ---- nvJPEG: decode → resize → encode, a batch at a time --------------------------------------


def resize_jpegs(
    raws: list[bytes], sizes: list[tuple[int, int]], quality: int
) -> list[bytes | None]:
    """Each JPEG resized to its (w, h) on the GPU; None where nvJPEG refused one (CPU takes it)."""
    from torchvision.io import ImageReadMode, decode_jpeg, encode_jpeg

    datas = [_host_tensor(raw) for raw in raws]
    try:
        images: list[Any] = decode_jpeg(datas, mode=ImageReadMode.RGB, device="cuda")
    except RuntimeError:  # one bad apple fails the batch: retry one by one
        images = [_decode_one(d, decode_jpeg, ImageReadMode.RGB) for d in datas]
    resized = [
        None if im is None else _resize(im, size) for im, size in zip(images, sizes, strict=True)
    ]
    ok = [r for r in resized if r is not None]
    encoded = iter(encode_jpeg(ok, quality=quality) if ok else [])
    # One device→host copy per image, after all the work is queued.
    return [None if r is None else next(encoded).cpu().numpy().tobytes() for r in resized]


def _host_tensor(raw: bytes) -> Any:
    """A uint8 tensor over `raw` without a copy; what reads it never writes."""
    import torch

    with warnings.catch_warnings():  # frombuffer warns that bytes are read-only
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(raw, dtype=torch.uint8)


def _decode_one(data: Any, decode_jpeg: Any, mode: Any) -> Any:
    try:
        return decode_jpeg(data, mode=mode, device="cuda")
    except RuntimeError:
        return None


def _resize(image: Any, size: tuple[int, int]) -> Any:
    import torch
    import torch.nn.functional as F

    w, h = size
    if image.shape[-2:] == (h, w):
        return image
    x = F.interpolate(
        image[None].float(), size=(h, w), mode="bilinear", antialias=True, align_corners=False
    )
    return x[0].round_().clamp_(0, 255).to(torch.uint8)


# ---- base64 on the GPU --------------------------------------------------------------------------


def _lut_bytes() -> bytes:
    lut = bytearray([INVALID] * 256)
    for i, c in enumerate(_ALPHABET):
        lut[c] = i
    return bytes(lut)


def _split_padding(src: bytes) -> tuple[int, bytes]:
    """(full quads for the GPU, the host-decoded tail) of strict base64 text."""
    if len(src) % 4:
        raise ValueError("base64 text length is not a multiple of 4")
    if src.endswith(b"="):
        return len(src) // 4 - 1, pybase64.b64decode(src[-4:], validate=True)
    return len(src) // 4, b""


def b64decode_torch(src: Any) -> Any:
    """Reference decode of whole quads (uint8 tensor, no padding) with plain torch ops."""
    import torch

    lut = torch.frombuffer(bytearray(_lut_bytes()), dtype=torch.uint8).to(src.device)
    v = lut[src.long()]
    if bool((v & INVALID).any()):
        raise ValueError("invalid base64 character")
    v = v.view(-1, 4).to(torch.int32)
    word = (v[:, 0] << 18) | (v[:, 1] << 12) | (v[:, 2] << 6) | v[:, 3]
    return (
        torch.stack([(word >> 16) & 255, (word >> 8) & 255, word & 255], 1)
        .to(torch.uint8)
        .flatten()
    )


@functools.cache
def _triton_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def b64_kernel(src, lut, dst, bad, n_quads, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        q = pid * BLOCK + tl.arange(0, BLOCK)
        m = q < n_quads
        base = q.to(tl.int64) * 4
        v0 = tl.load(lut + tl.load(src + base, mask=m, other=65).to(tl.int32))
        v1 = tl.load(lut + tl.load(src + base + 1, mask=m, other=65).to(tl.int32))
        v2 = tl.load(lut + tl.load(src + base + 2, mask=m, other=65).to(tl.int32))
        v3 = tl.load(lut + tl.load(src + base + 3, mask=m, other=65).to(tl.int32))
        tl.store(bad + pid, tl.max((v0 | v1 | v2 | v3) & 0x80, axis=0))
        word = (v0 << 18) | (v1 << 12) | (v2 << 6) | v3
        out = q.to(tl.int64) * 3
        tl.store(dst + out, ((word >> 16) & 255).to(tl.uint8), mask=m)
        tl.store(dst + out + 1, ((word >> 8) & 255).to(tl.uint8), mask=m)
        tl.store(dst + out + 2, (word & 255).to(tl.uint8), mask=m)

    return b64_kernel


BLOCK = 1024


def b64decode_quads_triton(src: Any) -> Any:
    """Decode whole quads of a CUDA uint8 tensor with the Triton kernel; raises on a bad
    character."""
    import torch

    n_quads = src.numel() // 4
    lut = _device_lut(src.device)
    dst = torch.empty(n_quads * 3, dtype=torch.uint8, device=src.device)
    grid = (max(1, (n_quads + BLOCK - 1) // BLOCK),)
    bad = torch.zeros(grid[0], dtype=torch.int32, device=src.device)
    _triton_kernel()[grid](src, lut, dst, bad, n_quads, BLOCK=BLOCK)
    return dst, bad


@functools.cache
def _device_lut(device: Any) -> Any:
    import torch

    lut = torch.frombuffer(bytearray(_lut_bytes()), dtype=torch.uint8).to(torch.int32)
    return lut.to(device)


def b64decode_gpu(text: str | bytes, staging: Any = None, out_staging: Any = None) -> bytes:
    """Strict base64 → bytes through the GPU, transfers included (pinned staging when given)."""

    src = text.encode("ascii") if isinstance(text, str) else text
    n_quads, tail = _split_padding(src)
    host = _host_tensor(src)[: n_quads * 4]
    if staging is not None:
        staging[: host.numel()].copy_(host)
        dev = staging[: host.numel()].to("cuda", non_blocking=True)
    else:
        dev = host.to("cuda")
    dst, bad = b64decode_quads_triton(dev)
    if out_staging is not None:
        out = out_staging[: dst.numel()]
        out.copy_(dst, non_blocking=True)
        flag = bad.max().item()  # synchronizes: the copy above is done after this
    else:
        out = dst.cpu()
        flag = bad.max().item()
    if flag:
        raise ValueError("invalid base64 character")
    return out.numpy().tobytes() + tail

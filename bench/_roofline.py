"""The engine benchmarks' yardstick: bytes a step must read, over a copy bandwidth.

Issue targets are stated against the H200's device-to-device copy. A run also measures its own
card's copy, so that a run on another card (an H100 copies about 3.0 TB/s) says how near that
card's floor it came, not only how far it is from the H200's.
"""

from __future__ import annotations

import functools

H200_COPY_BW = 4.26e12  # bytes/s read + written, device-to-device copy on the H200 (shared/GPU.md)


@functools.cache
def card_copy_bandwidth(nbytes: int = 2 << 30, repeats: int = 5) -> float:
    """Bytes read + written per second by one device-to-device copy on the current CUDA card, the
    best of `repeats`. `nbytes` moved in all, far past the L2, so the copy runs from memory."""
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)  # the first copy pays for the pages' first touch
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(repeats):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (nbytes // 2) / best


def on_card(fraction_of_h200_floor: float, card_bw: float) -> float:
    """A bandwidth-bound fraction of the H200's floor restated against this card's copy."""
    return round(fraction_of_h200_floor * H200_COPY_BW / card_bw, 3)

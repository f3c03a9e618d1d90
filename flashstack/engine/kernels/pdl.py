"""Programmatic dependent launch (PDL): on Hopper and later, a kernel launched with it may start
while the kernel before it in the stream is still finishing.

A batch-1 decode step is ~240 short kernels in a row; without PDL each one starts only after the
previous one has fully drained, so every boundary costs a launch latency plus a ramp-up. With PDL a
kernel does the work that depends on nothing the previous kernel writes (a GEMV's first weight
chunk), then waits at `wait_for_previous_kernel`, which also lets the next kernel launch and do the
same. Every write and every read of a previous kernel's output must come after the wait; reads of
anything older are safe before it, because a kernel releases its successor only after its own
wait, when everything before it has finished.

The batch-1 GEMVs use it, and so do decode attention and its merge (KernelOptions.attention_pdl):
each of those waits first thing, yet its launch and ramp-up overlap the kernel before, which on a
small model is most of the two kernels' cost (docs/benchmarks.md, "engine small-model profile").
So do the skinny GEMM and the kernels between the products of a multi-row step (RMSNorm,
SiLU-and-mul, rotary with the KV store: KernelOptions.elementwise_pdl): a kernel launched without
PDL in such a chain makes its neighbours wait on both sides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashstack.cuda.torch_interop import device_for


@triton.jit
def wait_for_previous_kernel(USE_PDL: tl.constexpr):
    """Block until the previous kernel in the stream has finished and its writes are visible; then
    allow the next kernel to launch. A no-op without PDL."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def pdl_applies(device: torch.device, wanted: bool = True) -> bool:
    """PDL for kernels on `device`: when `wanted` (EngineConfig.kernels.pdl), on Hopper and later,
    with compiled (not interpreted) Triton."""
    return (
        wanted
        and device.type == "cuda"
        and not triton.knobs.runtime.interpret
        and device_for(device).compute_capability >= (9, 0)
    )

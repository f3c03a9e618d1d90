"""What the stream operations around a decode graph's replay cost the device, without a profiler:
docs/benchmarks.md, "Decode step".

A captured graph of `--kernels` small elementwise kernels (about 5 ms at 1,200 on the H100, an 8B
step's length) is replayed back to back, then with each of the operations a decode step queues
around its replay added in turn, the way ModelRunner.launch queues them: the step's packed inputs
copied from pinned memory (HtoD), the previous step's tokens copied into them (DtoD), the tokens
copied back to pinned memory (DtoH), and the host waiting for the step before (as the engine's
lookahead does). Wall time per replay over `--iters` replays; the differences are the device's
cost of each operation, its gap included.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

MODES = {
    "replay": 0,
    "+ inputs HtoD": 1,
    "+ tokens DtoD": 2,
    "+ tokens DtoH": 3,
    "+ host waits the step before": 4,
}


def _graph(kernels: int, x: torch.Tensor, tokens: torch.Tensor) -> torch.cuda.CUDAGraph:
    def body() -> None:
        y = x
        for _ in range(kernels):
            y = y * 1.0001 + 1.0
        tokens.copy_(y[: tokens.numel()].long())

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        body()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
    torch.cuda.synchronize()
    return graph


def per_replay_us(graph, ops: int, iters: int, bufs: dict[str, torch.Tensor]) -> float:
    """Wall µs per replay with the first `ops` operations of MODES around each."""
    packed, tokens, host_in = bufs["packed"], bufs["tokens"], bufs["host_in"]
    host_out = [torch.zeros_like(tokens, device="cpu").pin_memory() for _ in range(4)]
    done = [torch.cuda.Event() for _ in range(iters)]
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(iters):
        if ops >= 1:
            packed.copy_(host_in, non_blocking=True)
        if ops >= 2:
            packed[: tokens.numel()].copy_(tokens)
        graph.replay()
        if ops >= 3:
            host_out[i % 4].copy_(tokens, non_blocking=True)
        done[i].record()
        if ops >= 4 and i:
            done[i - 1].synchronize()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--kernels", type=int, default=1200)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--rows", type=int, default=32, help="sequences: tokens copied")
    ap.add_argument("--packed", type=int, default=673, help="int64 inputs staged (batch 32)")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    x = torch.randn(1 << 20, device="cuda")
    bufs = {
        "packed": torch.zeros(args.packed, dtype=torch.int64, device="cuda"),
        "tokens": torch.zeros(args.rows, dtype=torch.int64, device="cuda"),
        "host_in": torch.zeros(args.packed, dtype=torch.int64).pin_memory(),
    }
    graph = _graph(args.kernels, x, bufs["tokens"])
    result: dict = {"gpu": torch.cuda.get_device_name(), "kernels": args.kernels}
    for _ in range(args.repeats):
        for name, ops in MODES.items():
            us = per_replay_us(graph, ops, args.iters, bufs)
            result.setdefault(name, []).append(round(us, 1))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

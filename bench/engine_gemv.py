"""Batch-1 GEMV over the Llama-3-8B projection shapes: cuBLAS (torch.nn.functional.linear) against a
plain Triton GEMV, each timed inside a CUDA graph (launch gaps included, as in a decode graph).

    PYTHONPATH=. python3 bench/engine_gemv.py --json gemv.json

The question it answers: can our own GEMV read the weights as fast as cuBLAS (or faster on the
q/k/v and o shapes, where cuBLAS reaches only ~3.2 TB/s and adds a split-K reduce kernel)? Only
then is fusing RMSNorm, SiLU-and-mul and the residual add into GEMV prologues and epilogues worth
building. The kernel is the engine's (flashstack/engine/kernels/triton_gemv.py, tested in
tests/engine/kernels/test_triton_gemv.py), swept over launch configurations here.
"""

from __future__ import annotations

import argparse
import itertools
import json
import traceback
from pathlib import Path

import torch

from flashstack.engine.kernels.triton_gemv import gemv_triton

COPY_BW = 4.26e12
SHAPES = {  # name: (N, K) of the weight, as nn.Linear stores it
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}


def graph_us(fn, iters: int = 20, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (iters * reps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    result: dict = {}
    configs = list(itertools.product((2, 4, 8, 16), (512, 1024), (4, 8)))
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        nbytes = n * k * 2
        row = {"cublas_us": round(graph_us(lambda: torch.nn.functional.linear(x, w)), 2)}
        row["cublas_tb_s"] = round(nbytes / row["cublas_us"] / 1e6, 2)
        best = None
        for bn, bk, warps in configs:
            try:
                us = graph_us(lambda: gemv_triton(w, x, None, (bn, bk, warps)))
            except Exception:
                row[f"n{bn}_k{bk}_w{warps}"] = traceback.format_exc()[-200:]
                continue
            if best is None or us < best[0]:
                best = (us, f"n{bn}_k{bk}_w{warps}")
        if best is not None:
            torch.testing.assert_close(gemv_triton(w, x).float(), torch.nn.functional.linear(x, w).float(), atol=2.0, rtol=5e-2)
            row["triton_best"] = best[1]
            row["triton_us"] = round(best[0], 2)
            row["triton_tb_s"] = round(nbytes / best[0] / 1e6, 2)
        result[name] = row
        print(name, row, flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

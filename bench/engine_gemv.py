"""Batch-1 GEMV per 8B projection, Triton vs cuBLAS: docs/benchmarks.md, "Batch-1 GEMV"."""

from __future__ import annotations

import argparse
import itertools
import json
import traceback
from pathlib import Path

import torch

from flashstack.engine.kernels.triton_gemv import gemv_triton

SHAPES = {  # name: (N, K) of the weight, as nn.Linear stores it
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}


def graph_us(fn, iters: int = 20, reps: int = 5) -> float:
    """µs per call of fn(i), i = 0..iters-1, captured in one CUDA graph and replayed `reps`
    times."""
    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(iters):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (iters * reps)


def sweep(fn, configs) -> tuple[float, str] | None:
    """Fastest (µs, config name) of `fn(i, config)` over `configs`."""
    best = None
    for config in configs:
        try:
            us = graph_us(lambda i: fn(i, config))
        except Exception:
            traceback.print_exc()
            continue
        if best is None or us < best[0]:
            best = (us, "n{}_k{}_w{}".format(*config))
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    result: dict = {}
    configs = list(itertools.product((2, 4, 8, 16), (512, 1024), (4, 8)))
    for name, (n, k) in SHAPES.items():
        # Enough copies of the weight that a graph of 20 calls reads from memory, not from the
        # 50 MB L2, as a decode step does.
        ws = [
            torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
            for _ in range(-(-400_000_000 // (n * k * 2)))
        ]
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        nbytes = n * k * 2
        row = {
            "cublas_us": round(
                graph_us(lambda i: torch.nn.functional.linear(x, ws[i % len(ws)])), 2
            )
        }
        row["cublas_tb_s"] = round(nbytes / row["cublas_us"] / 1e6, 2)
        row["triton_default_us"] = round(graph_us(lambda i: gemv_triton(ws[i % len(ws)], x)), 2)
        torch.testing.assert_close(
            gemv_triton(ws[0], x).float(),
            torch.nn.functional.linear(x, ws[0]).float(),
            atol=2.0,
            rtol=5e-2,
        )
        if name == "lm_head":  # the one projection the decoder runs unfused
            best = sweep(lambda i, c: gemv_triton(ws[i % len(ws)], x, None, c), configs)
            row["triton_best"], row["triton_best_us"] = best[1], round(best[0], 2)
        else:
            row.update(fused_variant(name, ws, x, configs))
        result[name] = row
        print(name, row, flush=True)
    result["layer_chain"] = layer_chain()
    print("layer_chain", result["layer_chain"], flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


def layer_chain(layers: int = 8) -> dict:
    """The four projections of `layers` decoder layers back to back in one graph, each layer its own
    weights (3.5 GB: nothing stays in L2, as in a decode step): the fused Triton GEMVs with and
    without programmatic dependent launch, and cuBLAS with the separate kernels it needs."""
    from flashstack.engine.kernels.triton_elementwise import rmsnorm_triton, silu_and_mul_triton

    h, inter, qkv = 4096, 14336, 6144
    dev, dt = "cuda", torch.bfloat16
    ws = [
        (
            torch.randn(qkv, h, dtype=dt, device=dev),
            torch.randn(h, h, dtype=dt, device=dev),
            torch.randn(2 * inter, h, dtype=dt, device=dev),
            torch.randn(h, inter, dtype=dt, device=dev),
        )
        for _ in range(layers)
    ]
    g = torch.ones(h, dtype=dt, device=dev)
    residual = torch.randn(1, h, dtype=dt, device=dev)
    attn = torch.randn(1, h, dtype=dt, device=dev)
    nbytes = sum(w.numel() * 2 for layer in ws for w in layer)

    def fused(pdl: bool) -> None:
        for w_qkv, w_o, w_gu, w_d in ws:
            gemv_triton(w_qkv, residual, norm=(g, 1e-5), pdl=pdl)
            gemv_triton(w_o, attn, residual=residual, pdl=pdl)
            gate_up = gemv_triton(w_gu, residual, norm=(g, 1e-5), pdl=pdl)
            gemv_triton(w_d, gate_up, silu=True, residual=residual, pdl=pdl)

    def cublas(pdl: bool) -> None:
        linear = torch.nn.functional.linear
        res = residual
        for w_qkv, w_o, w_gu, w_d in ws:
            x, _ = rmsnorm_triton(res, g, 1e-5)
            linear(x, w_qkv)
            x, res = rmsnorm_triton(linear(attn, w_o), g, 1e-5, res)
            linear(silu_and_mul_triton(linear(x, w_gu)), w_d)

    out = {}
    for name, fn, pdl in (
        ("triton_pdl", fused, True),
        ("triton", fused, False),
        ("cublas", cublas, False),
    ):
        us = graph_us(lambda i, fn=fn, pdl=pdl: fn(pdl), iters=1, reps=20) / layers
        out[name] = {"us_per_layer": round(us, 2), "tb_s": round(nbytes / layers / us / 1e6, 2)}
    return out


def fused_variant(name: str, ws: list[torch.Tensor], x: torch.Tensor, configs) -> dict:
    """The GEMV with the work the decoder folds into it (models/ops.py, Batch1Ops), against cuBLAS
    plus the separate kernel it replaces: the RMSNorm before q/k/v and gate/up, SiLU-and-mul before
    down and the residual add after o and down."""
    from flashstack.engine.kernels.triton_elementwise import rmsnorm_triton, silu_and_mul_triton

    n, k = ws[0].shape
    g = torch.rand(k, dtype=x.dtype, device=x.device) + 0.5
    residual = torch.randn(1, n, dtype=x.dtype, device=x.device)
    gate_up = torch.randn(1, 2 * k, dtype=x.dtype, device=x.device)
    linear = torch.nn.functional.linear
    if name in ("qkv", "gate_up"):
        fused = lambda i, c: gemv_triton(ws[i % len(ws)], x, None, c, norm=(g, 1e-5))  # noqa: E731
        unfused = lambda i: linear(rmsnorm_triton(x, g, 1e-5)[0], ws[i % len(ws)])  # noqa: E731
        what = "norm"
    elif name == "o":
        fused = lambda i, c: gemv_triton(ws[i % len(ws)], x, None, c, residual=residual)  # noqa: E731
        unfused = lambda i: linear(x, ws[i % len(ws)]) + residual  # noqa: E731
        what = "residual"
    else:
        fused = lambda i, c: gemv_triton(  # noqa: E731
            ws[i % len(ws)], gate_up, None, c, silu=True, residual=residual
        )
        unfused = lambda i: (  # noqa: E731
            linear(silu_and_mul_triton(gate_up), ws[i % len(ws)]) + residual
        )
        what = "silu+residual"
    best = sweep(fused, configs)
    out = {
        "fused": what,
        "cublas_unfused_us": round(graph_us(unfused), 2),
        "fused_default_us": round(graph_us(lambda i: fused(i, None)), 2),
    }
    if best is not None:
        out["fused_best"], out["fused_best_us"] = best[1], round(best[0], 2)
        out["fused_best_tb_s"] = round(n * k * 2 / best[0] / 1e6, 2)
    return out


if __name__ == "__main__":
    main()

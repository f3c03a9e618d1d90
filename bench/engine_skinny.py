"""Skinny GEMM per 8B projection at M = 8..128 rows, Triton vs cuBLAS: docs/benchmarks.md,
"Skinny GEMM"; `--shapes small --no-sweep`: the small models' projections at their defaults.
`--fp8`: the same weights quantized to fp8 (one scale per row), the skinny GEMM with fp8
activations (W8A8, the activation quantization kernel timed with it) and without (W8A16) beside
bf16's figures: docs/benchmarks.md, "fp8 weights"."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from bench._roofline import H200_COPY_BW
from bench.engine_gemv import SHAPES, graph_us
from flashstack.engine.kernels.triton_skinny import (
    compile_skinny,
    fp8_skinny_config,
    row_tile,
    skinny_applies,
    skinny_config,
    skinny_linear,
)
from flashstack.engine.quantization import fp8_activations_linear, quantize_rows

# (BLOCK_N, BLOCK_K, warps, stages) swept, each with SPLIT_K 1, 2 and 4 where the split leaves
# fewer than 4 programs per SM.
TILES = [
    (16, 512, 4, 3),
    (32, 256, 4, 4),
    (64, 128, 4, 4),
    (64, 256, 4, 3),
    (64, 256, 4, 4),
    (128, 128, 8, 4),
]
# The small models' projections (N, K), for `--shapes small`: SmolLM2-135M, the Qwen3-0.6B shape,
# the Llama-3.2-1B shape (its gate/up, over LARGE_WEIGHT, is sized like the 8B's rules).
SMALL_SHAPES = {
    "smollm2_qkv": (960, 576),
    "smollm2_o": (576, 576),
    "smollm2_gate_up": (3072, 576),
    "smollm2_down": (576, 1536),
    "qwen3_qkv": (4096, 1024),
    "qwen3_o": (1024, 2048),
    "qwen3_gate_up": (6144, 1024),
    "qwen3_down": (1024, 3072),
    "llama1b_qkv": (3072, 2048),
    "llama1b_o": (2048, 2048),
    "llama1b_gate_up": (16384, 2048),
    "llama1b_down": (2048, 8192),
}
WIDE_M_TILES = [(64, 128, 4, 4), (64, 128, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3)]
# (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages) swept for fp8 weights and activations (one byte a
# value: longer chunks and more stages fit shared memory)
FP8_TILES = [
    (64, 256, 1, 4, 6),
    (64, 256, 1, 4, 4),
    (64, 256, 2, 4, 4),
    (64, 128, 1, 4, 6),
    (64, 512, 1, 4, 4),
    (128, 128, 1, 8, 4),
    (128, 128, 1, 8, 3),
    (128, 256, 1, 8, 3),
]
SMS = 132


def candidates(m: int, n: int, k: int) -> list[tuple[int, ...]]:
    """Launch configurations (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages) swept for one product."""
    out = []
    for bn, bk, warps, stages in WIDE_M_TILES if m > 64 else TILES:
        if bn < m:  # x is re-read from L2 once per column tile: keep that under the weight's bytes
            continue
        for split in (1, 2, 4):
            if split > 1 and (-(-n // bn) * split > 4 * SMS or k % (split * bk)):
                continue
            out.append((bn, bk, split, warps, stages))
    default = skinny_config(m, n, k)
    return out if default in out else [default, *out]


def _compile(job: tuple) -> str | None:
    try:
        compile_skinny(*job)
    except Exception as e:  # a configuration out of shared memory is skipped in the sweep too
        return f"{job}: {type(e).__name__}"
    return None


def precompile(shapes: dict, ms: list[int], workers: int) -> dict:
    """Compile every swept kernel in `workers` processes (Triton's disk cache keeps them), so the
    sweep itself only launches."""
    jobs = {
        (m, n, k, torch.bfloat16, c)
        for n, k in shapes.values()
        for m in ms
        for c in candidates(m, n, k)
    }
    # one job per distinct kernel: its row tile and constants (M itself is not specialized)
    unique = {}
    for job in sorted(jobs, key=str):
        m, n, k, _, c = job
        unique.setdefault((row_tile(m, n, k), c[:2], c[2] > 1, c[3:]), job)
    t = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        failed = [f for f in pool.map(_compile, unique.values()) if f]
    return {"kernels": len(unique), "s": round(time.perf_counter() - t, 1), "failed": failed}


def shape_rows(name: str, n: int, k: int, ms: list[int], sweep: bool) -> dict:
    """cuBLAS and the skinny GEMM (its default configuration and the sweep's best) on one weight
    shape at each M."""
    # Enough copies of the weight that a graph of 20 calls reads from memory, not from the 50 MB L2,
    # as a decode step does.
    ws = [
        torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
        for _ in range(-(-400_000_000 // (n * k * 2)))
    ]
    xs = torch.randn(max(ms), k, dtype=torch.bfloat16, device="cuda")
    nbytes = n * k * 2
    rows = {}
    for m in ms:
        x = xs[:m]
        ref = torch.nn.functional.linear(x, ws[0]).float()
        try:
            err = (skinny_linear(x, ws[0]).float() - ref).abs().max().item()
        except Exception:
            rows[str(m)] = {"error": traceback.format_exc()[-1500:]}
            print(name, m, rows[str(m)], flush=True)
            continue
        row = {
            "max_abs_err_vs_cublas": err,
            "max_abs_out": ref.abs().max().item(),
            "cublas_us": round(
                graph_us(lambda i: torch.nn.functional.linear(x, ws[i % len(ws)])), 2
            ),
            "default": "m{}_n{}_k{}_s{}_w{}_st{}".format(
                row_tile(m, n, k), *skinny_config(m, n, k)
            ),
            "engine_takes_it": skinny_applies(m, n, k, small_weights=True),
            "default_us": round(graph_us(lambda i: skinny_linear(x, ws[i % len(ws)])), 2),
        }
        if sweep:
            timed = []
            for c in candidates(m, n, k):
                try:
                    us = graph_us(lambda i, c=c: skinny_linear(x, ws[i % len(ws)], None, c))
                except Exception:
                    continue
                timed.append((us, c))
            if timed:  # every candidate may fail on a shape: the default still stands
                us, c = min(timed)
                row["best"], row["best_us"] = "n{}_k{}_s{}_w{}_st{}".format(*c), round(us, 2)
                row["sweep"] = {"n{}_k{}_s{}_w{}_st{}".format(*c): round(u, 2) for u, c in timed}
        best_us = row.get("best_us", row["default_us"])
        row["cublas_tb_s"] = round(nbytes / row["cublas_us"] / 1e6, 2)
        row["skinny_tb_s"] = round(nbytes / best_us / 1e6, 2)
        row["skinny_over_cublas"] = round(best_us / row["cublas_us"], 3)
        rows[str(m)] = row
        print(name, m, {k: v for k, v in row.items() if k != "sweep"}, flush=True)
    return rows


def fp8_shape_rows(name: str, n: int, k: int, ms: list[int], sweep: bool) -> dict:
    """fp8 weights on one shape at each M: W8A8 at fp8_skinny_config's configuration (and the
    sweep's best), W8A16, each checked against its plain-torch product."""
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
    copies = [quantize_rows(w) for _ in range(-(-400_000_000 // (n * k)))]
    xs = torch.randn(max(ms), k, dtype=torch.bfloat16, device="cuda")
    floor_us = n * k / H200_COPY_BW * 1e6  # fp8: a byte a weight
    rows = {}
    for m in ms:
        x = xs[:m]
        q, scale = copies[0]
        ref = fp8_activations_linear(x, q, scale, None).float()
        err = (skinny_linear(x, q, scale=scale).float() - ref).abs().max().item()

        def w8a8(i: int, c: tuple | None = None) -> None:
            skinny_linear(x, copies[i % len(copies)][0], config=c, scale=copies[i % len(copies)][1])

        def w8a16(i: int) -> None:
            q, scale = copies[i % len(copies)]
            skinny_linear(x, q, scale=scale, fp8_activations=False)

        row = {
            "floor_us": round(floor_us, 2),
            "w8a8_max_abs_err_vs_torch": err,
            "max_abs_out": ref.abs().max().item(),
            "w8a8_default": "n{}_k{}_s{}_w{}_st{}".format(*fp8_skinny_config(m, n, k)),
            "w8a8_default_us": round(graph_us(w8a8), 2),
            "w8a16_us": round(graph_us(w8a16), 2),
        }
        if sweep:
            timed = []
            for c in FP8_TILES:
                try:
                    timed.append((graph_us(lambda i, c=c: w8a8(i, c)), c))
                except Exception:  # out of shared memory at this row tile
                    continue
            if timed:
                us, c = min(timed)
                row["w8a8_best"] = "n{}_k{}_s{}_w{}_st{}".format(*c)
                row["w8a8_best_us"] = round(us, 2)
        rows[str(m)] = row
        print(name, "fp8", m, row, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--ms", default="8,16,32,64,128")
    ap.add_argument(
        "--shapes",
        default=",".join(SHAPES),
        help=f"comma-separated, of {sorted(SHAPES)} (the 8B's), {sorted(SMALL_SHAPES)}, or "
        "small (every small model's)",
    )
    ap.add_argument("--workers", type=int, default=14, help="processes compiling the sweep")
    ap.add_argument("--no-sweep", action="store_true", help="only the default configurations")
    ap.add_argument("--fp8", action="store_true", help="also fp8 weights, W8A8 and W8A16")
    ap.add_argument(
        "--sweep-budget-s", type=float, default=40.0, help="later shapes only time the defaults"
    )
    args = ap.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    known = {**SHAPES, **SMALL_SHAPES}
    names = [
        n for name in args.shapes.split(",") for n in (SMALL_SHAPES if name == "small" else [name])
    ]
    shapes = {name: known[name] for name in names}
    result: dict = {"gpu": torch.cuda.get_device_name(), "copy_bw_tb_s": H200_COPY_BW / 1e12}
    if not args.no_sweep:
        try:
            result["precompile"] = precompile(shapes, ms, args.workers)
        except Exception:
            result["precompile_error"] = traceback.format_exc()[-1500:]
        print("precompile", result.get("precompile"), flush=True)
    t = time.perf_counter()
    for name, (n, k) in shapes.items():
        sweep = not args.no_sweep and time.perf_counter() - t < args.sweep_budget_s
        result[name] = shape_rows(name, n, k, ms, sweep)
        torch.cuda.empty_cache()
        if args.fp8:
            result[f"{name}_fp8"] = fp8_shape_rows(name, n, k, ms, sweep)
            torch.cuda.empty_cache()
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
    # The 32 layers' four projections plus lm_head, from the figures above: the matmul part of a
    # decode step at each M.
    if all(s in shapes for s in SHAPES):
        chain = {}
        for m in ms:
            rows = [(result[s][str(m)], 1 if s == "lm_head" else 32) for s in SHAPES]
            if all("cublas_us" in row for row, _ in rows):
                chain[str(m)] = {
                    "cublas": round(sum(r["cublas_us"] * c for r, c in rows) / 1000, 3),
                    "skinny": round(
                        sum(r.get("best_us", r["default_us"]) * c for r, c in rows) / 1000, 3
                    ),
                }
        result["step_matmuls_ms"] = chain
        print("step_matmuls_ms", chain, flush=True)
    text = json.dumps(result, indent=1)
    if args.json:
        args.json.write_text(text)


if __name__ == "__main__":
    main()

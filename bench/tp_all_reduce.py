"""Tensor-parallel batch-1 all-reduce in the GEMV chain: docs/benchmarks.md, "TP all-reduce"."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench._roofline import H200_COPY_BW
from bench.engine_gemv_chain import (
    HEAD_DIM,
    HEADS,
    HIDDEN,
    INTER,
    KV_HEADS,
    LAYERS,
    graph_ms,
    layer_weights,
)


def _reduce(tp: Any, kind: str, staged: torch.Tensor) -> torch.Tensor:
    if kind == "none":  # each rank goes on with its own partial
        return staged
    if kind == "nccl":
        dist.all_reduce(staged, group=tp.group)
        return staged
    return tp.fast.reduce(staged)


def _row_parallel(
    tp: Any, kind: str, weight: torch.Tensor, x: torch.Tensor, residual: torch.Tensor, silu: bool
) -> torch.Tensor:
    from flashstack.engine.kernels.triton_gemv import gemv_triton

    own_residual = residual if tp.is_driver else None
    staged = tp.fast.stage((1, HIDDEN))
    gemv_triton(weight, x, silu=silu, residual=own_residual, out=staged)
    return _reduce(tp, kind, staged)


def _chain(
    tp: Any, layers: list[dict[str, torch.Tensor]], kind: str, x: torch.Tensor, norm: torch.Tensor
) -> torch.Tensor:
    from flashstack.engine.kernels.triton_gemv import gemv_triton

    residual, q = x, HEADS * HEAD_DIM // tp.world_size
    for lw in layers:
        qkv = gemv_triton(lw["qkv"], residual, norm=(norm, 1e-5))
        residual = _row_parallel(tp, kind, lw["o"], qkv[:, :q].contiguous(), residual, silu=False)
        gate_up = gemv_triton(lw["gate_up"], residual, norm=(norm, 1e-5))
        residual = _row_parallel(tp, kind, lw["down"], gate_up, residual, silu=True)
    return residual


def _rank(
    rank: int, world: int, port: int, kinds: list[str], block: int, warps: list[int], results: Any
) -> None:
    from flashstack.engine.config import KernelOptions
    from flashstack.engine.tp.group import disable_multicast, init_rank, leave_group

    disable_multicast()
    device = torch.device("cuda", rank)
    tp = init_rank(rank, world, port, device, kernels=KernelOptions(tp_all_reduce_block=block))
    tp.enable_fast_all_reduce(32 * HIDDEN, torch.bfloat16)
    gen = torch.Generator(device).manual_seed(rank)
    layers = layer_weights(world, gen, device)
    norm = torch.ones(HIDDEN, dtype=torch.bfloat16, device=device)
    x = torch.randn(1, HIDDEN, generator=gen, device=device).to(torch.bfloat16)
    out: dict[str, Any] = {}
    # The push keeps its inbox's values per program (--block, at start-up) and sweeps warps.
    variants = [(k, w) for k in kinds for w in (warps if k == "push" else [0])]
    for kind, warp in variants:
        name = f"push/{block}/{warp}" if kind == "push" else kind
        tp.fast.warps = warp or 4
        out[f"chain_ms/{name}"] = graph_ms(
            lambda: _chain(tp, layers, kind, x.clone(), norm), 30, dist.barrier
        )
        if kind == "none":
            continue
        for numel in (HIDDEN, 32 * HIDDEN):
            h0 = torch.randn(numel, generator=gen, device=device).to(torch.bfloat16)

            def alone(h0: torch.Tensor = h0, numel: int = numel) -> None:
                h = h0
                for _ in range(64):
                    staged = tp.fast.stage((numel,))
                    staged.copy_(h)
                    h = _reduce(tp, kind, staged)

            out[f"alone_us/{numel * 2 // 1024}KB/{name}"] = (
                graph_ms(alone, 30, dist.barrier) * 1000 / 64
            )
    results.put((rank, out))
    leave_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--kinds", default="none,push,nccl")
    ap.add_argument(
        "--block", type=int, default=2048, help="values per program of our push kernels"
    )
    ap.add_argument("--warps", default="4", help="warps per program of our kernels")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import multiprocessing as mp

    from flashstack.engine.tp.group import master_store

    store = master_store(args.world)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    warps = [int(w) for w in args.warps.split(",")]
    procs = [
        ctx.Process(
            target=_rank,
            args=(r, args.world, store.port, args.kinds.split(","), args.block, warps, results),
        )
        for r in range(args.world)
    ]
    for p in procs:
        p.start()
    per_rank = dict(results.get(timeout=900) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    rank0 = per_rank[0]
    q = HEADS * HEAD_DIM // args.world
    kv, inter = KV_HEADS * HEAD_DIM // args.world, INTER // args.world
    layer_bytes = 2 * HIDDEN * ((q + 2 * kv) + q + 2 * inter + inter)
    floor_ms = LAYERS * layer_bytes / H200_COPY_BW * 1e3
    report: dict[str, Any] = {
        "world": args.world,
        "rank0": rank0,
        "rank1": per_rank.get(1),
        "chain_floor_ms": round(floor_ms, 4),
    }
    none = rank0.get("chain_ms/none")
    for key, ms in rank0.items():
        if key.startswith("chain_ms/"):
            report[f"fraction_of_floor/{key[9:]}"] = round(floor_ms / ms, 3)
            if none is not None and key != "chain_ms/none":
                report[f"per_all_reduce_us/{key[9:]}"] = round((ms - none) * 1000 / (2 * LAYERS), 2)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()

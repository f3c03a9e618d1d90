"""Batch-1 GEMV launch configurations in the 32-layer chain: docs/benchmarks.md, "GEMV chain"."""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench._roofline import H200_COPY_BW
from flashstack.engine.kernels.triton_gemv import gemv_config, gemv_triton

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 4096, 14336, 32, 8, 128, 32
PROJECTIONS = ("qkv", "o", "gate_up", "down")
FUSED = {"qkv": "norm", "o": "residual", "gate_up": "norm", "down": "silu"}


# A decoder's GEMV shapes: (hidden, intermediate, q width, k/v width, layers)
LLAMA3_8B = (HIDDEN, INTER, HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, LAYERS)


def layer_weights(
    world: int,
    gen: torch.Generator,
    device: torch.device | str = "cuda",
    shape: tuple[int, int, int, int, int] = LLAMA3_8B,
    std: float = 0.01,
) -> list[dict[str, torch.Tensor]]:
    """One rank's q/k/v, o, gate/up and down weights for each layer of `shape` (bf16, random)."""
    hidden, inter, q, kv, layers = shape

    def w(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, generator=gen, device=device) * std).to(torch.bfloat16)

    q, kv, inter = q // world, kv // world, inter // world
    return [
        {
            "qkv": w(q + 2 * kv, hidden),
            "o": w(hidden, q),
            "gate_up": w(2 * inter, hidden),
            "down": w(hidden, inter),
        }
        for _ in range(layers)
    ]


def _chain(
    layers: list[dict[str, torch.Tensor]],
    configs: dict[str, Any],
    world: int,
    x: torch.Tensor,
    norm: torch.Tensor,
) -> None:
    q = layers[0]["o"].shape[1]  # this rank's q width
    residual = x.clone()
    for lw in layers:
        qkv = gemv_triton(lw["qkv"], residual, config=configs["qkv"], norm=(norm, 1e-5))
        # a rank's partial, as for the all-reduce
        out = None if world == 1 else torch.empty_like(residual)
        residual = gemv_triton(lw["o"], qkv[:, :q], config=configs["o"], residual=residual, out=out)
        gate_up = gemv_triton(lw["gate_up"], residual, config=configs["gate_up"], norm=(norm, 1e-5))
        out = None if world == 1 else torch.empty_like(residual)
        residual = gemv_triton(
            lw["down"], gate_up, config=configs["down"], silu=True, residual=residual, out=out
        )


def graph_ms(fn: Any, replays: int = 20, before_replay: Any = None) -> float:
    """Median ms of `fn` captured in one CUDA graph (after a warm-up call that compiles), over
    `replays` replays; `before_replay()` runs before each (e.g. a barrier across ranks)."""
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    times = []
    for _ in range(replays):
        if before_replay is not None:
            before_replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _label(config: tuple[int, ...]) -> str:
    return "n{}_k{}_w{}".format(*config) + (f"_s{config[3]}" if len(config) > 3 else "")


def sweep_world(world: int, candidates: list[tuple[int, int, int]]) -> dict[str, Any]:
    gen = torch.Generator("cuda").manual_seed(world)
    layers = layer_weights(world, gen)
    x = torch.randn(1, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
    norm = torch.ones(HIDDEN, dtype=torch.bfloat16, device="cuda")
    shapes = {name: tuple(layers[0][name].shape) for name in PROJECTIONS}
    defaults = {name: gemv_config(*shapes[name], FUSED[name]) for name in PROJECTIONS}
    floor_ms = sum(w.numel() * 2 for lw in layers for w in lw.values()) / H200_COPY_BW * 1e3

    def time(configs: dict[str, Any]) -> float:
        return graph_ms(lambda: _chain(layers, configs, world, x, norm))

    def fits(name: str, config: tuple[int, ...]) -> bool:
        return not (name == "down" and config[1] > shapes[name][1])

    swept = sweep(time, defaults, candidates, floor_ms, _label, fits, tag=str(world))
    return {"shapes": shapes, **swept}


# Small models' layers (hidden, intermediate, q width, k/v width, layers) and the configurations
# swept over them (docs/benchmarks.md, "GEMV chain": small models' chains).
SMALL_MODELS = {
    "smollm2-135m": (576, 1536, 576, 192, 30),
    "qwen3-0.6b": (1024, 3072, 2048, 1024, 28),
    "llama3.2-1b": (2048, 8192, 2048, 512, 16),
}
SMALL_CANDIDATES = [
    (2, 1024, 4),
    (4, 1024, 4),
    (8, 1024, 4),
    (4, 512, 4),
    (8, 512, 4),
    (16, 512, 8),
    (2, 512, 4),
    (4, 1024, 4, 2),
    (8, 1024, 4, 3),
    (4, 2048, 4, 2),
    (8, 512, 4, 3),
    (16, 1024, 8, 3),
    (4, 256, 4),
    (8, 256, 4),
]


def sweep_small(name: str) -> dict[str, Any]:
    """A small model's four fused batch-1 GEMVs for all its layers in one graph (bf16, random
    weights), SMALL_CANDIDATES swept per projection from gemv_config's."""
    shape = SMALL_MODELS[name]
    gen = torch.Generator("cuda").manual_seed(0)
    layers = layer_weights(1, gen, shape=shape, std=0.02)
    x = torch.randn(1, shape[0], generator=gen, device="cuda").to(torch.bfloat16)
    norm = torch.ones(shape[0], dtype=torch.bfloat16, device="cuda")
    defaults = {p: gemv_config(*layers[0][p].shape, FUSED[p]) for p in PROJECTIONS}
    floor_ms = sum(t.numel() * 2 for lw in layers for t in lw.values()) / H200_COPY_BW * 1e3
    return sweep(
        lambda c: graph_ms(lambda: _chain(layers, c, 1, x, norm)),
        defaults,
        SMALL_CANDIDATES,
        floor_ms,
        tag=name,
    )


def sweep(
    time: Callable[[dict[str, Any]], float],
    defaults: dict[str, Any],
    candidates: list[Any],
    floor_ms: float,
    label: Callable[[Any], str] = str,
    fits: Callable[[str, Any], bool] = lambda _name, _config: True,
    tag: str = "sweep",
) -> dict[str, Any]:
    """Coordinate descent over launch configurations: each key of `defaults` in turn takes the
    candidate that makes `time(configs)` (ms) fastest with the others held at their best so far;
    the winners are timed together again at the end. A configuration the compiler rejects is
    recorded with its error and skipped."""
    best = dict(defaults)
    default_ms = best_ms = time(best)
    tried: dict[str, dict[str, Any]] = {}
    for name in defaults:
        tried[name] = {}
        for config in candidates:
            if not fits(name, config):
                continue
            try:
                ms = time({**best, name: config})
            except Exception as exc:  # a configuration the compiler rejects
                tried[name][label(config)] = repr(exc)[:80]
                continue
            tried[name][label(config)] = round(ms, 4)
            if ms < best_ms:
                best_ms, best[name] = ms, config
        print(tag, name, best[name], round(best_ms, 4), flush=True)
    final_ms = time(best)  # the winners together, timed again
    return {
        "floor_ms": round(floor_ms, 4),
        "default": {
            "configs": defaults,
            "chain_ms": round(default_ms, 4),
            "fraction_of_floor": round(floor_ms / default_ms, 4),
        },
        "best": {
            "configs": best,
            "chain_ms": round(final_ms, 4),
            "fraction_of_floor": round(floor_ms / final_ms, 4),
        },
        "tried_ms": tried,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--world", default="1,2", help="tensor-parallel sizes whose per-rank shapes to sweep"
    )
    ap.add_argument("--rows", default="2,4,8,16")
    ap.add_argument("--chunks", default="512,1024")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument(
        "--stages",
        default="0",
        help="0: the next chunk in registers; n > 1: n - 1 chunks ahead "
        "through shared memory (Triton's pipeliner)",
    )
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--models",
        help=f"instead: small models' chains, comma-separated of {sorted(SMALL_MODELS)}, each "
        "over SMALL_CANDIDATES",
    )
    args = ap.parse_args()
    if args.models:
        report = {name: sweep_small(name) for name in args.models.split(",")}
        if args.out:
            args.out.write_text(json.dumps(report, indent=1))
        print(
            json.dumps({k: {"default": v["default"], "best": v["best"]} for k, v in report.items()})
        )
        return
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    candidates = list(
        itertools.product(ints(args.rows), ints(args.chunks), ints(args.warps), ints(args.stages))
    )
    report = {f"world{w}": sweep_world(w, candidates) for w in ints(args.world)}
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text)
    print(
        json.dumps(
            {k: {"default": v["default"], "best": v["best"]} for k, v in report.items()}, indent=1
        )
    )


if __name__ == "__main__":
    main()

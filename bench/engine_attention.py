"""Split-KV decode kernel launch sweep: docs/benchmarks.md, "Decode attention launch"; with
`--fp8`, decode attention over an fp8 KV cache beside bf16: docs/benchmarks.md, "fp8 KV cache";
with `--mixed`, over a batch of mixed context lengths: docs/benchmarks.md, "Throughput"; with
`--wave`, kernels.decode_wave_tma on and off under PDL: docs/benchmarks.md, "Decode attention
launch"."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_long import decode_kernel_bandwidth  # noqa: E402

WORKLOADS = {  # name: (batch, context, heads, kv_heads, grid context)
    "qwen3-0.6b throughput, b256 ctx 860": (256, 860, 16, 8, 4096),
    "llama3-8b b1 ctx 576": (1, 576, 32, 8, 4096),
    "llama3-8b b32 ctx 576": (32, 576, 32, 8, 4096),
    "llama3-8b b128 ctx 576": (128, 576, 32, 8, 4096),
    "llama3-8b b4 ctx 32K": (4, 32768, 32, 8, 32768),
}


# name: (batch, context, heads, kv_heads, the context the grid is sized for: the engine's
# max_model_len)
FP8_WORKLOADS = {
    "llama3-8b b1 ctx 32K": (1, 32768, 32, 8, 32768),
    "llama3-8b b4 ctx 32K": (4, 32768, 32, 8, 32768),
    "llama3-8b b32 ctx 4K": (32, 4096, 32, 8, 4096),
    "llama3-8b b32 ctx 576 (grid 4K)": (32, 576, 32, 8, 4096),
    "llama3-8b b128 ctx 576 (grid 4K)": (128, 576, 32, 8, 4096),
}
# fp8 launches tried beside the engine's: TMA or not, byte tiles or word pairs, stages, splits
FP8_LAUNCHES = {
    # the engine's: tiles as 16-bit words, V as fetched (kernels.decode_fp8_pairs)
    "default": {"fp8_pairs": True, "unmasked_v": True},
    "byte tiles": {},  # the launch before decode_fp8_pairs
    "plain": {"tma": False},
    "tma s3": {"num_stages": 3},
    "tma s4": {"num_stages": 4},
    "tma s2 x2 splits": {"num_stages": 2, "splits_factor": 2},
    "tma s3 x2 splits": {"num_stages": 3, "splits_factor": 2},
    "tma s3 w8": {"num_stages": 3, "num_warps": 8},
    "plain w8": {"tma": False, "num_warps": 8},
    # q @ K on the fp8 tensor cores, K's tiles as stored (kernels.decode_fp8_qk)
    "pairs, V zeroed": {"fp8_pairs": True},
    "pairs s3": {"fp8_pairs": True, "unmasked_v": True, "num_stages": 3},
    "pairs s4": {"fp8_pairs": True, "unmasked_v": True, "num_stages": 4},
    "pairs w8": {"fp8_pairs": True, "unmasked_v": True, "num_warps": 8},
    # more programs in flight an SM: more splits, or 64-token tiles (half the shared memory)
    "pairs x2 splits": {"fp8_pairs": True, "unmasked_v": True, "splits_factor": 2},
    "pairs x3 splits": {"fp8_pairs": True, "unmasked_v": True, "splits_factor": 3},
    "pairs bn64": {"fp8_pairs": True, "unmasked_v": True, "block_n": 64},
    # fewer, longer tiles: a tile loop's fixed chain (the row maximum, the rescale) over twice
    # the tokens, one program an SM
    "pairs bn256": {"fp8_pairs": True, "unmasked_v": True, "block_n": 256},
    "pairs bn256 half splits": {
        "fp8_pairs": True,
        "unmasked_v": True,
        "block_n": 256,
        "splits_factor": 0.5,
    },
    "pairs bn64 x2 splits": {
        "fp8_pairs": True,
        "unmasked_v": True,
        "block_n": 64,
        "splits_factor": 2,
    },
    "pairs bn64 x4 splits": {
        "fp8_pairs": True,
        "unmasked_v": True,
        "block_n": 64,
        "splits_factor": 4,
    },
    "pairs bn64 s3 x2 splits": {
        "fp8_pairs": True,
        "unmasked_v": True,
        "block_n": 64,
        "num_stages": 3,
        "splits_factor": 2,
    },
    "qk fp8": {"qk_fp8": True},
    "qk fp8 s2": {"qk_fp8": True, "num_stages": 2},
    "qk fp8 w8": {"qk_fp8": True, "num_warps": 8},
    "qk fp8 plain": {"qk_fp8": True, "tma": False},
}


# nano-vllm's throughput workload mid-run (docs/benchmarks.md, "Throughput"): ~208 live sequences
# of 100-2,000 tokens, Qwen3-0.6B heads, the grid sized for max_model_len 4096
MIXED = {"batch": 208, "lengths": (100, 2000), "heads": 16, "kv_heads": 8, "grid": 4096}
# launches over mixed lengths beside the engine's (longest first, plan_decode's tiles and splits)
MIXED_LAUNCHES = {
    "grid order": {},
    "longest first (the engine's)": {"longest_first": True},
    "longest first, sequences first": {"longest_first": True, "heads_first": False},
    "longest first, two stages (decode_deep_tma off)": {"longest_first": True, "deep": False},
    "longest first, 128-token tiles": {"longest_first": True, "block_n": 128},
    "longest first, 2 splits of >= 512": {"longest_first": True, "num_splits": 2, "min_split": 512},
    "longest first, 4 splits of >= 512": {"longest_first": True, "num_splits": 4, "min_split": 512},
    "longest first, 8 splits of >= 256": {"longest_first": True, "num_splits": 8, "min_split": 256},
}


# decode_wave_tma's workloads (docs/benchmarks.md, "Decode attention launch"): 8B heads, (batch,
# context, grid bound)
WAVE_WORKLOADS = [
    (4, 544, 4096),
    (8, 544, 4096),
    (12, 544, 4096),
    (8, 2048, 4096),
    (4, 4096, 4096),
    (8, 4096, 4096),
    (4, 8192, 8192),
    (8, 8192, 8192),
    (8, 544, 16384),
    (8, 16384, 16384),
    (4, 32768, 32768),
    (8, 32768, 32768),
]


def wave_main(json_path: Path | None, pdl: bool) -> None:
    """Each WAVE_WORKLOADS launch with `decode_wave_tma`'s one-wave, three-stage launch and
    without it (plan_decode's `wave`)."""
    result: dict = {}
    for batch, ctx, grid in WAVE_WORKLOADS:
        row = {
            label: decode_kernel_bandwidth(batch, ctx, 256, grid_context=grid, pdl=pdl, wave=wave)
            for label, wave in (("wave off", False), ("wave on", True))
        }
        result[f"batch {batch}, context {ctx}, grid {grid}"] = row
        print(batch, ctx, grid, json.dumps(row), flush=True)
        if json_path:
            json_path.write_text(json.dumps(result, indent=1))


def mixed_main(json_path: Path | None) -> None:
    """One layer's decode attention over a batch of mixed context lengths and over the same
    batch at their mean length, under each of MIXED_LAUNCHES."""
    import torch

    lo, hi = MIXED["lengths"]
    gen = torch.Generator().manual_seed(1)
    mixed = torch.randint(lo, hi, (MIXED["batch"],), generator=gen).tolist()
    batches = {"mixed": mixed, "mean length": [sum(mixed) // len(mixed)] * len(mixed)}
    result: dict = {"workload": MIXED}
    for name, contexts in batches.items():
        for label, launch in MIXED_LAUNCHES.items():
            row = decode_kernel_bandwidth(
                0,
                0,
                256,
                MIXED["kv_heads"],
                MIXED["heads"],
                grid_context=MIXED["grid"],
                contexts=contexts,
                **launch,
            )
            result[f"{name}: {label}"] = row
            print(name, label, row, flush=True)
            if json_path:
                json_path.write_text(json.dumps(result, indent=1))


def fp8_main(json_path: Path | None, only: list[str] | None = None) -> None:
    """bf16 and fp8 KV side by side: each workload's default launch and a few others (`only`:
    those FP8_LAUNCHES labels beside the default)."""
    unknown = sorted(set(only or ()) - set(FP8_LAUNCHES))
    if unknown:
        raise SystemExit(f"unknown --launches {unknown}: pick from {sorted(FP8_LAUNCHES)}")
    chosen = {k: v for k, v in FP8_LAUNCHES.items() if not only or k == "default" or k in only}
    result: dict = {}
    for name, (batch, ctx, heads, kv_heads, grid) in FP8_WORKLOADS.items():
        row: dict = {}
        for kv_dtype in ("bf16", "fp8"):
            runs = {}
            # bf16: its measured default (docs/benchmarks.md, "Decode attention launch")
            launches = chosen if kv_dtype == "fp8" else {"default": {}}
            for label, launch in launches.items():
                try:
                    runs[label] = decode_kernel_bandwidth(
                        batch,
                        ctx,
                        256,
                        kv_heads,
                        heads,
                        grid_context=grid,
                        kv_dtype=kv_dtype,
                        **launch,
                    )
                except Exception:
                    runs[label] = {"error": traceback.format_exc()[-400:]}
            timed = [k for k in runs if "us" in runs[k]]
            best = min(timed, key=lambda k: runs[k]["us"]) if timed else None
            row[kv_dtype] = {"default": runs["default"], "best": best, "all": runs}
        if "us" in row["bf16"]["default"] and "us" in row["fp8"]["default"]:
            row["fp8_speedup_default"] = round(
                row["bf16"]["default"]["us"] / row["fp8"]["default"]["us"], 3
            )
        result[name] = row
        print(
            name,
            json.dumps({k: v["default"] for k, v in row.items() if k != "fp8_speedup_default"}),
            flush=True,
        )
        if json_path:
            json_path.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


def unmasked_v_main(json_path: Path | None, rounds: int = 2) -> None:
    """kernels.decode_unmasked_v off and on, interleaved `rounds` times: every WORKLOADS launch
    (bf16) and every FP8_WORKLOADS one (fp8), each at plan_decode's default launch."""
    cases = {
        name: dict(batch=b, context=c, heads=h, kv_heads=kv, grid_context=g)
        for name, (b, c, h, kv, g) in WORKLOADS.items()
    }
    cases.update(
        {
            f"fp8 {name}": dict(
                batch=b, context=c, heads=h, kv_heads=kv, grid_context=g, kv_dtype="fp8"
            )
            for name, (b, c, h, kv, g) in FP8_WORKLOADS.items()
        }
    )
    result: dict = {}
    for name, case in cases.items():
        runs: dict = {"masked": [], "unmasked": []}
        for _ in range(rounds):
            for label, on in (("masked", False), ("unmasked", True)):
                c = dict(case)
                row = decode_kernel_bandwidth(
                    c.pop("batch"), c.pop("context"), 256, unmasked_v=on, pdl=True, **c
                )
                runs[label].append(row)
        best = {k: min(r["us"] for r in v) for k, v in runs.items()}
        result[name] = {"best_us": best, "runs": runs}
        print(name, json.dumps(best), flush=True)
        if json_path:
            json_path.write_text(json.dumps(result, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--fp8", action="store_true", help="fp8 KV cache beside bf16 (FP8_WORKLOADS)")
    ap.add_argument(
        "--mixed", action="store_true", help="mixed context lengths (MIXED, MIXED_LAUNCHES)"
    )
    ap.add_argument(
        "--wave",
        action="store_true",
        help="kernels.decode_wave_tma on and off (WAVE_WORKLOADS), launched with PDL unless "
        "--no-pdl",
    )
    ap.add_argument(
        "--pdl",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--wave: launch with programmatic dependent launch, as a decode step does",
    )
    ap.add_argument(
        "--unmasked-v",
        action="store_true",
        help="kernels.decode_unmasked_v off and on, interleaved (WORKLOADS and FP8_WORKLOADS)",
    )
    ap.add_argument(
        "--launches",
        help="--fp8: comma-separated FP8_LAUNCHES labels to run beside the default (all if unset)",
    )
    ap.add_argument("--block-n", default="32,64,128")
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--stages", default="1,2,3")
    ap.add_argument(
        "--min-split", default="256", help="fewest tokens a split reads (DECODE_MIN_SPLIT)"
    )
    args = ap.parse_args()
    if args.fp8:
        fp8_main(args.json, args.launches.split(",") if args.launches else None)
        return
    if args.mixed:
        mixed_main(args.json)
        return
    if args.wave:
        wave_main(args.json, args.pdl)
        return
    if args.unmasked_v:
        unmasked_v_main(args.json)
        return
    configs = list(
        itertools.product(
            *(
                map(int, a.split(","))
                for a in (args.min_split, args.block_n, args.warps, args.stages)
            )
        )
    )
    result: dict = {}
    for name, (batch, ctx, heads, kv_heads, grid) in WORKLOADS.items():
        rows = {
            "default": decode_kernel_bandwidth(batch, ctx, 256, kv_heads, heads, grid_context=grid)
        }
        for ms, bn, w, st in configs:
            key = f"m{ms}_n{bn}_w{w}_s{st}"
            try:
                rows[key] = decode_kernel_bandwidth(
                    batch,
                    ctx,
                    256,
                    kv_heads,
                    heads,
                    grid_context=grid,
                    min_split=ms,
                    block_n=bn,
                    num_warps=w,
                    num_stages=st,
                )
            except Exception:
                rows[key] = {"error": traceback.format_exc()[-300:]}
        best = max((k for k in rows if "us" in rows[k]), key=lambda k: -rows[k]["us"])
        result[name] = {
            "best": best,
            "best_row": rows[best],
            "default": rows["default"],
            "all": rows,
        }
        print(name, "default", rows["default"], "best", best, rows[best], flush=True)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

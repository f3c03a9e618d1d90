"""Split-KV decode kernel launch sweep: docs/benchmarks.md, "Decode attention launch"."""

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--block-n", default="32,64,128")
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--stages", default="1,2,3")
    ap.add_argument(
        "--min-split", default="256", help="fewest tokens a split reads (DECODE_MIN_SPLIT)"
    )
    args = ap.parse_args()
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

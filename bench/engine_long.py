"""32K decode attention bandwidth, block sizes, 32K prefill: docs/benchmarks.md, "Long context"."""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._roofline import H200_COPY_BW, card_copy_bandwidth, on_card  # noqa: E402
from bench._shapes import LLAMA3_8B, random_hf_model, save_checkpoint  # noqa: E402

BF16_PEAK = 790e12  # dense bf16 matmul measured on the H200 (shared/GPU.md)


def decode_kernel_bandwidth(
    batch: int,
    context: int,
    block_size: int,
    kv_heads: int = 8,
    heads: int = 32,
    dim: int = 128,
    iters: int = 50,
    grid_context: int | None = None,
    calls_per_graph: int = 10,
    kv_dtype: str = "bf16",
    splits_factor: float | None = None,
    contexts: list[int] | None = None,
    **launch,
) -> dict:
    """KV bytes read per second by one layer's split-KV decode kernel (and its merge) over a paged
    cache. The graph replays `calls_per_graph` launches back to back, as a decode step's graph runs
    its layers, so a graph launch is not counted against each call (`calls_per_graph=1` counts it).
    `grid_context` sizes the grid as a captured graph does (the engine's max_model_len); `launch`
    goes to plan_decode (num_splits, min_split, block_n, num_warps, num_stages, tma; heads_first
    as the engine's KernelOptions unless given).
    `kv_dtype="fp8"`: the cache in float8_e4m3fn with its scales; `splits_factor` multiplies the
    planned splits (at least one). `contexts`: each sequence's own length (a batch of mixed
    lengths, `batch` and `context` then unused); `longest_first` in `launch` orders the programs
    as the engine does."""
    from flashstack.engine.config import KernelOptions
    from flashstack.engine.kernels.triton_attention import (
        decode_order,
        paged_decode_triton,
        plan_decode,
    )
    from flashstack.engine.quantization import FP8, quantize_fp8

    launch.setdefault("heads_first", KernelOptions().decode_heads_first)
    if contexts is None:
        contexts = [context] * batch
    batch, context = len(contexts), max(contexts)
    blocks_per_seq = math.ceil(context / block_size)
    num_blocks = batch * blocks_per_seq
    cache = torch.randn(
        num_blocks, 2, block_size, kv_heads, dim, dtype=torch.bfloat16, device="cuda"
    )
    kv_scale = None
    if kv_dtype == "fp8":
        kv_scale = torch.tensor([4.0 / 448, 4.0 / 448], device="cuda")
        cache = quantize_fp8(cache, kv_scale[0])
    # scattered blocks, as after churn
    perm = torch.randperm(num_blocks, device="cuda").to(torch.int32)
    tables = perm.view(batch, blocks_per_seq)
    lens = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, dim, dtype=torch.bfloat16, device="cuda")
    plan = plan_decode(batch, cache, grid_context or context, **launch)
    if splits_factor:
        splits = max(1, round(plan.num_splits * splits_factor))
        plan = plan_decode(batch, cache, grid_context or context, num_splits=splits, **launch)
    order = decode_order(lens) if plan.longest_first else None
    run = lambda: paged_decode_triton(  # noqa: E731
        q, cache, tables, lens, dim**-0.5, plan, kv_scale=kv_scale, order=order
    )
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_graph):
            run()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    sec = start.elapsed_time(end) / 1000 / iters / calls_per_graph
    kv_bytes = sum(contexts) * 2 * kv_heads * dim * (1 if cache.dtype == FP8 else 2)
    return {
        "us": round(sec * 1e6, 2),
        "kv_bytes": kv_bytes,
        "gb_s": round(kv_bytes / sec / 1e9, 1),
        "fraction_of_copy_bw": round(kv_bytes / sec / H200_COPY_BW, 3),
        "fraction_of_card_copy_bw": on_card(kv_bytes / sec / H200_COPY_BW, card_copy_bandwidth()),
        "plan": {
            "tma": plan.tma,
            "splits": plan.num_splits,
            "block_n": plan.block_n,
            "stages": plan.num_stages,
            "longest_first": plan.longest_first,
        },
    }


def launch_sweep(context: int) -> dict:
    """The decode kernel's launch parameters at 32K, batch 1 and 4: what the defaults leave."""
    import itertools

    out = {}
    for batch in (1, 4):
        rows = []
        for splits_per_sm, block_n, warps, stages in itertools.product(
            (2, 4, 8), (64, 128), (4, 8), (2, 3, 4)
        ):
            splits = max(1, math.ceil(splits_per_sm * 132 / (batch * 8)))
            try:
                r = decode_kernel_bandwidth(
                    batch,
                    context,
                    256,
                    iters=20,
                    num_splits=splits,
                    block_n=block_n,
                    num_warps=warps,
                    num_stages=stages,
                )
            except Exception as e:  # a launch the kernel cannot take (registers, shared memory)
                r = {"error": str(e)[-200:]}
            rows.append(
                {"splits": splits, "block_n": block_n, "warps": warps, "stages": stages, **r}
            )
        rows.sort(key=lambda r: r.get("us", 1e9))
        out[str(batch)] = rows[:8]
        print("sweep", batch, rows[:5], flush=True)
    return out


def prefill(path: Path, length: int) -> dict:
    from flashstack.engine import LLM, SamplingParams

    llm = LLM(
        str(path),
        block_size=256,
        max_num_seqs=1,
        dtype="bfloat16",
        max_model_len=length + 64,
        max_num_batched_tokens=8192,
        gpu_memory_utilization=0.85,
        show_progress=False,
        enforce_eager=True,
    )
    prompt = torch.randint(
        10, 100000, (length,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([prompt[:2048]], params)  # warm-up: kernels compiled
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate([prompt], params)
    torch.cuda.synchronize()
    sec = time.perf_counter() - t
    s = LLAMA3_8B
    params_nonemb = 15.01e9 / 2
    # causal QK^T + PV
    attn = 2 * s["num_hidden_layers"] * s["num_attention_heads"] * s["head_dim"] * length * length
    flops = 2 * params_nonemb * length + attn
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return {
        "tokens": length,
        "seconds": round(sec, 3),
        "tflops": round(flops / sec / 1e12, 1),
        "mfu": round(flops / sec / BF16_PEAK, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="also sweep the decode kernel's launch (splits, tile, warps, stages) at batch 1 and 4",
    )
    ap.add_argument(
        "--checkpoint", type=Path, help="an 8B-shape checkpoint dir (engine_decode.py --keep)"
    )
    args = ap.parse_args()
    result: dict = {
        "gpu": torch.cuda.get_device_name(),
        "card_copy_bw_tb_s": round(card_copy_bandwidth() / 1e12, 3),
        "context": args.context,
        "decode_kernel": {},
        "block_sweep": {},
    }

    def dump() -> None:
        text = json.dumps(result, indent=2)
        if args.json:
            args.json.write_text(text)
        print(text, flush=True)

    for batch in (1, 2, 4, 8, 16):
        try:
            result["decode_kernel"][str(batch)] = decode_kernel_bandwidth(batch, args.context, 256)
            # The same launches without Hopper's tensor-memory accelerator: plain loads, the
            # kernel every other GPU runs.
            result["decode_kernel"][f"{batch}_plain_loads"] = decode_kernel_bandwidth(
                batch, args.context, 256, tma=False
            )
            result["decode_kernel"][f"{batch}_one_call_per_graph"] = decode_kernel_bandwidth(
                batch, args.context, 256, calls_per_graph=1
            )
        except Exception:
            result["decode_kernel"][f"{batch}_error"] = traceback.format_exc()[-1500:]
    if args.sweep:
        result["launch_sweep"] = launch_sweep(args.context)
    for bs in (16, 64, 128, 256, 512):
        try:
            result["block_sweep"][str(bs)] = decode_kernel_bandwidth(8, args.context, bs)
        except Exception:
            result["block_sweep"][f"{bs}_error"] = traceback.format_exc()[-1500:]
    dump()
    if not args.skip_prefill:
        try:
            if args.checkpoint:
                path = args.checkpoint / "llama3-8b"
                cfg_file = path / "config.json"
                cfg = json.loads(cfg_file.read_text())
                # random weights: any length is as valid
                cfg["max_position_embeddings"] = args.context + 1024
                cfg_file.write_text(json.dumps(cfg))
            else:
                root = Path(tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
                hf = random_hf_model({**LLAMA3_8B, "max_position_embeddings": args.context + 1024})
                path = save_checkpoint(hf, root / "llama3-8b")
                del hf
                gc.collect()
                torch.cuda.empty_cache()
            result["prefill"] = prefill(path, args.context)
        except Exception:
            result["prefill_error"] = traceback.format_exc()[-3000:]
    dump()


if __name__ == "__main__":
    main()

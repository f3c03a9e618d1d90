"""Paged prefill attention, Triton vs torch SDPA: docs/benchmarks.md, "Prefill attention"."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BF16_PEAK = 790e12  # dense bf16 matmul measured on the H200 (shared/GPU.md)


def setup(
    context: int,
    chunk: int,
    block_size: int,
    heads: int,
    kv_heads: int,
    dim: int,
    device: str,
    dtype,
):
    """A paged cache holding `context` tokens of one sequence in scattered blocks, and the metadata
    of a step whose queries are its last `chunk` positions."""
    from flashstack.engine.kernels.attention import AttentionMetadata

    blocks = math.ceil(context / block_size)
    cache = torch.randn(blocks + 1, 2, block_size, kv_heads, dim, dtype=dtype, device=device)
    table = (torch.randperm(blocks, device=device) + 1).to(torch.int32)[None]  # block 0 unused
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64, device=device),
        block_tables=table,
        context_lens=torch.tensor([context], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, chunk], dtype=torch.int32, device=device),
        block_size=block_size,
        max_query_len=chunk,
        max_context_len=context,
        query_lens_host=[chunk],
        context_lens_host=[context],
    )
    q = torch.randn(chunk, heads, dim, dtype=dtype, device=device)
    return cache, table, meta, q


def prompts_step(
    lens: list[int], block_size: int, heads: int, kv_heads: int, dim: int, device: str, dtype
):
    """A step of fresh prompts of these lengths (nothing cached), each in its own scattered blocks:
    what the throughput workload's prompt steps run."""
    from flashstack.engine.kernels.attention import AttentionMetadata

    per_seq = [math.ceil(n / block_size) for n in lens]
    cache = torch.randn(sum(per_seq) + 1, 2, block_size, kv_heads, dim, dtype=dtype, device=device)
    order = (torch.randperm(sum(per_seq)) + 1).tolist()  # block 0 unused
    table = torch.zeros(len(lens), max(per_seq), dtype=torch.int32)
    at = 0
    for i, k in enumerate(per_seq):
        table[i, :k] = torch.tensor(order[at : at + k], dtype=torch.int32)
        at += k
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64, device=device),
        block_tables=table.to(device),
        context_lens=lens_t,
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        block_size=block_size,
        max_query_len=max(lens),
        max_context_len=max(lens),
        query_lens_host=list(lens),
        context_lens_host=list(lens),
    )
    q = torch.randn(starts[-1], heads, dim, dtype=dtype, device=device)
    return cache, meta, q


def workload_lens(tokens: int, seed: int = 0) -> list[int]:
    """Prompt lengths uniform in 100-1024 (the throughput workload's), as many as fit `tokens`."""
    import random

    rng = random.Random(seed)
    lens: list[int] = []
    while True:
        n = rng.randint(100, 1024)
        if sum(lens) + n > tokens:
            return lens
        lens.append(n)


def sweep_launches(args) -> dict:
    """Each PrefillLaunch on a step of the throughput workload's prompts (Qwen3-0.6B heads) and on
    one long chunk (the 8B's heads), checked against the reference first."""
    from itertools import product

    from flashstack.engine.kernels import triton_attention as ta
    from flashstack.engine.kernels.attention import paged_attention_reference

    cases = {
        "qwen3_prompts": (workload_lens(args.step_tokens), 16, 8),
        "llama8b_chunk2048": ([2048], 32, 8),
    }
    result: dict = {}
    for name, (lens, heads, kv_heads) in cases.items():
        if name not in args.cases.split(","):
            continue
        cache, meta, q = prompts_step(lens, 256, heads, kv_heads, 128, "cuda", torch.bfloat16)
        want = paged_attention_reference(q, cache, meta, 128**-0.5)
        pairs = sum(n * (n + 1) / 2 for n in lens)
        flops = 4 * heads * 128 * pairs
        rows = {}
        group = heads // kv_heads
        for per, bn, warps, stages, tma in product(
            (1, 2, 4), (64, 128), (4, 8), args.stages, (False, True)
        ):
            if group % per:
                continue
            launch = ta.PrefillLaunch(per, bn, warps, stages, tma)
            label = f"p{per}/n{bn}/w{warps}/s{stages}" + ("/tma" if tma else "")
            try:
                fn = lambda: ta.paged_prefill_triton(q, cache, meta, 128**-0.5, launch=launch)  # noqa: E731
                torch.testing.assert_close(fn(), want, atol=2e-2, rtol=2e-2)
                ms = timed_ms(fn, args.iters)
            except Exception as e:  # out of shared memory or registers: say so, go on
                rows[label] = {"error": str(e).splitlines()[0][:160]}
                continue
            rows[label] = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1)}
            print(name, label, rows[label], flush=True)
        best = min((r["ms"], k) for k, r in rows.items() if "ms" in r)
        result[name] = {
            "seqs": len(lens),
            "tokens": sum(lens),
            "default": ta.PrefillLaunch().__dict__,
            "best": best[1],
            "rows": rows,
        }
    return result


def gather_kv(
    cache: torch.Tensor, table: torch.Tensor, context: int, heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequence's K and V as contiguous [heads, context, dim] tensors, each KV head repeated for
    its query heads: what SDPA's fused kernels take."""
    blocks = cache[table[0].long()]  # [blocks, 2, block_size, kv_heads, dim]
    group = heads // cache.shape[3]
    k = blocks[:, 0].reshape(-1, *cache.shape[3:])[:context].transpose(0, 1)
    v = blocks[:, 1].reshape(-1, *cache.shape[3:])[:context].transpose(0, 1)
    return k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Chunk queries [chunk, heads, dim], the last positions of the context, over contiguous K/V
    [heads, context, dim]. The lower-right causal bias (query i sits at context - chunk + i) is one
    that torch's flash and memory-efficient kernels take; a dense boolean mask would not."""
    from torch.nn.attention.bias import causal_lower_right

    bias = causal_lower_right(q.shape[0], k.shape[1])
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k[None], v[None], attn_mask=bias
    )
    return out[0].transpose(0, 1)


def timed_ms(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--contexts", default="8192,16384,24576,32768")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test under Triton's interpreter")
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="time every PrefillLaunch on a step of the throughput workload's prompts and on one "
        "2,048-token chunk, instead of the contexts",
    )
    ap.add_argument("--step-tokens", type=int, default=8192, help="--sweep's prompt step")
    ap.add_argument("--cases", default="qwen3_prompts,llama8b_chunk2048", help="--sweep's cases")
    ap.add_argument(
        "--stages",
        type=lambda t: [int(x) for x in t.split(",")],
        default=[2, 3],
        help="--sweep's pipeline depths",
    )
    args = ap.parse_args()
    if args.sweep:
        result = sweep_launches(args)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
        print(json.dumps({k: (v["best"], v["rows"][v["best"]]) for k, v in result.items()}))
        return
    if args.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        from tests.engine.kernels.conftest import _fix_interpreter_scalars

        _fix_interpreter_scalars()
    from flashstack.engine.kernels.attention import paged_attention_reference, paged_prefill_sdpa
    from flashstack.engine.kernels.triton_attention import paged_prefill_triton

    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    heads, kv_heads, dim, block_size = (4, 2, 32, 16) if args.tiny else (32, 8, 128, 256)
    chunk = 24 if args.tiny else args.chunk
    contexts = [24, 40] if args.tiny else [int(c) for c in args.contexts.split(",")]
    result: dict = {
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": dim,
        "chunk": chunk,
        "rows": {},
    }
    for context in contexts:
        cache, table, meta, q = setup(
            context, chunk, block_size, heads, kv_heads, dim, device, dtype
        )
        scale = dim**-0.5
        ours = paged_prefill_triton(q, cache, meta, scale)
        k, v = gather_kv(cache, table, context, heads)
        theirs = sdpa(q, k, v)  # SDPA's default scale is 1/sqrt(dim), the same
        # what the engine runs for long chunks
        engine_sdpa = paged_prefill_sdpa(q, cache, meta, scale)
        want = paged_attention_reference(q, cache, meta, scale)
        tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ours, want, **tol)
        torch.testing.assert_close(theirs, want, **tol)
        torch.testing.assert_close(engine_sdpa, want, **tol)
        if args.tiny:
            print(context, "Triton paged prefill and SDPA agree with the reference", flush=True)
            continue
        # Causal within the chunk, full over the earlier context: QK^T and PV, 2 FLOPs a
        # multiply-add.
        pairs = chunk * (context - chunk) + chunk * (chunk + 1) / 2
        flops = 4 * heads * dim * pairs
        row = {}
        for name, fn in (
            ("triton_paged", lambda: paged_prefill_triton(q, cache, meta, scale)),
            ("sdpa_with_gather", lambda: sdpa(q, *gather_kv(cache, table, context, heads))),
            ("engine_sdpa", lambda: paged_prefill_sdpa(q, cache, meta, scale)),
            ("sdpa_contiguous", lambda: sdpa(q, k, v)),
        ):
            ms = timed_ms(fn, args.iters)
            row[name] = {
                "ms": round(ms, 3),
                "tflops": round(flops / ms / 1e9, 1),
                "fraction_of_bf16_peak": round(flops / ms / 1e9 / (BF16_PEAK / 1e12), 3),
            }
        result["rows"][str(context)] = row
        print(context, row, flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

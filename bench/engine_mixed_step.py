"""What a prompt arriving mid-decode costs the running streams: docs/benchmarks.md, "Mixed steps".

`decodes` sequences decode; then one new prompt of P tokens arrives and its prefill runs in the
same step as their decodes (chunked prefill). The streams' inter-token gap over that step, against
their plain decode gap, is what sets a server's ITL tail (issue 29). Each `--variants` entry is a
fresh engine in the same process; `graphs` (the default) replays the mixed step's CUDA graphs,
`eager` runs it layer by layer from Python, `uncapped` takes the whole prompt in one step however
long (no `decode_step_prefill_tokens`). The gap is the longest over the prompt's steps.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._shapes import LLAMA3_8B, QWEN3_0_6B, SMOLLM2_135M  # noqa: E402
from bench.engine_decode import prompts  # noqa: E402
from bench.engine_small import checkpoint  # noqa: E402

SHAPES = {"qwen3-0.6b": QWEN3_0_6B, "smollm2-135m": SMOLLM2_135M, "llama3-8b": LLAMA3_8B}
VARIANTS: dict[str, dict[str, Any]] = {
    "graphs": {},
    "eager": {"mixed_step_graph_tokens": 0},
    "uncapped": {"decode_step_prefill_tokens": 0},  # the whole prompt in one step beside decodes
}


def _step_times(engine, steps: int) -> list[float]:
    """Wall seconds between successive `step()` returns."""
    times, t = [], time.perf_counter()
    for _ in range(steps):
        engine.step()
        now = time.perf_counter()
        times.append(now - t)
        t = now
    return times


def _prefill_gap(engine, prompt: list[int], watched: str) -> tuple[float, int]:
    """(seconds between the watched stream's last token before the prompt's prefill and its first
    token after, steps in between): the prompt is added and the engine stepped until it has its
    first token."""
    from flashstack.engine import SamplingParams

    rid = engine.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    last, gap, steps, done = time.perf_counter(), 0.0, 0, False
    while not done:
        deltas = engine.step()
        now = time.perf_counter()
        steps += 1
        for d in deltas:
            if d.request_id == watched and d.token_ids:
                gap, last = max(gap, now - last), now
            if d.request_id == rid and d.token_ids:
                done = True
    engine.abort_request(rid)
    return gap, steps


def parts(engine, watched: str, length: int, repeats: int = 5) -> dict[str, float]:
    """µs per prefill of a `length`-token prompt spent in each host part (wall clocks around the
    engine's methods); `forward, synced` waits for the device before and after the forward pass,
    so against `forward` (its launches alone) it says whether the host or the device is slower."""
    from bench.engine_host import Clock
    from flashstack.engine import model_runner

    runner = engine.runner
    timed = [
        (engine.scheduler, "schedule"),
        (runner, "prepare"),
        (runner, "_forward"),
        (runner, "execute"),
        (model_runner, "sample"),
        (engine, "_apply"),
    ]
    with Clock().wrapping(timed) as clock:
        for r in range(repeats):
            _prefill_gap(engine, prompts(1, length, seed=5000 + r)[0], watched)
            _step_times(engine, 5)
        totals = dict(clock.total)
        synced = runner._forward

        def forward_synced(*a):
            torch.cuda.synchronize()
            t = time.perf_counter()
            try:
                return synced(*a)
            finally:
                torch.cuda.synchronize()
                totals["forward, synced"] = totals.get("forward, synced", 0.0) + (
                    time.perf_counter() - t
                )

        runner._forward = forward_synced  # put back with the rest on the way out
        for r in range(repeats):
            _prefill_gap(engine, prompts(1, length, seed=6000 + r)[0], watched)
            _step_times(engine, 5)
    # schedule and _apply run every step; the others only in steps that are not plain decodes
    return {k: round(v / repeats * 1e6, 1) for k, v in totals.items()}


def kernels(engine, watched: str, length: int) -> dict[str, float]:
    """Device µs per kernel name over one prefill of a `length`-token prompt and the decode steps
    around it (torch.profiler), the largest first."""
    from torch.profiler import ProfilerActivity, profile

    prompt = prompts(1, length, seed=7000)[0]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _prefill_gap(engine, prompt, watched)
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if us:
            totals[e.key[:80]] = totals.get(e.key[:80], 0.0) + us
    top = sorted(totals.items(), key=lambda kv: -kv[1])[:14]
    return {"all": round(sum(totals.values()), 1), **{k: round(v, 1) for k, v in top}}


def measure(path: Path, args, options: dict[str, Any]) -> dict[str, Any]:
    from flashstack.engine import LLM, SamplingParams

    llm = LLM(
        str(path),
        block_size=256,
        max_num_seqs=max(64, args.decodes + 1),
        max_num_batched_tokens=args.max_num_batched_tokens,
        dtype="bfloat16",
        gpu_memory_utilization=args.gpu_memory_utilization,
        show_progress=False,
        device="cuda",
        **options,
    )
    engine = llm.engine
    params = SamplingParams(temperature=0.6, max_tokens=3000, ignore_eos=True)
    ids = [
        engine.add_request(p, params) for p in prompts(args.decodes, args.decode_prompt_len, seed=3)
    ]
    while engine.scheduler.waiting or any(not s.output_token_ids for s in engine.scheduler.running):
        engine.step()
    _step_times(engine, 20)
    decode = _step_times(engine, 50)
    out: dict[str, Any] = {"decode_step_ms": round(statistics.median(decode) * 1e3, 3)}
    for n, length in enumerate(args.prompt_lens):
        gaps = []
        for r in range(args.repeats):
            fresh = prompts(1, length, seed=1000 + 100 * n + r)[0]  # never in the prefix cache
            gaps.append(_prefill_gap(engine, fresh, ids[0])[0])
            _step_times(engine, 5)
        out[f"gap_ms_prompt_{length}"] = round(statistics.median(gaps) * 1e3, 3)
    if args.parts:
        out["parts_us"] = parts(engine, ids[0], args.parts)
    if args.kernels:
        out["kernels_us"] = kernels(engine, ids[0], args.kernels)
    torch.cuda.synchronize()
    del llm, engine
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--decodes", type=int, default=31, help="streams decoding meanwhile")
    ap.add_argument("--decode-prompt-len", type=int, default=512)
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 512, 1024, 2048])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    ap.add_argument(
        "--parts", type=int, default=512, help="prompt length of the host-part timing; 0: none"
    )
    ap.add_argument(
        "--kernels", type=int, default=0, help="profile one prefill of this many tokens' kernels"
    )
    ap.add_argument("--variants", default="graphs,eager", help=f"of {sorted(VARIANTS)}")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    path, _ = checkpoint(args.shape, SHAPES[args.shape], root)
    result: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(),
        "shape": args.shape,
        "decodes": args.decodes,
        "decode_prompt_len": args.decode_prompt_len,
    }
    for variant in args.variants.split(","):
        result[variant] = measure(path, args, VARIANTS[variant])
        print(json.dumps({variant: result[variant]}), flush=True)
    text = json.dumps(result, indent=1)
    if args.json:
        args.json.write_text(text)
    print(text)


if __name__ == "__main__":
    main()

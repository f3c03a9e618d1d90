"""Small models' decode step by kernel (batch 1, or `--batch` sequences at once):
docs/benchmarks.md, "Engine small-model profile"."""

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

from bench._roofline import H200_COPY_BW, card_copy_bandwidth, on_card  # noqa: E402
from bench._shapes import (
    LLAMA3_2_1B,
    LLAMA3_8B,
    QWEN3_0_6B,
    SMOLLM2_135M,
    random_hf_model,
    save_checkpoint,
)  # noqa: E402
from bench.engine_decode import graph_replay_ms, prompts, stage_bucket  # noqa: E402
from bench.engine_host import Clock  # noqa: E402

# The 8B shape is there to check that what helps the small models costs the big one nothing.
SHAPES = {
    "qwen3-0.6b": QWEN3_0_6B,
    "llama3.2-1b": LLAMA3_2_1B,
    "smollm2-135m": SMOLLM2_135M,
    "llama3-8b": LLAMA3_8B,
}
DEFAULT_MODELS = "qwen3-0.6b,llama3.2-1b,smollm2-135m"
KINDS = (
    ("gemv", "_gemv_kernel"),
    ("attention", "_decode_kernel"),
    ("merge", "_merge_splits"),
    ("argmax", "argmax"),
    ("embedding", "embed"),
    ("norm", "rmsnorm"),
)


def kind_of(kernel: str) -> str:
    return next((kind for kind, part in KINDS if part in kernel), "other")


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads of the weights: each parameter once (a tied head reads the
    embedding table), an untied embedding table not at all (it is only indexed)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.config.tie_word_embeddings:
        emb = model.get_input_embeddings().weight
        total -= emb.numel() * emb.element_size()
    return total


def kv_bytes(shape: dict[str, Any], context: int) -> int:
    return (
        context
        * shape["num_hidden_layers"]
        * 2
        * shape["num_key_value_heads"]
        * shape["head_dim"]
        * 2
    )


def traced_kernels(run, iters: int) -> list[dict[str, Any]]:
    """The device kernels `run` launches over `iters` calls, in time order: name, start, duration
    (µs)."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            run()
        torch.cuda.synchronize()
    path = Path(tempfile.mkdtemp()) / "trace.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    kernels.sort(key=lambda e: e["ts"])
    return [
        {"name": e["name"], "ts": float(e["ts"]), "dur": float(e.get("dur", 0.0))} for e in kernels
    ]


def busy_us(kernels: list[dict[str, Any]]) -> float:
    """Time some kernel runs (the union of their intervals: PDL overlaps neighbours)."""
    busy, end = 0.0, float("-inf")
    for k in kernels:
        start, stop = k["ts"], k["ts"] + k["dur"]
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy


def graph_profile(graphs, context: int, layers: int, iters: int = 20) -> dict[str, Any]:
    """One batch-1 replay's kernels: by kind, the gaps between them, one layer in order."""
    stage_bucket(graphs, 1, context)
    graph = graphs.graphs[graphs.key_for(1, context)]
    kernels = traced_kernels(graph.replay, iters)
    per = len(kernels) // iters
    replays = [kernels[i * per : (i + 1) * per] for i in range(iters)]
    spans = [r[-1]["ts"] + r[-1]["dur"] - r[0]["ts"] for r in replays]
    busy = [busy_us(r) for r in replays]
    summed = [sum(k["dur"] for k in r) for r in replays]
    kinds: dict[str, dict[str, float]] = {}
    for r in replays:
        for k in r:
            entry = kinds.setdefault(kind_of(k["name"]), {"count": 0.0, "us": 0.0})
            entry["count"] += 1 / iters
            entry["us"] += k["dur"] / iters
    mid = replays[iters // 2]
    gemvs = [i for i, k in enumerate(mid) if kind_of(k["name"]) == "gemv"]
    # Layer 1 (the second): from its first GEMV (q/k/v) to the next layer's first.
    start, stop = gemvs[4], gemvs[8] if len(gemvs) > 8 else len(mid)
    layer = [
        {
            "kind": kind_of(k["name"]),
            "us": round(k["dur"], 2),
            "gap_before_us": round(k["ts"] - (mid[i - 1]["ts"] + mid[i - 1]["dur"]), 2),
        }
        for i, k in ((i, mid[i]) for i in range(start, stop))
    ]
    return {
        "kernels_per_replay": per,
        "kernels_per_layer": round(per / layers, 2),
        "span_us": round(statistics.median(spans), 1),
        "busy_us": round(statistics.median(busy), 1),
        "kernel_sum_us": round(statistics.median(summed), 1),
        "idle_between_kernels_us": round(statistics.median(s - b for s, b in zip(spans, busy)), 1),
        "by_kind": {
            k: {"count": round(v["count"], 1), "us": round(v["us"], 1)} for k, v in kinds.items()
        },
        "layer_1": layer,
    }


def replay_us(graphs, context: int, iters: int = 200, batch: int = 1) -> float:
    """One replay of the graph a `context`-token step of `batch` sequences takes (the
    short-context one at batch 1)."""
    bucket = graphs.bucket_for(batch)
    key = graphs.key_for(bucket, context)
    return graph_replay_ms(graphs, bucket, context, iters, key=key) * 1000


def decode_steps(llm, prompts: list[list[int]], new_tokens: int, between=None) -> tuple[float, int]:
    """(µs per decode step, steps) through the engine's step loop, prefill excluded, the prompts
    decoding together. `between` (a context manager factory) wraps the decode steps."""
    import contextlib

    from flashstack.engine import SamplingParams

    engine = llm.engine
    for p in prompts:
        engine.add_request(
            p, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        )
    while engine.scheduler.waiting or any(not s.output_token_ids for s in engine.scheduler.running):
        engine.step()
    torch.cuda.synchronize()
    with (between or contextlib.nullcontext)():
        t, steps = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t
    return elapsed / steps * 1e6, steps


def host_parts(llm, prompt: list[int], new_tokens: int) -> dict[str, float]:
    """µs per decode step of each host part (wall clocks around the engine's methods)."""
    from flashstack.engine import model_runner, outputs

    engine = llm.engine
    parts = [
        (engine.scheduler, "schedule"),
        (engine.scheduler, "lookahead"),
        (engine.runner, "launch"),
        (engine, "_apply"),
        (engine.runner.graphs, "run"),
        (engine.runner.graphs, "stage"),
        (model_runner, "sample_on_device"),
        (model_runner.PendingStep, "wait"),
        (outputs.RequestState, "update_text"),
    ]
    with Clock().wrapping(parts) as clock:
        step, steps = decode_steps(llm, [prompt], new_tokens)
        clock.total.clear()
        step, steps = decode_steps(llm, [prompt], new_tokens)
    us = {k: round(v / steps * 1e6, 1) for k, v in clock.total.items()}
    us["step (instrumented)"] = round(step, 1)
    us["host, not waiting"] = round(step - us.get("wait", 0.0), 1)
    return us


def step_gpu(llm, prompt: list[int], new_tokens: int, graph_kernels: int) -> dict[str, Any]:
    """Kernels of 20 engine steps: those outside the graph, and the device's idle time per step."""
    from flashstack.engine import SamplingParams

    engine = llm.engine
    engine.add_request(
        prompt, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    )
    while engine.scheduler.waiting or any(not s.output_token_ids for s in engine.scheduler.running):
        engine.step()
    steps = 20
    t = time.perf_counter()
    kernels = traced_kernels(engine.step, steps)
    wall = (time.perf_counter() - t) / (steps + 1) * 1e6
    engine.abort_all()
    while engine.has_unfinished_requests():
        engine.step()
    outside: dict[str, float] = {}
    names = [k["name"] for k in kernels]
    for name in names:
        outside[name[:60]] = outside.get(name[:60], 0) + 1 / steps
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    return {
        "kernels_per_step": round(len(kernels) / steps, 1),
        "outside_graph_per_step": round(len(kernels) / steps - graph_kernels, 1),
        "most_frequent": dict(sorted(outside.items(), key=lambda kv: -kv[1])[:12]),
        "device_idle_per_step_us": round((span - busy_us(kernels)) / steps, 1),
        "wall_per_step_us (profiled)": round(wall, 1),
    }


def checkpoint(name: str, shape: dict[str, Any], root: Path) -> tuple[Path, int]:
    """The model written as a random bf16 checkpoint, and the bytes a decode step reads of it."""
    hf = random_hf_model(shape, "cuda")
    wbytes = weight_bytes(hf)
    path = save_checkpoint(hf, root / name)
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    return path, wbytes


def measure(
    path: Path, wbytes: int, shape: dict[str, Any], args, kernels: dict[str, Any]
) -> dict[str, Any]:
    from flashstack.engine import LLM

    context = args.prompt_len + args.new_tokens // 2
    batch = args.batch
    floor = (wbytes + batch * kv_bytes(shape, context)) / H200_COPY_BW * 1e6
    out: dict[str, Any] = {"weight_bytes": wbytes, "floor_us": round(floor, 1), "kernels": kernels}
    llm = LLM(
        str(path),
        block_size=256,
        max_num_seqs=batch,
        dtype="bfloat16",
        gpu_memory_utilization=0.5,
        max_model_len=4096,
        show_progress=False,
        device="cuda",
        kernels=kernels,
    )
    batch_prompts = prompts(batch, args.prompt_len, seed=1)
    prompt = batch_prompts[0]
    steps = [decode_steps(llm, batch_prompts, args.new_tokens)[0] for _ in range(3)]
    out["step_us"] = round(min(steps), 1)
    out["fraction_of_floor"] = round(floor / min(steps), 3)
    out["fraction_of_card_floor"] = on_card(floor / min(steps), card_copy_bandwidth())
    graphs = llm.engine.runner.graphs
    out["replay_us"] = round(min(replay_us(graphs, context, batch=batch) for _ in range(3)), 1)
    decoders = getattr(llm.engine.runner.ops.for_tokens(1), "_decoders", {})
    if kernels.get("persistent_decoder"):  # dropped after a failed first-run check: say so
        kept = [d for d in decoders.values() if d is not None]
        out["persistent_decoder_ran"] = bool(kept)
        out["persistent_decoder_stalls"] = sum(d.stalls() for d in kept)  # 0 unless a bug
    if args.profile:
        out["graph"] = graph_profile(graphs, context, shape["num_hidden_layers"])
        out["step_gpu"] = step_gpu(llm, prompt, args.new_tokens, out["graph"]["kernels_per_replay"])
    if args.profile or args.host:
        out["host_us"] = host_parts(llm, prompt, args.new_tokens)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--models", default=DEFAULT_MODELS, help=f"comma-separated, of {sorted(SHAPES)}"
    )
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument(
        "--variants",
        default="default",
        help="comma-separated kernel options to run (a name again: another load, interleaved): "
        "default, nopdl (kernels.pdl=False), "
        "sepqkv (kernels.decode_qkv=False), attnpdl / noattnpdl "
        "(kernels.attention_pdl), noargmax (kernels.argmax_in_graph=False), persistent "
        "(kernels.persistent_decoder: one program an SM, 4 warps), persistent8w (8 warps), "
        "persistent2 / persistent3 (two / three programs an SM, registers capped to fit), "
        "persistenttagged (its residual stream in tagged words, not after counts), splits1 / "
        "splits2 / splits4 (decode attention in that many splits a sequence: kernels."
        "decode_splits; one needs no merge kernel), "
        "maskedv (V's tiles zeroed past the context: kernels.decode_unmasked_v=False), "
        "noidleexit (decode splits past the context wait and run an empty loop: "
        "kernels.decode_idle_exit=False), nol2pf (no GEMV asks the L2 for its weight "
        "before the wait: kernels.gemv_l2_prefetch_bytes=0), l2pf2 / l2pf4 / l2pf16 / l2pf64 "
        "(batch-1 GEMVs of weights up to 2 / 4 / 16 / 64 MiB ask the L2 for them before the "
        "wait: kernels.gemv_l2_prefetch_bytes), nopreload (decode attention's splits fetch their "
        "first K and V tiles after the wait, in the loop: kernels.decode_preload_rows=0), "
        "noskinnysmall (products of 2-32 rows on cuBLAS, not the skinny GEMM: "
        "kernels.skinny_small_weights=False), fetch / nofetch (each graph fetches its inputs "
        "from pinned host slots, or they are copied on the stream: kernels.graph_fetches_inputs), "
        "fusedmlp (each layer's MLP one kernel, down's sums by atomics: kernels.fused_mlp)",
    )
    ap.add_argument(
        "--no-profile", dest="profile", action="store_false", help="step and replay times only"
    )
    ap.add_argument(
        "--host",
        action="store_true",
        help="with --no-profile: still the host's time per step by part (once the GPU's step "
        "is short, whether the host keeps up)",
    )
    ap.add_argument(
        "--batch",
        type=int,
        default=1,
        help="sequences decoding together (past 1: step and replay only, with --no-profile)",
    )
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.batch > 1 and (args.profile or args.host):
        ap.error("--batch past 1 measures step and replay only: add --no-profile, drop --host")
    variants = {
        "default": {},
        "nopdl": {"pdl": False},
        "sepqkv": {"decode_qkv": False},
        "attnpdl": {"attention_pdl": True},
        "noattnpdl": {"attention_pdl": False},
        "noargmax": {"argmax_in_graph": False},
        "persistent": {"persistent_decoder": True},
        "persistent8w": {"persistent_decoder": True, "persistent_decoder_warps": 8},
        "persistent2": {"persistent_decoder": True, "persistent_decoder_programs_per_sm": 2},
        "persistent3": {"persistent_decoder": True, "persistent_decoder_programs_per_sm": 3},
        "persistenttagged": {"persistent_decoder": True, "persistent_decoder_tagged": True},
        **{f"splits{n}": {"decode_splits": n} for n in (1, 2, 4)},
        "maskedv": {"decode_unmasked_v": False},
        "noidleexit": {"decode_idle_exit": False},
        "nol2pf": {"gemv_l2_prefetch_bytes": 0},
        "l2pf2": {"gemv_l2_prefetch_bytes": 2 << 20},
        "l2pf4": {"gemv_l2_prefetch_bytes": 4 << 20},
        "l2pf16": {"gemv_l2_prefetch_bytes": 16 << 20},
        "l2pf64": {"gemv_l2_prefetch_bytes": 64 << 20},
        "nopreload": {"decode_preload_rows": 0},
        "noskinnysmall": {"skinny_small_weights": False},
        "fetch": {"graph_fetches_inputs": True},
        "nofetch": {"graph_fetches_inputs": False},
        "fusedmlp": {"fused_mlp": True},
    }
    root = Path(tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    result: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(),
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "copy_bw_tb_s": H200_COPY_BW / 1e12,
        "card_copy_bw_tb_s": round(card_copy_bandwidth() / 1e12, 3),
    }
    for name in args.models.split(","):
        path, wbytes = checkpoint(name, SHAPES[name], root)
        for variant in args.variants.split(","):
            key = name if variant == "default" else f"{name}_{variant}"
            # a variant named again is another load, interleaved: its own entry
            loads = 1 + sum(k == key or k.startswith(f"{key}_load") for k in result)
            if loads > 1:
                key += f"_load{loads}"
            result[key] = measure(path, wbytes, SHAPES[name], args, variants[variant])
            text = json.dumps(result, indent=1)
            if args.json:
                args.json.write_text(text)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

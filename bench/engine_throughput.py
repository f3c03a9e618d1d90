"""nano-vllm's throughput workload vs its roofline: docs/benchmarks.md, "Throughput"."""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._roofline import H200_COPY_BW, card_copy_bandwidth  # noqa: E402
from bench._shapes import QWEN3_0_6B, random_hf_model, save_checkpoint  # noqa: E402

BF16_PEAK = 790e12


def workload(n: int, lo: int, hi: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randint(10, 100000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    outputs = [rng.randint(lo, hi) for _ in range(n)]
    return prompts, outputs


def floor_seconds(
    weight_bytes: int,
    params: int,
    prompts: list[list[int]],
    outputs: list[int],
    copy_bw: float = H200_COPY_BW,
) -> float:
    """Bandwidth floor of the decode steps (all sequences live at once) plus the prefill compute
    floor."""
    s = QWEN3_0_6B
    kv_per_token = s["num_hidden_layers"] * 2 * s["num_key_value_heads"] * s["head_dim"] * 2
    seconds = 0.0
    for t in range(1, max(outputs) + 1):
        live_kv = sum((len(p) + t) for p, o in zip(prompts, outputs) if o >= t) * kv_per_token
        seconds += (weight_bytes + live_kv) / copy_bw
    seconds += 2 * params * sum(len(p) for p in prompts) / BF16_PEAK
    return seconds


def phases(t0: float, ends: list[float], prompted: list[bool]) -> dict:
    """Wall time until the step after the last one that scheduled prompt tokens (steps queue one
    ahead, so a step's end marks the one before it finishing on the device), the decode-only
    rest, and the run in tenths of its steps. (Graph replays are not the test: the last few
    steps of a shrinking batch run eagerly too.)"""
    with_prompt = [i for i, p in enumerate(prompted) if p]
    cut = min(len(ends) - 1, with_prompt[-1] + 1) if with_prompt else -1
    prompt = ends[cut] - t0 if cut >= 0 else 0.0
    n = len(ends)
    marks = [t0] + [ends[max(0, (i + 1) * n // 10 - 1)] for i in range(10)]
    return {
        "prompt_steps": len(with_prompt),
        "until_last_prompt_step": round(prompt, 3),
        "decode_rest": round(ends[-1] - t0 - prompt, 3) if ends else 0.0,
        "tenths_of_the_steps": [round(b - a, 3) for a, b in zip(marks, marks[1:])],
    }


def profile_run(
    llm, prompts: list[list[int]], sampling: list, window: tuple[int, int] = (300, 310)
) -> dict:
    """The workload again, with each host part timed and the kernels of a window of decode steps
    profiled: where a step's time goes (the timed run above stays uninstrumented)."""
    from torch.profiler import ProfilerActivity, profile

    from bench.engine_host import Clock
    from flashstack.engine import model_runner

    engine = llm.engine
    engine.block_manager.reset_prefix_cache()  # the timed run left every prompt cached
    on_gpu = torch.cuda.is_available()
    clock = Clock()
    calls = {"graph steps": 0}
    clock.wrap(engine.scheduler, "schedule", "schedule")
    clock.wrap(engine.scheduler, "postprocess", "postprocess")
    clock.wrap(engine.runner, "execute", "execute (steps run one at a time)")
    clock.wrap(engine.runner, "prepare", "prepare inputs (eager steps)")
    clock.wrap(model_runner, "sample", "sample + read back (steps run one at a time)")
    clock.wrap(engine.runner, "launch", "launch: stage, replay, sample (queued)")
    clock.wrap(model_runner.PendingStep, "wait", "wait for a queued step's tokens")
    # whether the current step scheduled prompt tokens: its own schedule or the lookahead that
    # queues the step behind it (a burst's next prompt step, a chunk tail)
    scheduled_prompt = [False]

    def noting_prompts(method):
        def scheduled(*a, **kw):
            batch = method(*a, **kw)
            if batch is not None:
                scheduled_prompt[0] |= any(n > 1 for n in batch.num_new_tokens)
            return batch

        return scheduled

    engine.scheduler.schedule = noting_prompts(engine.scheduler.schedule)
    engine.scheduler.lookahead = noting_prompts(engine.scheduler.lookahead)
    graphs = engine.runner.graphs
    if graphs is not None:
        inner = graphs.run

        def counted(*a, **kw):
            calls["graph steps"] += 1
            return inner(*a, **kw)

        graphs.run = counted
        clock.wrap(graphs, "run", "stage + replay launch (graph steps)")
    for p, sp in zip(prompts, sampling):
        engine.add_request(p, sp)
    steps, kernels, window_s = 0, [], 0.0
    ends, prompted = [], []  # each step's end, and whether it scheduled prompt tokens
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        scheduled_prompt[0] = False
        if steps == window[0]:
            if on_gpu:
                torch.cuda.synchronize()
            prof = profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU])
            prof.__enter__()
            tw = time.perf_counter()
        engine.step()
        steps += 1
        ends.append(time.perf_counter())
        prompted.append(scheduled_prompt[0])
        if steps == window[1]:
            if on_gpu:
                torch.cuda.synchronize()
            window_s = time.perf_counter() - tw
            prof.__exit__(None, None, None)
            n = window[1] - window[0]

            def us(e) -> float:
                return e.device_time_total if on_gpu else e.self_cpu_time_total

            rows = sorted((e for e in prof.key_averages() if us(e) > 0), key=lambda e: -us(e))
            kernels = [{"kernel": "ALL", "us_per_step": round(sum(us(e) for e in rows) / n, 1)}]
            kernels += [
                {
                    "kernel": e.key[:80],
                    "us_per_step": round(us(e) / n, 1),
                    "count_per_step": e.count / n,
                }
                for e in rows[:25]
            ]
    total = time.perf_counter() - t0
    parts = {k: round(v, 3) for k, v in clock.total.items()}
    outer = (
        "schedule",
        "postprocess",
        "execute (steps run one at a time)",
        "launch: stage, replay, sample (queued)",
        "wait for a queued step's tokens",
    )
    parts["step loop rest (lookahead, stop strings, deltas)"] = round(
        total - sum(clock.total[k] for k in outer), 3
    )
    return {
        "seconds": round(total, 2),
        "steps": steps,
        "graph_steps": calls["graph steps"],
        "phases_s": phases(t0, ends, prompted),
        "host_parts_s": parts,
        "window_steps": list(window),
        "window_wall_ms_per_step": round(window_s / (window[1] - window[0]) * 1e3, 3),
        "window_kernels": kernels,
    }


@torch.inference_mode()
def hf_tokens_per_s(model, batch: int, prompt_len: int, new_tokens: int) -> float:
    ids = torch.randint(10, 100000, (batch, prompt_len), device="cuda")
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)
    torch.cuda.synchronize()
    t = time.perf_counter()
    model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
    torch.cuda.synchronize()
    return batch * new_tokens / (time.perf_counter() - t)


def run_workload(llm, prompts, outputs, weight_bytes: int, params: int) -> dict:
    """The timed workload on `llm`, after a warm-up on other prompts of the same kind (prefill
    chunks and decode batches of every size compile their kernels there), from an empty prefix
    cache."""
    from flashstack.engine import SamplingParams

    warm, _ = workload(32, 100, 1024, seed=1)
    llm.generate(warm, SamplingParams(max_tokens=16, ignore_eos=True))
    llm.engine.block_manager.reset_prefix_cache()
    sampling = [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True) for o in outputs]
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, sampling)
    torch.cuda.synchronize()
    sec = time.perf_counter() - t
    produced = sum(len(o.token_ids) for o in outs)
    floor = floor_seconds(weight_bytes, params, prompts, outputs)
    card_floor = floor_seconds(weight_bytes, params, prompts, outputs, card_copy_bandwidth())
    return {
        "seconds": round(sec, 2),
        "output_tokens": produced,
        "tokens_per_s": round(produced / sec, 1),
        "floor_seconds": round(floor, 2),
        "fraction_of_roofline": round(floor / sec, 3),
        "card_floor_seconds": round(card_floor, 2),
        "fraction_of_card_roofline": round(card_floor / sec, 3),
    }


def _variant(text: str) -> tuple[str, dict[str, Any]]:
    # LABEL=OPTION=VALUE,...: EngineConfig options, `kernels.NAME` for KernelOptions (integers).
    label, _, rest = text.partition("=")
    pairs = [item.split("=", 1) for item in rest.split(",") if item]
    if not label or any(len(p) != 2 for p in pairs):
        raise argparse.ArgumentTypeError(f"expected LABEL=OPTION=VALUE,..., got {text!r}")
    options: dict[str, Any] = {}
    for key, value in pairs:
        if key.startswith("kernels."):
            options.setdefault("kernels", {})[key.removeprefix("kernels.")] = int(value)
        else:
            options[key] = int(value)
    return label, options


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument(
        "--profile",
        action="store_true",
        help="then run the workload again with host parts timed and a window of steps profiled",
    )
    ap.add_argument(
        "--profile-window",
        type=lambda t: tuple(int(x) for x in t.split(",")),
        default=(300, 310),
        metavar="FIRST,END",
        help="the steps --profile profiles (0,22: the prompt phase; default 300,310: decode only)",
    )
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument(
        "--variants",
        type=_variant,
        nargs="+",
        default=[("flashstack", {})],
        metavar="LABEL=OPTION=VALUE,...",
        help="run the workload once per variant, each on a fresh engine with these EngineConfig "
        "options (integers; kernels.NAME for a kernel option), e.g. `default= "
        "burst0=burst_prefill_steps=0 nolpt=kernels.decode_longest_first=0`; the first is profiled",
    )
    args = ap.parse_args()
    result: dict = {
        "gpu": torch.cuda.get_device_name(),
        "shape": "qwen3-0.6b",
        "num_seqs": args.num_seqs,
        "variants": {label: options for label, options in args.variants},
        "card_copy_bw_tb_s": round(card_copy_bandwidth() / 1e12, 3),
    }

    def dump() -> None:
        text = json.dumps(result, indent=2)
        if args.json:
            args.json.write_text(text)
        print(text, flush=True)

    root = Path(tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    hf = random_hf_model(QWEN3_0_6B)
    params = sum(p.numel() for p in hf.parameters())
    weight_bytes = params * 2
    save_checkpoint(hf, root / "qwen3")
    try:
        if args.skip_transformers:
            raise RuntimeError("skipped (--skip-transformers)")
        result["transformers_tokens_per_s_batch64"] = round(hf_tokens_per_s(hf, 64, 512, 128), 1)
    except Exception:
        result["transformers_error"] = traceback.format_exc()[-2000:]
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    dump()

    from flashstack.engine import LLM, SamplingParams

    prompts, outputs = workload(args.num_seqs, 100, 1024)
    for n, (key, options) in enumerate(args.variants):
        try:
            llm = LLM(
                str(root / "qwen3"),
                block_size=256,
                max_num_seqs=args.max_num_seqs,
                dtype="bfloat16",
                max_model_len=4096,
                gpu_memory_utilization=0.85,
                show_progress=False,
                **options,
            )
            result[key] = run_workload(llm, prompts, outputs, weight_bytes, params)
            if "transformers_tokens_per_s_batch64" in result:
                result[key]["speedup_vs_transformers"] = round(
                    result[key]["tokens_per_s"] / result["transformers_tokens_per_s_batch64"], 1
                )
            if args.profile and n == 0:
                dump()
                sampling = [
                    SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True) for o in outputs
                ]
                result["profile"] = profile_run(llm, prompts, sampling, args.profile_window)
            del llm
            gc.collect()
            torch.cuda.empty_cache()
        except Exception:
            result[f"{key}_error"] = traceback.format_exc()[-3000:]
        dump()
    dump()


if __name__ == "__main__":
    main()

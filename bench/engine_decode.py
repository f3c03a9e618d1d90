"""Llama-3-8B decode step vs its floor and transformers: docs/benchmarks.md, "Decode step"."""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._roofline import H200_COPY_BW, card_copy_bandwidth, on_card  # noqa: E402
from bench._shapes import LLAMA3_8B, plant_head, random_hf_model, save_checkpoint  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# A CPU smoke-test shape: same code path, seconds instead of minutes.
TINY = {
    **LLAMA3_8B,
    "vocab_size": 1000,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
}


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def weight_bytes_read(model: torch.nn.Module) -> int:
    emb = model.get_input_embeddings().weight
    return (
        sum(p.numel() * p.element_size() for p in model.parameters())
        - emb.numel() * emb.element_size()
    )


def kv_bytes_read(shape: dict, batch: int, context: int) -> int:
    return (
        batch
        * context
        * shape["num_hidden_layers"]
        * 2
        * shape["num_key_value_heads"]
        * shape["head_dim"]
        * 2
    )


def prompts(batch: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 900, (batch, length), generator=g).tolist()


@torch.inference_mode()
def hf_step_ms(model, batch: int, prompt_len: int, new_tokens: int) -> float:
    ids = torch.tensor(prompts(batch, prompt_len), device=DEVICE)
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kw)  # warm-up
    _sync()
    t = time.perf_counter()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
    _sync()
    prefill = time.perf_counter() - t
    t = time.perf_counter()
    model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
    _sync()
    return (time.perf_counter() - t - prefill) / (new_tokens - 1) * 1000


@torch.inference_mode()
def hf_greedy(model, batch_prompts: list[list[int]], n: int) -> list[list[int]]:
    ids = torch.tensor(batch_prompts, device=DEVICE)
    out = model.generate(
        ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None
    )
    return out[:, ids.shape[1] :].tolist()


def our_step_ms(llm, batch: int, prompt_len: int, new_tokens: int) -> float:
    from flashstack.engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for p in prompts(batch, prompt_len, seed=1):
        engine.add_request(p, params)
    while engine.scheduler.waiting or any(not s.output_token_ids for s in engine.scheduler.running):
        engine.step()  # prefill (chunked) until every sequence has its first token
    _sync()
    t = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    _sync()
    return (time.perf_counter() - t) / steps * 1000


def step_gaps(llm, batch: int, prompt_len: int, steps: int = 20) -> dict:
    """What the device does between two decode graphs: `steps` engine steps of `batch` sequences
    traced (torch.profiler, CUDA activity): the copies per step, the device's idle time per step
    and the gaps (≥ 1 µs) before the ops that follow one."""
    import statistics

    from bench.engine_small import busy_us, traced_kernels
    from flashstack.engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 16, ignore_eos=True)
    for p in prompts(batch, prompt_len, seed=2):
        engine.add_request(p, params)
    while engine.scheduler.waiting or any(not s.output_token_ids for s in engine.scheduler.running):
        engine.step()
    for _ in range(4):  # the lookahead pipeline in its steady state
        engine.step()
    ops = traced_kernels(engine.step, steps)
    engine.abort_all()
    while engine.has_unfinished_requests():
        engine.step()
    span = ops[-1]["ts"] + ops[-1]["dur"] - ops[0]["ts"]
    copies: dict[str, list[float]] = {}
    gaps: dict[str, list[float]] = {}
    end = ops[0]["ts"]
    for op in ops:
        gap = op["ts"] - end
        if gap >= 1.0:
            gaps.setdefault(op["name"][:60], []).append(gap)
        if op["name"].startswith("Memcpy") or op["name"].startswith("Memset"):
            copies.setdefault(op["name"][:60], []).append(op["dur"])
        end = max(end, op["ts"] + op["dur"])
    return {
        "ops_per_step": round(len(ops) / steps, 1),
        "device_idle_per_step_us": round((span - busy_us(ops)) / steps, 1),
        "copies_per_step": {
            k: {"count": round(len(v) / steps, 1), "us": round(statistics.median(v), 2)}
            for k, v in copies.items()
        },
        "gaps_before": {
            k: {"per_step": round(len(v) / steps, 1), "median_us": round(statistics.median(v), 1)}
            for k, v in sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[:8]
        },
    }


def teacher_forced(llm, base: list[list[int]], hf_tokens: list[list[int]]) -> list[int]:
    """Our greedy next token at every position of transformers' continuation, given its prefix.
    Compared per position, one near-tie does not turn every later position into a miss."""
    from flashstack.engine import SamplingParams

    prompts = [p + t[:k] for p, t in zip(base, hf_tokens) for k in range(len(t))]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    return [o.token_ids[0] for o in outs]


@torch.inference_mode()
def hf_teacher_forced(
    model, base: list[list[int]], hf_tokens: list[list[int]], margins: list[float] | None = None
) -> list[int]:
    """transformers' greedy next token at every position of its continuation, in one forward pass
    over prompt + continuation (no KV cache). With `margins`, also appends each position's gap
    between its top two logits."""
    ids = torch.tensor([p + t for p, t in zip(base, hf_tokens)], device=DEVICE)
    start, n = len(base[0]) - 1, len(hf_tokens[0])
    logits = model(ids).logits[:, start : start + n]
    if margins is not None:
        top2 = logits.float().topk(2, dim=-1).values
        margins.extend((top2[..., 0] - top2[..., 1]).flatten().tolist())
    return logits.argmax(-1).flatten().tolist()


def fraction_equal(a: list[int], b: list[int]) -> float:
    return round(sum(x == y for x, y in zip(a, b)) / len(a), 4)


def noise_floor(
    model,
    base: list[list[int]],
    hf_tokens: list[list[int]],
    fp32_margins: list[float] | None = None,
) -> dict[str, list[int]]:
    """Teacher-forced next tokens of transformers itself, computed three other ways: bf16 in one
    forward pass, bf16 with eager attention, fp32 (its top-two logit gaps appended to
    `fp32_margins`). How often these agree with transformers' bf16 `generate` is how far bf16
    rounding alone moves the argmax on these weights. Leaves `model` in fp32."""
    out = {"hf_bf16_forward": hf_teacher_forced(model, base, hf_tokens)}
    try:
        model.set_attn_implementation("eager")
        out["hf_bf16_eager_attention"] = hf_teacher_forced(model, base, hf_tokens)
        model.set_attn_implementation("sdpa")
    except Exception:  # an older transformers: skip this one
        pass
    model.float()
    out["hf_fp32"] = hf_teacher_forced(model, base, hf_tokens, fp32_margins)
    return out


def decisive_positions(hf_generate: list[int], references: dict[str, list[int]]) -> list[int]:
    """Positions where transformers' bf16 `generate` and every noise-floor variant (bf16 one pass,
    bf16 eager attention, fp32) pick the same token: those bf16 rounding demonstrably does not
    decide. Agreement there measures the engine; elsewhere it measures near-ties."""
    return [
        i for i, tok in enumerate(hf_generate) if all(ref[i] == tok for ref in references.values())
    ]


def agreement_by_margin(
    tokens: list[int], fp32: list[int], margins: list[float]
) -> dict[str, float]:
    """Agreement with transformers' fp32 argmax on the positions fp32 decides most clearly: the
    top 75 / 50 / 25 % of positions by the gap between fp32's two best logits."""
    order = sorted(range(len(margins)), key=lambda i: -margins[i])
    out = {}
    for share in (75, 50, 25):
        top = order[: max(1, len(order) * share // 100)]
        out[f"top_{share}pct"] = fraction_equal([tokens[i] for i in top], [fp32[i] for i in top])
    return out


def stage_bucket(graphs, bucket: int, context: int) -> None:
    """Stage `bucket` sequences of `context` tokens in that bucket's own packed layout.

    Each bucket's graph reads the packed inputs in its own layout, so a replay of a bucket other
    than the one last staged would read ids as positions and slots. Slots are -1 (nothing is
    written) and each sequence reads blocks of its own, as a real step's do: sequences sharing
    blocks would read the KV cache once from memory and then from the L2 (batch 32 on the H100,
    6.07 against 6.44 ms a replay of the 8B), which no real step does."""
    span = -(-context // graphs.block_size)
    num_blocks = graphs.kv_caches[0].shape[0]
    tables = [[(row * span + b) % num_blocks for b in range(span)] for row in range(bucket)]
    graphs.stage([0] * bucket, [context - 1] * bucket, [-1] * bucket, tables, [context] * bucket)


def graph_replay_ms(
    graphs, bucket: int, context: int, iters: int = 50, key: int | None = None
) -> float:
    """Replay one bucket's captured decode graph back to back (`key`: that graph; by default the
    bucket's graph for every context); CUDA-event time per replay, every sequence reading its own
    `context` tokens of KV."""
    stage_bucket(graphs, bucket, context)
    g = graphs.graphs[graphs.keys[bucket, graphs.max_model_len] if key is None else key]
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def graph_kernel_profile(
    graphs, bucket: int, context: int, iters: int = 20, top: int = 20
) -> list[dict]:
    """Where one replay's GPU time goes: kernels of the captured graph, summed by name, per
    replay."""
    from torch.profiler import ProfilerActivity, profile

    stage_bucket(graphs, bucket, context)
    # the bucket's graph for every context
    g = graphs.graphs[graphs.keys[bucket, graphs.max_model_len]]
    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            g.replay()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in rows) / iters
    out = [
        {
            "kernel": "ALL",
            "us_per_replay": round(total, 1),
            "count_per_replay": sum(e.count for e in rows) / iters,
        }
    ]
    out += [
        {
            "kernel": e.key[:90],
            "us_per_replay": round(e.device_time_total / iters, 1),
            "count_per_replay": e.count / iters,
        }
        for e in rows[:top]
    ]
    return out


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of positions equal up to the first divergence of each sequence (then counted as
    misses)."""
    same = total = 0
    for x, y in zip(a, b):
        total += len(x)
        for u, v in zip(x, y):
            if u != v:
                break
            same += 1
    return same / total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--hf-batches", default="1,32")
    ap.add_argument("--block-sizes", default="256")
    ap.add_argument("--eager", action="store_true", help="also measure without CUDA graphs")
    ap.add_argument(
        "--gemv",
        default="triton",
        help="kernel variants, comma-separated runs (a name again: another load, interleaved, "
        "against the spread between loads): triton (the default: fused Triton GEMVs "
        "with programmatic dependent launch), nopdl (kernels.pdl=False), cublas "
        "(kernels.triton_gemv=False), sepqkv (the separate q/k/v kernel before "
        "decode attention: kernels.decode_qkv=False), plainkv (decode attention "
        "without the tensor-memory accelerator: kernels.decode_tma=False), skinny / noskinny "
        "(multi-row products through the Triton skinny GEMM or cuBLAS: kernels.skinny_gemm), "
        "noelempdl (the norms, SiLU-and-mul and rotary/KV-store kernels without PDL: "
        "kernels.elementwise_pdl=False), noargmax (greedy sampling launched after the graph "
        "replay: kernels.argmax_in_graph=False), nodeep (decode attention two stages deep: "
        "kernels.decode_deep_tma=False), nowave (decode attention of up to one (sequence, KV "
        "head) pair per SM two stages deep, two programs per SM: kernels.decode_wave_tma=False), "
        "persistent (a batch-1 step's layers in one persistent kernel: "
        "kernels.persistent_decoder), qkv8 / qkv32 / qkv128 (decode attention also rotates q/k "
        "and stores the new k/v for steps of up to 8 / 32 / 128 rows: kernels.decode_qkv_rows), "
        "noslices (down's two K slices added by their own kernel: kernels.split_k_in_norm=False), "
        "maskedv (V's tiles zeroed past the context: kernels.decode_unmasked_v=False), "
        "noidleexit (decode splits past the context wait and run an empty loop: "
        "kernels.decode_idle_exit=False), nol2pf (no GEMV asks the L2 for its weight before the "
        "wait: kernels.gemv_l2_prefetch_bytes=0), l2pf16 / l2pf64 (batch-1 GEMVs of weights up "
        "to 16 / 64 MiB ask the L2 for them before the wait: kernels.gemv_l2_prefetch_bytes), "
        "nopreload / preload8 / preload32 (decode attention of up to 0 / 8 / 32 sequences "
        "fetches its splits' first K and V tiles before the wait: kernels.decode_preload_rows), "
        "noswiglu (a SiLU-and-mul kernel after each skinny gate/up product: "
        "kernels.gate_up_swiglu=False), splits1 (decode attention in one split a sequence, no "
        "merge: kernels.decode_splits=1), nolc (a PDL kernel behind a cuBLAS product launches "
        "once the product's blocks have exited: kernels.pdl_on_launch_completion=False), "
        "seqfirst (decode attention's grid sequences first: kernels.decode_heads_first=False), "
        "fetch / nofetch (each graph fetches its inputs from pinned host slots, or they are "
        "copied on the stream: kernels.graph_fetches_inputs)",
    )
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test on a tiny shape")
    ap.add_argument(
        "--profile", action="store_true", help="kernel breakdown of each batch's graph replay"
    )
    ap.add_argument(
        "--step-gaps",
        action="store_true",
        help="trace 20 engine steps at each batch: the ops between two decode graphs and the "
        "device's idle time per step",
    )
    ap.add_argument(
        "--planted-head",
        action="store_true",
        help="agreement on a model with a clear-cut argmax (bench/_shapes.plant_head)",
    )
    ap.add_argument(
        "--keep", type=Path, help="write the checkpoint here (for engine_long.py --checkpoint)"
    )
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    result: dict = {
        "shape": "llama3-8b",
        "dtype": "bfloat16",
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "copy_bw_tb_s": H200_COPY_BW / 1e12,
        "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
    }
    card_bw = card_copy_bandwidth() if DEVICE == "cuda" else None  # a CPU run has no card
    if card_bw:
        result["card_copy_bw_tb_s"] = round(card_bw / 1e12, 3)
    shape = TINY if args.tiny else LLAMA3_8B

    def dump() -> None:
        text = json.dumps(result, indent=2)
        if args.json:
            args.json.write_text(text)
        print(text, flush=True)

    root = args.keep or Path(
        tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    )
    hf = random_hf_model(shape, DEVICE)
    if args.planted_head:
        plant_head(hf)
        result["planted_head"] = True
    wbytes = weight_bytes_read(hf)
    result["weight_bytes_read"] = wbytes
    t = time.perf_counter()
    save_checkpoint(hf, root / "llama3-8b")
    result["checkpoint_write_s"] = round(time.perf_counter() - t, 1)
    ctx = args.prompt_len + args.new_tokens // 2
    try:
        result["transformers"] = {
            str(b): round(hf_step_ms(hf, b, args.prompt_len, args.new_tokens), 3)
            for b in (int(x) for x in args.hf_batches.split(",") if x)
        }
    except Exception:
        result["transformers_error"] = traceback.format_exc()[-2000:]
    agree_prompts = [[t % shape["vocab_size"] for t in p] for p in prompts(8, 64, seed=2)]
    hf_tokens = hf_greedy(hf, agree_prompts, 64)
    hf_flat = [t for seq in hf_tokens for t in seq]
    margins: list[float] = []
    references = noise_floor(hf, agree_prompts, hf_tokens, margins)
    fp32 = references["hf_fp32"]
    result["vs_hf_fp32_by_fp32_margin"] = {
        "hf_bf16_generate": agreement_by_margin(hf_flat, fp32, margins),
        "hf_bf16_forward": agreement_by_margin(references["hf_bf16_forward"], fp32, margins),
    }
    result["teacher_forced_noise_floor_vs_transformers_generate"] = {
        k: fraction_equal(v, hf_flat) for k, v in references.items()
    }
    result["teacher_forced_hf_bf16_vs_hf_fp32"] = fraction_equal(
        references["hf_bf16_forward"], references["hf_fp32"]
    )
    decisive = decisive_positions(hf_flat, references)
    result["decisive_positions"] = f"{len(decisive)}/{len(hf_flat)}"
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    dump()

    from flashstack.engine import LLM, SamplingParams

    gemvs = args.gemv.split(",")
    kernel_variants = {
        "triton": {},
        "nopdl": {"pdl": False},
        "cublas": {"triton_gemv": False},
        "sepqkv": {"decode_qkv": False},
        "plainkv": {"decode_tma": False},
        "skinny": {"skinny_gemm": True},
        "noskinny": {"skinny_gemm": False},
        "noelempdl": {"elementwise_pdl": False},
        "noargmax": {"argmax_in_graph": False},
        "nodeep": {"decode_deep_tma": False},
        "nowave": {"decode_wave_tma": False},
        "persistent": {"persistent_decoder": True},
        **{f"qkv{n}": {"decode_qkv_rows": n} for n in (8, 32, 128)},
        "noslices": {"split_k_in_norm": False},
        "maskedv": {"decode_unmasked_v": False},
        "noidleexit": {"decode_idle_exit": False},
        "nol2pf": {"gemv_l2_prefetch_bytes": 0},
        "l2pf16": {"gemv_l2_prefetch_bytes": 16 << 20},
        "l2pf64": {"gemv_l2_prefetch_bytes": 64 << 20},
        "nopreload": {"decode_preload_rows": 0},
        "preload8": {"decode_preload_rows": 8},
        "preload32": {"decode_preload_rows": 32},
        "noswiglu": {"gate_up_swiglu": False},
        "nolc": {"pdl_on_launch_completion": False},
        "splits1": {"decode_splits": 1},
        "seqfirst": {"decode_heads_first": False},
        "fetch": {"graph_fetches_inputs": True},
        "nofetch": {"graph_fetches_inputs": False},
    }
    runs = [
        (bs, False, gemv) for bs in (int(x) for x in args.block_sizes.split(",")) for gemv in gemvs
    ]
    if args.eager:
        runs.append((runs[0][0], True, gemvs[0]))
    for block_size, eager, gemv in runs:
        key = (
            f"flashstack_bs{block_size}"
            + ("_eager" if eager else "")
            + ("" if gemv == "triton" else f"_{gemv}")
        )
        # a variant named again is a second load, interleaved with the others: its own entry
        loads = 1 + sum(k == key or k.startswith(f"{key}_load") for k in result)
        if loads > 1:
            key += f"_load{loads}"
        try:
            t = time.perf_counter()
            llm = LLM(
                str(root / "llama3-8b"),
                block_size=block_size,
                max_num_seqs=max(batches),
                dtype="bfloat16",
                enforce_eager=eager,
                gpu_memory_utilization=0.85,
                max_model_len=4096,
                show_progress=False,
                device=DEVICE,
                kernels=kernel_variants[gemv],
            )
            entry: dict = {"load_s": round(time.perf_counter() - t, 1), "steps": {}}
            ours = [
                o.token_ids
                for o in llm.generate(
                    agree_prompts, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
                )
            ]
            entry["greedy_agreement_vs_transformers"] = round(agreement(ours, hf_tokens), 4)
            forced = teacher_forced(llm, agree_prompts, hf_tokens)
            entry["teacher_forced_agreement_vs_transformers"] = fraction_equal(forced, hf_flat)
            entry["teacher_forced_agreement_vs_transformers_fp32"] = fraction_equal(
                forced, references["hf_fp32"]
            )
            entry["vs_hf_fp32_by_fp32_margin"] = agreement_by_margin(forced, fp32, margins)
            if decisive:
                entry["teacher_forced_agreement_on_decisive_positions"] = fraction_equal(
                    [forced[i] for i in decisive], [hf_flat[i] for i in decisive]
                )
            graphs = llm.engine.runner.graphs
            if graphs is not None:  # the GPU's own time for one step, without any host work
                entry["graph_replay_ms"] = {
                    str(b): round(graph_replay_ms(graphs, b, ctx), 3)
                    for b in (1, 8, 32, 128)
                    if b in graphs.bounds
                }
                if args.profile:  # each measured batch's graph: where its replay's time goes
                    for b in batches:
                        if b in graphs.bounds:
                            entry[f"graph_kernels_b{b}"] = graph_kernel_profile(graphs, b, ctx)
            for b in batches:
                ms = our_step_ms(llm, b, args.prompt_len, args.new_tokens)
                floor = (wbytes + kv_bytes_read(shape, b, ctx)) / H200_COPY_BW * 1000
                entry["steps"][str(b)] = {
                    "ms_per_step": round(ms, 3),
                    "tokens_per_s": round(b * 1000 / ms, 1),
                    "floor_ms": round(floor, 3),
                    "fraction_of_floor": round(floor / ms, 3),
                }
                if card_bw:
                    entry["steps"][str(b)]["fraction_of_card_floor"] = on_card(floor / ms, card_bw)
                if "transformers" in result and str(b) in result["transformers"]:
                    entry["steps"][str(b)]["speedup_vs_transformers"] = round(
                        result["transformers"][str(b)] / ms, 1
                    )
                if args.step_gaps and DEVICE == "cuda":
                    entry["steps"][str(b)]["between_graphs"] = step_gaps(llm, b, args.prompt_len)
                dump()
            result[key] = entry
            del llm, graphs  # the graphs hold the KV cache: the next load needs its memory
            gc.collect()
            torch.cuda.empty_cache()
        except Exception:
            result[key + "_error"] = traceback.format_exc()[-3000:]
        dump()


if __name__ == "__main__":
    main()

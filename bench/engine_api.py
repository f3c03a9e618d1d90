"""The engine server's API process alone: tokens/s it streams to N clients when a synthetic engine
core steps at a GPU's pace, and its CPU time per token (docs/benchmarks.md, "Engine serving").

The core process, its step messages and pipe, the API process (EngineCoreClient, build_app,
uvicorn) are the real ones; only the LLMEngine is replaced by `SyntheticEngine`, which sleeps
`--step-ms` per step (a GPU step, off the GIL as a CUDA sync is) and then emits one token for every
running request. So the API process's whole per-token path is measured on a machine without a GPU,
and its ceiling shows as delivered tok/s falling below `streams / step`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_serving import _sampler, run_rate, word_level_tokenizer, workload  # noqa: E402

VOCAB = 151936  # Qwen3's, so token texts ("w123456") are as long as a real model's words


@dataclass
class _Request:
    request_id: str
    prompt_tokens: int
    max_tokens: int
    generated: int = 0
    tokens: list[int] = field(default_factory=list)


class SyntheticEngine:
    """LLMEngine's surface as the core process uses it; every step takes `step_s` and gives each
    running request one token whose text is the word-level tokenizer's (` w{id}`)."""

    def __init__(self, step_s: float, max_model_len: int = 4096) -> None:
        self.step_s = step_s
        self.requests: dict[str, _Request] = {}
        self._aborted: list[Any] = []
        self._next = 0.0
        self._token = 1000
        self.tokenizer = None
        self.config = SimpleNamespace(model="synthetic", max_model_len=max_model_len)
        self.model = SimpleNamespace(args=SimpleNamespace(vocab_size=VOCAB))
        self.scheduler = SimpleNamespace(running=[], waiting=[], swapped=[], num_preemptions=0)
        self.block_manager = SimpleNamespace(
            num_used_blocks=0, num_blocks=1, block_size=16, num_prefix_queries=0, num_prefix_hits=0
        )

    def make_sequence(self, prompt: Any, params: Any, request_id: str, priority: int) -> _Request:
        return _Request(request_id, len(prompt), params.max_tokens or 16)

    def add_state(self, req: _Request) -> None:
        self.requests[req.request_id] = req

    def abort_request(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None:
            self._aborted.append(self._delta(req, [], "abort"))

    def abort_all(self) -> None:
        self.requests.clear()

    def has_pending_output(self) -> bool:
        return bool(self.requests or self._aborted)

    def shutdown(self) -> None:
        pass

    def step(self) -> list[Any]:
        now = time.perf_counter()
        self._next = max(self._next + self.step_s, now)
        time.sleep(self._next - now)
        deltas, self._aborted = self._aborted, []
        for rid, req in list(self.requests.items()):
            req.generated += 1
            self._token = self._token * 7 % VOCAB + 1000
            done = req.generated >= req.max_tokens
            deltas.append(self._delta(req, [self._token], "length" if done else None))
            if done:
                del self.requests[rid]
        return deltas

    def _delta(self, req: _Request, tokens: list[int], finish: str | None) -> Any:
        from flashstack.engine.outputs import StreamDelta

        text = "".join(f" w{t}" for t in tokens)
        return StreamDelta(req.request_id, tokens, text, finish, req.prompt_tokens, req.generated)


def serve_synthetic(port: int, step_s: float, model_dir: str) -> None:
    """`flashstack engine serve` (server.serve: its app, uvicorn and process set-up) over a
    SyntheticEngine core."""
    import functools

    from flashstack.engine.lifecycle import ServeOptions
    from flashstack.engine.server import serve

    options = ServeOptions(served_model_names=["bench"])
    factory = functools.partial(SyntheticEngine, step_s)
    serve(model_dir, port=port, model_name="bench", options=options, engine_factory=factory)


def _cpu_s(pid: int) -> float:
    # utime + stime of the process (all its threads, not its children), in seconds
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _start(port: int, step_s: float, model_dir: Path) -> subprocess.Popen:
    code = (
        "from bench.engine_api import serve_synthetic; "
        f"serve_synthetic({port}, {step_s!r}, {str(model_dir)!r})"
    )
    root = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.Popen([sys.executable, "-c", code], cwd=root, env=env)


def _wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the synthetic server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError("the synthetic server did not answer /health")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One burst of `--streams` requests against a fresh synthetic server."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    model_dir = Path(tempfile.mkdtemp())
    word_level_tokenizer(64, model_dir)
    proc = _start(port, args.step_ms / 1e3, model_dir)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url)
        work = workload(args.streams, tuple(args.prompt_len), tuple(args.output_len), VOCAB)
        warm = workload(8, (8, 16), (4, 8), VOCAB, seed=1)
        slo = (1.0, 0.05)
        run_rate(url, "bench", warm, math.inf, None, 0, slo)
        spy = _sampler(proc.pid, args.py_spy)
        cpu0, client0 = _cpu_s(proc.pid), time.process_time()
        out = run_rate(url, "bench", work, math.inf, args.concurrency, 0, slo, client=args.client)
        api_cpu, client_cpu = _cpu_s(proc.pid) - cpu0, time.process_time() - client0
        if spy is not None:
            spy.send_signal(2)  # SIGINT: py-spy writes what it sampled
            spy.wait(30)
    finally:
        proc.terminate()
        proc.wait(30)
    tokens = out["output_tokens"]
    streams = args.concurrency or args.streams
    out |= {
        "step_ms": args.step_ms,
        "core_ceiling_tok_per_s": round(streams / (args.step_ms / 1e3), 1),
        "api_cpu_s": round(api_cpu, 2),
        "api_cpu_us_per_token": round(api_cpu / max(tokens, 1) * 1e6, 2),
        "client_cpu_us_per_token": round(client_cpu / max(tokens, 1) * 1e6, 2),
    }
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=None)
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(100, 1024))
    ap.add_argument("--output-len", type=int, nargs=2, default=(100, 512))
    ap.add_argument("--client", choices=["aiohttp", "httpx"], default="aiohttp")
    ap.add_argument("--py-spy", type=Path, help="sample the API process during the burst")
    return ap.parse_args(argv)


if __name__ == "__main__":
    print(json.dumps(measure(parse_args()), indent=2))

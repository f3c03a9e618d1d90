"""Latency and CPU a gateway adds, flashstack vs LiteLLM: docs/benchmarks.md, "Gateway overhead"."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway.loadgen import Target, closed_loop, open_loop, summary  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / ".bench"
LITELLM = "litellm[proxy]==1.108.7"
LITELLM_VENV = WORK / "litellm-venv"
GATEWAY_CORE, LOAD_CORE = 0, 1
HZ = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")

# ---- processes ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree(pid: int) -> list[int]:
    """`pid` and all its descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


@dataclass
class Proc:
    """A pinned child process whose CPU time and RSS are read from /proc."""

    name: str
    popen: subprocess.Popen

    def cpu_seconds(self) -> float:
        total = 0
        for pid in _tree(self.popen.pid):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += int(fields[11]) + int(fields[12])  # utime + stime, in clock ticks
        return total / HZ

    def rss_mb(self) -> float:
        total = 0
        for pid in _tree(self.popen.pid):
            try:
                total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
            except OSError:
                continue
        return round(total / 2**20, 1)

    def stop(self) -> None:
        self.popen.terminate()
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


# The checkout whose flashstack is measured (--tree): `python -m` puts the working directory
# first on sys.path, so PYTHONPATH alone would still serve this checkout.
TREE = ROOT


def spawn(
    name: str, argv: list[str], core: int, env: dict[str, str] | None = None, cwd: Path = ROOT
) -> Proc:
    log = open(WORK / f"{name}.log", "w")
    popen = subprocess.Popen(
        ["taskset", "-c", str(core), *argv],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )
    return Proc(name, popen)


def wait_until_serving(proc: Proc, target: Target, timeout: float) -> None:
    """Poll with a real request until the process answers 200."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited; see {WORK / (proc.name + '.log')}")
        try:
            run = asyncio.run(closed_loop(target, 1, 1, timeout=5))
            if run.samples:
                return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(
        f"{proc.name} did not serve within {timeout:.0f} s; see {WORK / (proc.name + '.log')}"
    )


def start_mock(port: int, chunks: int, gap_ms: float) -> Proc:
    argv = [
        sys.executable,
        str(ROOT / "bench/gateway/mock_upstream.py"),
        "--port",
        str(port),
        "--chunks",
        str(chunks),
        "--gap-ms",
        str(gap_ms),
    ]
    return spawn("mock", argv, LOAD_CORE)


def start_flashstack(
    port: int,
    mock: int,
    server: str = "uvicorn",
    traces: str | None = None,
    request_log: bool = True,
) -> Proc:
    cfg = WORK / "flashstack.yaml"
    cfg.write_text(
        json.dumps(
            {
                "server": {"host": "127.0.0.1", "port": port},
                # Traces: every span exported over OTLP/HTTP (batched) to `traces`, a collector that
                # says 200.
                "telemetry": {"enabled": True, "endpoint": traces}
                if traces
                else {"enabled": False},
                # Without the request log: no ring and no fs_requests rows (what the console and
                # spend read).
                **({} if request_log else {"spend": {"log_size": 0, "store_requests": False}}),
                "models": [
                    {
                        "name": "gpt",
                        "provider": "openai",
                        "model": "gpt-4o-mini",
                        "api_base": f"http://127.0.0.1:{mock}/v1",
                        "api_key": "sk-mock",
                    },
                    {
                        "name": "claude",
                        "provider": "anthropic",
                        "model": "claude-sonnet-4-5",
                        "api_base": f"http://127.0.0.1:{mock}",
                        "api_key": "sk-mock",
                    },
                ],
            }
        )
    )
    # uvicorn's own httptools protocol, without gateway/server_limits.py
    if server == "uvicorn-unlimited":
        argv = [
            sys.executable,
            "-m",
            "uvicorn",
            "--http",
            "httptools",
            "--loop",
            "uvloop",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--no-access-log",
            "--log-level",
            "warning",
            "--timeout-keep-alive",
            "15",
            "--app-dir",
            str(ROOT / "bench/gateway"),
            "asgi_app:app",
        ]
        return spawn("flashstack", argv, GATEWAY_CORE, {"FLASHSTACK_CONFIG": str(cfg)}, TREE)
    if server == "granian":  # the comparison in docs/benchmarks.md; `flashstack serve` runs uvicorn
        argv = [
            str(Path(sys.executable).parent / "granian"),
            "--interface",
            "asgi",
            "--loop",
            "uvloop",
            "--workers",
            "1",
            "--runtime-mode",
            "st",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--no-access-log",
            "--log-level",
            "warning",
            "--working-dir",
            str(ROOT / "bench/gateway"),
            "asgi_app:app",
        ]
        return spawn("flashstack", argv, GATEWAY_CORE, {"FLASHSTACK_CONFIG": str(cfg)}, TREE)
    argv = [
        sys.executable,
        "-m",
        "flashstack.cli",
        "serve",
        "--config",
        str(cfg),
        "--port",
        str(port),
    ]
    return spawn("flashstack", argv, GATEWAY_CORE, cwd=TREE)


class Collector:
    """An OTLP/HTTP endpoint in a thread of this process that counts the spans it is sent."""

    def __init__(self) -> None:
        import http.server
        import threading

        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        self.spans = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                msg = ExportTraceServiceRequest.FromString(
                    self.rfile.read(int(self.headers["content-length"]))
                )
                outer.spans += sum(len(s.spans) for r in msg.resource_spans for s in r.scope_spans)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()


def start_collector() -> Collector:
    return Collector()


def start_llamacpp(port: int) -> Proc:
    """llama.cpp's server (`make peers`) on the SmolLM2 GGUF, one thread, on the load core."""
    from flashstack.engine.bundled import smollm2_path

    python, gguf = ROOT / ".peers/llamacpp/bin/python", smollm2_path()
    if not python.exists() or gguf is None:
        sys.exit(
            "--upstream llamacpp needs `make peers` (llama.cpp) and `make install` (the SmolLM2 "
            "GGUF)"
        )
    argv = [
        str(python),
        "-m",
        "llama_cpp.server",
        "--model",
        str(gguf),
        "--model_alias",
        "smollm2",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_threads",
        "1",
    ]
    return spawn("llamacpp", argv, LOAD_CORE)


def ensure_litellm() -> Path:
    """LiteLLM's proxy in its own venv; a constraint that no torch can satisfy keeps CUDA wheels
    out."""
    exe = LITELLM_VENV / "bin" / "litellm"
    stamp = LITELLM_VENV / ".installed"
    if exe.exists() and stamp.exists() and stamp.read_text() == LITELLM:
        return exe
    WORK.mkdir(exist_ok=True)
    (WORK / "no-torch.txt").write_text("torch===0.0.0.never\n")
    subprocess.run([sys.executable, "-m", "venv", str(LITELLM_VENV)], check=True)
    pip = [str(LITELLM_VENV / "bin" / "python"), "-m", "pip", "install", "-q"]
    # uvloop + httptools: LiteLLM gets the same fast server stack as flashstack.
    subprocess.run(
        [*pip, "-c", str(WORK / "no-torch.txt"), LITELLM, "uvloop", "httptools"], check=True
    )
    stamp.write_text(LITELLM)
    return exe


def start_litellm(port: int, mock: int) -> Proc:
    exe = ensure_litellm()
    cfg = WORK / "litellm.yaml"
    cfg.write_text(
        json.dumps(
            {
                "model_list": [
                    # A name missing from LiteLLM's cost map: gpt-4o-mini there is bridged to
                    # /v1/responses.
                    {
                        "model_name": "gpt",
                        "litellm_params": {
                            "model": "openai/mock-chat",
                            "api_base": f"http://127.0.0.1:{mock}/v1",
                            "api_key": "sk-mock",
                        },
                    },
                    {
                        "model_name": "claude",
                        "litellm_params": {
                            "model": "anthropic/claude-sonnet-4-5",
                            "api_base": f"http://127.0.0.1:{mock}",
                            "api_key": "sk-mock",
                        },
                    },
                ],
                # Anthropic clients on an OpenAI model: chat/completions upstream, as flashstack
                # does (LiteLLM's default there is the Responses API).
                "litellm_settings": {
                    "drop_params": True,
                    "telemetry": False,
                    "use_chat_completions_url_for_anthropic_messages": True,
                },
                # No auth on either gateway: flashstack runs without keys here too, so neither pays
                # for a check.
                "general_settings": {"dangerously_permit_weak_or_unset_master_key": True},
            }
        )
    )
    env = {
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_LOG": "ERROR",
        "LITELLM_TELEMETRY": "False",
    }
    argv = [
        str(exe),
        "--config",
        str(cfg),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--num_workers",
        "1",
    ]
    return spawn("litellm", argv, GATEWAY_CORE, env)


# ---- requests ----------------------------------------------------------------------------------

SYSTEM, PROMPT = "You are terse.", "Say hello in twenty words."
ANTHROPIC_HEADERS = {"anthropic-version": "2023-06-01", "x-api-key": "sk-mock"}
OPENAI_HEADERS = {"authorization": "Bearer sk-mock"}
# --upstream llamacpp: greedy, so direct and gateway generate the same tokens
SAMPLING: dict[str, Any] = {}


def openai_request(port: int, path: str, model: str, stream: bool) -> Target:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": 64,
        **SAMPLING,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPT}],
    }
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return Target.post("127.0.0.1", port, path, json.dumps(body).encode(), OPENAI_HEADERS)


def anthropic_request(port: int, path: str, model: str, stream: bool) -> Target:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": 64,
        "system": SYSTEM,
        **SAMPLING,
        "messages": [{"role": "user", "content": PROMPT}],
    }
    if stream:
        body["stream"] = True
    return Target.post("127.0.0.1", port, path, json.dumps(body).encode(), ANTHROPIC_HEADERS)


def embeddings_request(port: int, model: str) -> Target:
    body = {"model": model, "input": PROMPT, "encoding_format": "float"}
    return Target.post(
        "127.0.0.1", port, "/v1/embeddings", json.dumps(body).encode(), OPENAI_HEADERS
    )


@dataclass(frozen=True)
class Scenario:
    """A client protocol, the gateway model it calls, and the upstream call that model makes."""

    name: str
    client: str  # "openai" | "anthropic"
    model: str  # gateway model name
    upstream: str  # protocol of the upstream behind that model
    operation: str = "chat"  # | "embeddings" (OpenAI wire only, never streamed)

    def via_gateway(self, port: int, stream: bool) -> Target:
        if self.operation == "embeddings":
            return embeddings_request(port, self.model)
        if self.client == "openai":
            return openai_request(port, "/v1/chat/completions", self.model, stream)
        return anthropic_request(port, "/v1/messages", self.model, stream)

    def direct(self, mock: int, stream: bool) -> Target:
        if self.operation == "embeddings":
            return embeddings_request(mock, "text-embedding-3-small")
        if self.upstream == "openai":
            return openai_request(mock, "/v1/chat/completions", "gpt-4o-mini", stream)
        return anthropic_request(mock, "/v1/messages", "claude-sonnet-4-5", stream)


OPENAI = Scenario("openai", "openai", "gpt", "openai")
ANTHROPIC = Scenario("anthropic", "anthropic", "claude", "anthropic")
TRANSLATED = Scenario("anthropic_to_openai", "anthropic", "gpt", "openai")
# passed through
EMBEDDINGS = Scenario("embeddings", "openai", "gpt", "openai", operation="embeddings")


# ---- measurement -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """How many requests each phase sends, for one gateway in one mode."""

    seq: int
    seq_stream: int
    conc: dict[int, int]
    rates: list[int]
    rate_seconds: float
    soak: int
    warmup: int


def plans(quick: bool) -> dict[str, Plan]:
    if quick:
        return {
            "flashstack": Plan(
                300, 60, {16: 800, 64: 1000}, [250, 500, 1000, 1500], 1.0, 2_000, 200
            ),
            "litellm": Plan(40, 12, {16: 64, 64: 128}, [10, 25, 50], 1.0, 100, 20),
        }
    return {
        "flashstack": Plan(
            1500,
            300,
            {16: 5000, 64: 6000},
            [250, 500, 750, 1000, 1250, 1500, 2000, 3000],
            3.0,
            100_000,
            1000,
        ),
        "litellm": Plan(
            200, 60, {16: 300, 64: 400}, [10, 25, 50, 75, 100, 150, 200], 3.0, 1000, 50
        ),
    }


def run(coro: Any) -> Any:
    import uvloop

    return uvloop.run(coro)


def added(direct: dict[str, float], via: dict[str, float]) -> dict[str, float]:
    """Gateway minus direct, per percentile."""
    return {
        k: round(via[k] - direct[k], 3) for k in ("p50_ms", "p99_ms", "ttft_p50_ms", "ttft_p99_ms")
    }


def side_by_side(
    gw: Proc, port: int, mock: int, sc: Scenario, stream: bool, conc: int, n: int
) -> dict:
    """Direct, then through the gateway, same load; plus the gateway's CPU per request."""
    direct = summary(run(closed_loop(sc.direct(mock, stream), conc, n)))
    cpu0 = gw.cpu_seconds()
    via = summary(run(closed_loop(sc.via_gateway(port, stream), conc, n)))
    cpu = gw.cpu_seconds() - cpu0
    return {
        "direct": direct,
        "gateway": via,
        "added": added(direct, via),
        "cpu_ms_per_request": round(cpu * 1000 / max(1, via["n"]), 3),
    }


def max_rate(port: int, plan: Plan) -> dict:
    """Open loop at rising rates; the highest that keeps p99 ≤ 50 ms, no errors, ≥ 95 %
    delivered."""
    steps, best = [], 0
    for rate in plan.rates:
        s = summary(run(open_loop(OPENAI.via_gateway(port, False), rate, plan.rate_seconds)))
        ok = s["errors"] == 0 and s["p99_ms"] <= 50 and s["n"] >= 0.95 * rate * plan.rate_seconds
        steps.append(
            {
                "rate": rate,
                "ok": ok,
                **{k: s[k] for k in ("n", "errors", "rps", "p50_ms", "p99_ms")},
            }
        )
        if not ok:
            break
        best = rate
    return {"max_rps_p99_under_50ms": best, "steps": steps}


def measure(name: str, gw: Proc, port: int, mock: int, plan: Plan, chunks: int) -> dict:
    out: dict[str, Any] = {"rss_idle_mb": gw.rss_mb()}
    run(closed_loop(OPENAI.via_gateway(port, False), 4, plan.warmup))
    run(closed_loop(OPENAI.via_gateway(port, True), 4, plan.warmup // 4))
    run(closed_loop(TRANSLATED.via_gateway(port, False), 4, plan.warmup // 4))
    out["rss_warm_mb"] = gw.rss_mb()
    seq: dict[str, Any] = {}
    for sc in (OPENAI, ANTHROPIC, TRANSLATED):
        for stream in (False, True):
            key = f"{sc.name}_{'stream' if stream else 'nonstream'}"
            seq[key] = side_by_side(
                gw, port, mock, sc, stream, 1, plan.seq_stream if stream else plan.seq
            )
            _progress(name, key, seq[key])
    seq["embeddings_nonstream"] = side_by_side(gw, port, mock, EMBEDDINGS, False, 1, plan.seq)
    _progress(name, "embeddings_nonstream", seq["embeddings_nonstream"])
    out["sequential"] = seq
    conc: dict[str, Any] = {}
    for c, n in plan.conc.items():
        for stream in (False, True):
            key = f"c{c}_openai_{'stream' if stream else 'nonstream'}"
            conc[key] = side_by_side(gw, port, mock, OPENAI, stream, c, n // 4 if stream else n)
            _progress(name, key, conc[key])
    out["concurrent"] = conc
    out["throughput"] = max_rate(port, plan)
    out["throughput"]["closed_loop_c64_rps"] = conc["c64_openai_nonstream"]["gateway"]["rps"]
    _progress(name, "max_rate", out["throughput"])
    out["soak"] = soak(gw, port, plan.soak)
    out["headline"] = headline(out, chunks)
    return out


def measure_real_upstream(name: str, gw: Proc, port: int, upstream: int, n: int) -> dict:
    """In front of a real model server: sequential only (llama.cpp's server answers one request at a
    time), the upstream's own time per request beside what the gateway adds to it."""
    seq: dict[str, Any] = {}
    for sc in (OPENAI, TRANSLATED):
        for stream in (False, True):
            key = f"{sc.name}_{'stream' if stream else 'nonstream'}"
            seq[key] = side_by_side(gw, port, upstream, sc, stream, 1, n)
            _progress(name, key, seq[key])
    headline = {
        key: {
            "upstream_p50_ms": r["direct"]["p50_ms"],
            "upstream_p99_ms": r["direct"]["p99_ms"],
            "added_p50_ms": r["added"]["p50_ms"],
            "added_p99_ms": r["added"]["p99_ms"],
        }
        for key, r in seq.items()
    }
    return {"sequential": seq, "headline": headline}


def soak(gw: Proc, port: int, n: int) -> dict:
    """RSS after `n` requests and after `n` more: a leak shows as growth in the second half."""
    target = OPENAI.via_gateway(port, False)
    t0 = time.perf_counter()
    first = run(closed_loop(target, 16, n))
    rss1 = gw.rss_mb()
    second = run(closed_loop(target, 16, n))
    rss2 = gw.rss_mb()
    return {
        "requests_per_half": n,
        "errors": first.errors + second.errors,
        "rss_after_first_mb": rss1,
        "rss_after_second_mb": rss2,
        "rss_growth_second_half_mb": round(rss2 - rss1, 1),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def headline(out: dict, chunks: int) -> dict:
    """The numbers the targets name, pulled out of the detail."""
    seq = out["sequential"]
    ns, st = seq["openai_nonstream"]["added"], seq["openai_stream"]["added"]
    per_chunk = (st["p50_ms"] - st["ttft_p50_ms"]) / max(1, chunks - 1)
    same, trans = (
        seq["anthropic_nonstream"]["added"]["p50_ms"],
        seq["anthropic_to_openai_nonstream"]["added"]["p50_ms"],
    )
    c16 = out["concurrent"]["c16_openai_nonstream"]
    return {
        "nonstream_seq_added_p50_ms": ns["p50_ms"],
        "nonstream_seq_added_p99_ms": ns["p99_ms"],
        "stream_seq_added_ttft_p50_ms": st["ttft_p50_ms"],
        "stream_seq_added_total_p50_ms": st["p50_ms"],
        "stream_added_per_chunk_ms": round(per_chunk, 3),
        "c16_nonstream_added_p50_ms": c16["added"]["p50_ms"],
        "c16_nonstream_added_p99_ms": c16["added"]["p99_ms"],
        "c64_nonstream_added_p50_ms": out["concurrent"]["c64_openai_nonstream"]["added"]["p50_ms"],
        "c64_nonstream_added_p99_ms": out["concurrent"]["c64_openai_nonstream"]["added"]["p99_ms"],
        "max_rps_p99_under_50ms": out["throughput"]["max_rps_p99_under_50ms"],
        "closed_loop_c64_rps": out["throughput"]["closed_loop_c64_rps"],
        "cpu_ms_per_request_nonstream": c16["cpu_ms_per_request"],
        "cpu_ms_per_request_stream": out["concurrent"]["c16_openai_stream"]["cpu_ms_per_request"],
        "translation_added_over_same_protocol_p50_ms": round(trans - same, 3),
        "embeddings_seq_added_p50_ms": seq["embeddings_nonstream"]["added"]["p50_ms"],
        "embeddings_seq_added_p99_ms": seq["embeddings_nonstream"]["added"]["p99_ms"],
        "cpu_ms_per_request_embeddings": seq["embeddings_nonstream"]["cpu_ms_per_request"],
        "rss_idle_mb": out["rss_idle_mb"],
        "rss_after_soak_mb": out["soak"]["rss_after_second_mb"],
        "rss_growth_second_half_mb": out["soak"]["rss_growth_second_half_mb"],
    }


def _progress(gateway: str, phase: str, result: dict) -> None:
    brief = result.get("added", {k: result[k] for k in ("max_rps_p99_under_50ms",) if k in result})
    print(f"[{gateway}] {phase}: {brief}", file=sys.stderr, flush=True)


def machine_load() -> dict:
    load1, load5, _ = os.getloadavg()
    return {"cores": os.cpu_count(), "loadavg_1m": round(load1, 2), "loadavg_5m": round(load5, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description="flashstack vs LiteLLM gateway overhead")
    p.add_argument("--quick", action="store_true", help="fewer requests: ≤ 2 min instead of ≤ 10")
    p.add_argument(
        "--only", choices=["flashstack", "litellm"], action="append", help="measure one gateway"
    )
    p.add_argument("--chunks", type=int, default=20, help="content events per streamed response")
    p.add_argument(
        "--gap-ms", type=float, default=1.0, help="mock's pause between streamed content events"
    )
    p.add_argument(
        "--server",
        choices=["uvicorn", "uvicorn-unlimited", "granian"],
        default="uvicorn",
        help="flashstack's ASGI server (granian: `pip install granian` first; uvicorn-unlimited: "
        "without the server limits' protocol class; both comparisons only)",
    )
    p.add_argument(
        "--upstream",
        choices=["mock", "llamacpp"],
        default="mock",
        help="llamacpp: llama.cpp's server on the SmolLM2 GGUF instead of the mock "
        "(sequential only)",
    )
    p.add_argument("--json", type=Path, help="also write the result here")
    p.add_argument(
        "--tree",
        type=Path,
        default=ROOT,
        help="measure the flashstack of this checkout (e.g. a `git archive` of another commit); "
        "default: this one",
    )
    p.add_argument(
        "--no-log",
        action="store_true",
        help="also measure flashstack without its request log (flashstack+nolog), side by side",
    )
    p.add_argument(
        "--traces",
        action="store_true",
        help="also measure flashstack with OpenTelemetry on (flashstack+traces), side by side",
    )
    args = p.parse_args()
    global TREE
    TREE = args.tree.resolve()
    if os.cpu_count() is None or os.cpu_count() < 2:
        sys.exit("needs 2 cores: the gateway on core 0, mock and load on core 1")
    WORK.mkdir(exist_ok=True)
    os.sched_setaffinity(0, {LOAD_CORE})
    t0 = time.perf_counter()
    mock_port = free_port()
    if args.upstream == "llamacpp":
        SAMPLING["temperature"] = 0
        mock = start_llamacpp(mock_port)
    else:
        mock = start_mock(mock_port, args.chunks, args.gap_ms)
    collector = start_collector() if args.traces else None
    result: dict[str, Any] = {
        "bench": "gateway_overhead",
        "upstream": args.upstream,
        "quick": args.quick,
        "chunks": args.chunks,
        "gap_ms": args.gap_ms,
        "flashstack_server": args.server,
        "machine_before": machine_load(),
        "pinning": {"gateway": GATEWAY_CORE, "mock_and_load": LOAD_CORE},
    }
    try:
        wait_until_serving(
            mock, OPENAI.direct(mock_port, False), 60 if args.upstream == "llamacpp" else 10
        )
        names = list(args.only or ["flashstack", "litellm"])
        if args.traces:
            names.insert(
                names.index("flashstack") + 1 if "flashstack" in names else 0, "flashstack+traces"
            )
        if args.no_log:
            names.insert(
                names.index("flashstack") + 1 if "flashstack" in names else 0, "flashstack+nolog"
            )
        for name in names:
            port = free_port()
            if name == "flashstack":
                gw = start_flashstack(port, mock_port, args.server)
            elif name == "flashstack+nolog":
                gw = start_flashstack(port, mock_port, args.server, request_log=False)
            elif name == "flashstack+traces":
                gw = start_flashstack(port, mock_port, args.server, collector.url)  # type: ignore[union-attr]
            else:
                gw = start_litellm(port, mock_port)
            try:
                wait_until_serving(gw, OPENAI.via_gateway(port, False), 120)
                plan = plans(args.quick)[name.split("+")[0]]
                if args.upstream == "llamacpp":
                    result[name] = measure_real_upstream(
                        name, gw, port, mock_port, 10 if args.quick else 40
                    )
                else:
                    result[name] = measure(name, gw, port, mock_port, plan, args.chunks)
            finally:
                gw.stop()
    finally:
        mock.stop()
        if collector is not None:
            result["spans_exported"] = collector.spans
            collector.stop()
    result["machine_after"] = machine_load()
    result["seconds"] = round(time.perf_counter() - t0, 1)
    if "flashstack" in result and "litellm" in result and args.upstream == "mock":
        f, lite = result["flashstack"]["headline"], result["litellm"]["headline"]
        result["ratio_litellm_over_flashstack"] = {
            k: round(lite[k] / f[k], 1)
            for k in (
                "nonstream_seq_added_p50_ms",
                "stream_seq_added_ttft_p50_ms",
                "cpu_ms_per_request_nonstream",
            )
            if f[k] > 0
        }
    if "flashstack" in result and "flashstack+traces" in result and args.upstream == "mock":
        f, t = result["flashstack"]["headline"], result["flashstack+traces"]["headline"]
        result["traces_added"] = {
            k: round(t[k] - f[k], 3) for k in f if isinstance(f[k], int | float)
        }
    if "flashstack" in result and "flashstack+nolog" in result:
        f, n = result["flashstack"]["headline"], result["flashstack+nolog"]["headline"]
        result["request_log_added"] = {
            k: round(f[k] - n[k], 3) for k in f if isinstance(f[k], int | float)
        }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)


if __name__ == "__main__":
    main()

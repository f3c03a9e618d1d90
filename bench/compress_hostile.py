"""What hostile requests cost a compressing gateway: docs/benchmarks.md, "Compression: hostile"."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SERVE = """
import sys, uvicorn
from pathlib import Path
from flashstack.gateway.config import CompressionConfig, Config, ModelConfig, ServerConfig
from flashstack.gateway.app import create_app

cache = Path(sys.argv[2])
cfg = Config(server=ServerConfig(max_body_bytes=8 * 1024 * 1024),
             models=[ModelConfig(name="tiny", provider="openai", model="gpt-4-0613",
                                 context_window=1500, api_base=sys.argv[3], api_key="sk-bench")],
             compression=CompressionConfig(cache_dir=cache), state_dir=cache.parent)
uvicorn.run(create_app(cfg), host="127.0.0.1", port=int(sys.argv[1]), log_level="error")
"""


class Gateway:
    """The gateway process, its RSS and CPU time read from /proc."""

    def __init__(self, tree: Path, port: int, cache: Path, upstream: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(tree)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVE, str(port), str(cache), upstream],
            env=env,
            cwd=tempfile.gettempdir(),
            stderr=subprocess.DEVNULL,
        )
        self.url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                httpx.get(self.url + "/health/liveness")
                return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError("the gateway did not start")

    def rss_mb(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS"):
                return int(line.split()[1]) // 1024
        raise RuntimeError("no VmRSS")

    def cpu_s(self) -> float:
        f = Path(f"/proc/{self.proc.pid}/stat").read_text().split()
        return (int(f[13]) + int(f[14])) / os.sysconf("SC_CLK_TCK")

    def post(self, name: str, messages: list[dict], **extra: object) -> dict[str, object]:
        cpu, start = self.cpu_s(), time.monotonic()
        r = httpx.post(
            self.url + "/v1/chat/completions",
            json={"model": "tiny", "messages": messages, **extra},
            timeout=600,
        )
        return {
            "request": name,
            "status": r.status_code,
            "compression": r.headers.get("x-flashstack-compression"),
            "fallback": r.headers.get("x-flashstack-compression-fallback"),
            "wall_s": round(time.monotonic() - start, 2),
            "cpu_s": round(self.cpu_s() - cpu, 2),
            "rss_mb": self.rss_mb(),
        }

    def wait_for_model(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = httpx.get(self.url + "/health/readiness").json().get("compression")
            # None: a tree that loads in the request
            if state is None or state["embedding_model"] != "loading":
                return
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--tree", type=Path, default=ROOT, help="source tree whose flashstack the gateway runs"
    )
    ap.add_argument("--port", type=int, default=18750)
    args = ap.parse_args()

    from tests.fakes import openai_upstream
    from tests.fakes.server import FakeServer
    from tests.gateway.compress.test_budget import TAIL, pathological
    from tests.gateway.compress.test_gateway import history

    upstream = FakeServer(openai_upstream.create_app(api_key="sk-bench")).start()
    with tempfile.TemporaryDirectory() as state:
        gw = Gateway(args.tree.resolve(), args.port, Path(state) / "models", upstream.url + "/v1")
        try:
            rows: list[dict[str, object]] = [{"request": "started", "rss_mb": gw.rss_mb()}]
            long_prompt = [{"role": "user", "content": "lorem ipsum " * 20_000}]
            rows.append(gw.post("max_tokens refused", long_prompt, max_tokens=1_400))
            ordinary = [*history(40), {"role": "user", "content": "What is the vault code?"}]
            rows.append(gw.post("ordinary over-window", ordinary))
            gw.wait_for_model()
            rows.append(gw.post("ordinary over-window, model loaded", ordinary))
            # A user turn before the short tail: no wire merges it into the last long message.
            hostile = [*pathological(), {"role": "user", "content": "Fine."}, *TAIL]
            rows.append(gw.post("300 never-seen 300-word messages", hostile))
        finally:
            gw.stop()
            upstream.stop()
    print(json.dumps({"tree": str(args.tree), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

"""mTLS handshakes with and without hot rotation: docs/benchmarks.md, "TLS handshakes"."""

from __future__ import annotations

import argparse
import json
import socket
import ssl
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashstack.gateway.config import TLSConfig  # noqa: E402
from flashstack.gateway.tls import CertBundle, ServerTLS  # noqa: E402
from tests.fakes.server import FakeServer  # noqa: E402
from tests.gateway.tls.certs import client_context, issue, make_ca  # noqa: E402


async def ok_app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
    )
    await send({"type": "http.response.body", "body": b"ok"})


def one_connection(port: int, ctx: ssl.SSLContext) -> float:
    start = time.perf_counter()
    with (
        socket.create_connection(("127.0.0.1", port)) as raw,
        ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s,
    ):
        s.sendall(b"GET / HTTP/1.1\r\nhost: bench\r\nconnection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    assert data.startswith(b"HTTP/1.1 200"), data[:64]
    return time.perf_counter() - start


def measure(port: int, ctx: ssl.SSLContext, connections: int, threads: int) -> dict[str, float]:
    latencies: list[float] = []
    lock = threading.Lock()

    def worker(n: int) -> None:
        mine = [one_connection(port, ctx) for _ in range(n)]
        with lock:
            latencies.extend(mine)

    for _ in range(20):  # warm-up
        one_connection(port, ctx)
    start = time.perf_counter()
    pool = [threading.Thread(target=worker, args=(connections // threads,)) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    elapsed = time.perf_counter() - start
    latencies.sort()
    return {
        "connections_per_s": round(len(latencies) / elapsed, 1),
        "p50_ms": round(statistics.median(latencies) * 1000, 2),
        "p99_ms": round(latencies[int(len(latencies) * 0.99) - 1] * 1000, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--connections", type=int, default=400)
    ap.add_argument("--threads", type=int, default=4)
    args = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="tls-bench-"))
    ca = make_ca("bench CA").write(d, "ca")
    server = issue(ca, "gateway.test", ips=("127.0.0.1",)).write(d, "server")
    client = issue(ca, "client.test", client=True).write(d, "client")
    ctx = client_context(ca.cert_file, client)
    cfg = TLSConfig(
        cert_file=server.cert_file, key_file=server.key_file, client_ca_file=ca.cert_file
    )
    base = {"loop": "uvloop", "http": "httptools"}
    results: dict[str, object] = {"connections": args.connections, "threads": args.threads}

    plain = FakeServer(
        ok_app,
        ssl_certfile=str(server.cert_file),
        ssl_keyfile=str(server.key_file),
        ssl_ca_certs=str(ca.cert_file),
        ssl_cert_reqs=ssl.CERT_REQUIRED,
        **base,
    ).start()
    results["uvicorn"] = measure(plain.port, ctx, args.connections, args.threads)
    plain.stop()

    for name, rotate in (("servertls", False), ("servertls_rotating", True)):
        tls = ServerTLS.from_config(cfg)
        assert tls is not None
        srv = FakeServer(ok_app, **(base | tls.uvicorn_options("httptools"))).start()
        stop = threading.Event()
        if rotate:
            fresh = [issue(ca, "gateway.test", ips=("127.0.0.1",)) for _ in range(4)]
            bundles = [CertBundle.from_pem(c.cert_pem, c.key_pem, "bench") for c in fresh]
            threading.Thread(
                target=lambda: [
                    tls.install(bundles[i % 4]) for i in range(10**6) if not stop.wait(0.1)
                ],
                daemon=True,
            ).start()
        results[name] = measure(srv.port, ctx, args.connections, args.threads)
        results[name]["rotations"] = tls.rotations  # type: ignore[index]
        stop.set()
        srv.stop()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

"""CPU per request of the wire edges, two trees: docs/benchmarks.md, "Wire edges"."""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROUNDS, PER_ROUND = 7, 400


def _openai_request() -> dict:
    return {
        "model": "gpt",
        "temperature": 0.2,
        "max_tokens": 256,
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Italy? Answer in one word."},
        ],
    }


def _anthropic_request() -> dict:
    # Shaped like a coding agent's turn: cached system blocks, tools, tool use and results.
    tool = {
        "name": "read_file",
        "description": "Read a file",
        "input_schema": {
            "type": "object",
            "properties": {"path": {"type": "string"}},
            "required": ["path"],
        },
    }
    return {
        "model": "claude",
        "max_tokens": 1024,
        "system": [
            {
                "type": "text",
                "text": "You are a coding agent. " * 20,
                "cache_control": {"type": "ephemeral"},
            }
        ],
        "tools": [dict(tool, name=f"tool_{i}") for i in range(8)],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Fix the bug in main.py"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Reading it."},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "tool_0",
                        "input": {"path": "main.py"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": "print('hi')\n" * 30,
                        "cache_control": {"type": "ephemeral"},
                    }
                ],
            },
        ],
    }


def workload() -> dict:
    """Run in the tree under test (PYTHONPATH): µs per request for each path."""
    import orjson

    sys.path.insert(0, str(ROOT / "bench" / "gateway"))
    import mock_upstream as mock

    from flashstack.gateway.translate import anthropic as at
    from flashstack.gateway.translate import openai as ot
    from flashstack.gateway.wire import anthropic as aw
    from flashstack.gateway.wire import openai as ow

    takes_body = len(inspect.signature(ot.to_canonical).parameters) > 1

    def canonical(wire_mod, model, body):
        parsed = model.model_validate(body)
        return wire_mod.to_canonical(parsed, body) if takes_body else wire_mod.to_canonical(parsed)

    def keep(fn, body, same):
        return fn(body, same) if takes_body else fn(body)

    def tap(mod, cls, same):
        if not takes_body:
            return getattr(mod, cls)()
        from flashstack.gateway.translate.raw import RawTap

        return getattr(mod, cls)(RawTap(mod.WIRE) if same else None)

    o_body, a_body = mock.openai_body(20), mock.anthropic_body(20)
    o_events = [e for part in mock.openai_events(20) for e in part][:-1]  # without [DONE]
    a_events = [e for part in mock.anthropic_events(20) for e in part]

    def o_chunks():
        return [orjson.loads(e[len(b"data: ") :]) for e in o_events]

    def a_frames():
        out = []
        for e in a_events:
            head, data = e.split(b"\ndata: ", 1)
            out.append((head[len(b"event: ") :].decode(), orjson.loads(data)))
        return out

    def openai_json():
        body = orjson.loads(orjson.dumps(_openai_request()))
        req = canonical(ot, ow.ChatCompletionRequest, body)
        orjson.dumps(ot.request_json(req, "gpt-4o-mini"))
        orjson.dumps(
            ot.response_json(keep(ot.response_from_json, orjson.loads(o_body), True), "gpt")
        )

    def openai_stream():
        body = orjson.loads(orjson.dumps({**_openai_request(), "stream": True}))
        req = canonical(ot, ow.ChatCompletionRequest, body)
        orjson.dumps(ot.request_json(req, "gpt-4o-mini"))
        dec, enc = tap(ot, "ChunkDecoder", True), ot.StreamEncoder("gpt", False)
        for chunk in o_chunks():
            for ev in dec.feed(chunk):
                b"".join(enc.encode(ev))
        for ev in dec.finish():
            b"".join(enc.encode(ev))

    def anthropic_json():
        body = orjson.loads(orjson.dumps(_anthropic_request()))
        req = canonical(at, aw.MessagesRequest, body)
        orjson.dumps(at.request_json(req, "claude-sonnet-4-5"))
        orjson.dumps(
            at.response_json(keep(at.response_from_json, orjson.loads(a_body), True), "claude")
        )

    def anthropic_stream():
        body = orjson.loads(orjson.dumps({**_anthropic_request(), "stream": True}))
        req = canonical(at, aw.MessagesRequest, body)
        orjson.dumps(at.request_json(req, "claude-sonnet-4-5"))
        dec, enc = tap(at, "EventDecoder", True), at.StreamEncoder("claude")
        for name, data in a_frames():
            for ev in dec.feed(name, data):
                b"".join(enc.encode(ev))

    def anthropic_to_openai_json():
        body = orjson.loads(orjson.dumps(_anthropic_request()))
        req = canonical(at, aw.MessagesRequest, body)
        orjson.dumps(ot.request_json(req, "gpt-4o-mini"))
        orjson.dumps(
            at.response_json(keep(ot.response_from_json, orjson.loads(o_body), False), "claude")
        )

    out = {}
    for name, fn in [
        ("openai_json", openai_json),
        ("openai_stream", openai_stream),
        ("anthropic_json", anthropic_json),
        ("anthropic_stream", anthropic_stream),
        ("anthropic_to_openai_json", anthropic_to_openai_json),
    ]:
        for _ in range(50):
            fn()
        rounds = []
        for _ in range(ROUNDS):
            t0 = time.process_time()
            for _ in range(PER_ROUND):
                fn()
            rounds.append((time.process_time() - t0) / PER_ROUND * 1e6)
        out[name] = round(sorted(rounds)[ROUNDS // 2], 1)
    return out


def _tree(rev: str, into: Path) -> Path:
    """`rev`'s flashstack package, unpacked under `into` (no checkout, no git state touched)."""
    archive = into / "tree.tar"
    subprocess.run(
        ["git", "-C", str(ROOT), "archive", "-o", str(archive), rev, "flashstack"], check=True
    )
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into


def _run_in(path: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(path)}
    out = subprocess.run(
        [sys.executable, __file__, "--workload"],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", default="HEAD", help="git rev of the baseline tree")
    p.add_argument("--workload", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.workload:
        print(json.dumps(workload()))
        return
    with tempfile.TemporaryDirectory() as tmp:
        base = _run_in(_tree(args.baseline, Path(tmp)))
        current = _run_in(ROOT)
    result = {
        "unit": "us per request (process CPU, median of 7 rounds)",
        "baseline": args.baseline,
        "paths": {
            k: {"baseline": base[k], "current": current[k], "added": round(current[k] - base[k], 1)}
            for k in base
        },
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

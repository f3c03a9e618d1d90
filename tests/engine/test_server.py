"""The engine server speaks OpenAI: the official SDK works, stream and not; bad input gets 4xx."""

from __future__ import annotations

import gzip
import socket
import threading
import time

import httpx
import openai
import orjson
import pytest
import uvicorn

from flashstack.engine import AsyncLLM
from flashstack.engine.lifecycle import ServeOptions
from flashstack.engine.server import build_app


@pytest.fixture(scope="module")
def base_url(tiny_model_dir):
    engine = AsyncLLM(tiny_model_dir, block_size=16, device="cpu", show_progress=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(build_app(engine), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}/v1"
    _ENGINES[url] = engine
    yield url
    server.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)


def test_models(client) -> None:
    ids = [m.id for m in client.models.list().data]
    assert ids == ["tiny-random"]


def test_chat_non_stream(client) -> None:
    r = client.chat.completions.create(
        model="tiny-random",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=7,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 7 and r.usage.prompt_tokens > 3
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7


def test_chat_stream_matches_non_stream(client) -> None:
    kw = dict(
        model="tiny-random",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=9,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9


def test_completions_non_stream_and_stream(client) -> None:
    r = client.completions.create(
        model="tiny-random",
        prompt="def f(",
        max_tokens=5,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert r.object == "text_completion" and r.usage.completion_tokens == 5
    assert len(r.choices[0].logprobs.tokens) == 5
    stream = client.completions.create(
        model="tiny-random",
        prompt="def f(",
        max_tokens=5,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].text for c in stream) == r.choices[0].text


def test_completions_batch_of_prompts(client) -> None:
    r = client.completions.create(
        model="tiny-random", prompt=["a", "b c"], max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 6


def test_stop_string_over_the_wire(client) -> None:
    base = (
        client.completions.create(
            model="tiny-random",
            prompt="import os",
            max_tokens=20,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    stop = base[8:10]
    if stop in base[:8]:
        pytest.skip("random text repeats the stop string early")
    r = client.completions.create(
        model="tiny-random",
        prompt="import os",
        max_tokens=20,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].text == base[:8] and r.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="tiny-random",
            prompt="import os",
            max_tokens=20,
            temperature=0,
            stop=[stop],
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert streamed == base[:8]


def test_errors_are_openai_shaped(client, base_url) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model="tiny-random", messages=[{"role": "user", "content": "x"}], temperature=7
        )
    assert bad.value.body["param"] == "temperature" and "2" in bad.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny-random", prompt="x " * 5000)
    r = httpx.post(
        f"{base_url}/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "Invalid JSON" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_client_disconnect_frees_blocks(base_url, client, monkeypatch) -> None:
    body = {
        "model": "tiny-random",
        "prompt": "def main():",
        "max_tokens": 4000,
        "stream": True,
        "ignore_eos": True,
    }
    engine = _served_engine(base_url)
    aborted: list[bool] = []
    abort_request = engine.engine.abort_request
    monkeypatch.setattr(
        engine.engine, "abort_request", lambda rid: aborted.append(abort_request(rid))
    )
    with httpx.stream("POST", f"{base_url}/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i >= 6:
                break  # leave mid-stream: the server must abort the request
    # The engine is shared by the app; poll until idle.
    deadline = time.monotonic() + 10
    while engine.engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "aborted request still holds the engine"
        time.sleep(0.05)
    assert engine.engine.block_manager.num_used_blocks == 0
    assert aborted == [True], "the request was aborted while live, not left to run to its end"


def test_client_that_leaves_before_the_answer_is_aborted(base_url, monkeypatch) -> None:
    engine = _served_engine(base_url)
    aborted: list[bool] = []
    abort_request = engine.engine.abort_request
    monkeypatch.setattr(
        engine.engine, "abort_request", lambda rid: aborted.append(abort_request(rid))
    )
    body = {"model": "tiny-random", "prompt": "def main():", "max_tokens": 4000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # a non-streamed answer: nothing comes until the end
        httpx.post(f"{base_url}/completions", json=body, timeout=0.5)
    deadline = time.monotonic() + 10
    while not aborted or engine.engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the request outlived its client"
        time.sleep(0.05)
    assert aborted == [True] and engine.engine.block_manager.num_used_blocks == 0


_ENGINES: dict[str, AsyncLLM] = {}


def _served_engine(base_url: str) -> AsyncLLM:
    return _ENGINES[base_url]


def test_completion_events_match_the_generic_encoder() -> None:
    from flashstack.engine.server import _TextEvents
    from flashstack.gateway.wire.openai import sse_event

    chunk = {"id": "cmpl-1", "created": 1, "model": 'q"uoted', "object": "text_completion"}
    for text, finish in (('héllo\n"', None), ("", "length"), ("\u2028x", "stop")):
        choice = {"index": 2, "text": text, "finish_reason": finish, "logprobs": None}
        assert _TextEvents(chunk).event(2, text, finish) == sse_event(
            {**chunk, "choices": [choice]}
        )


def test_generation_routes_answer_other_methods_as_before(base_url) -> None:
    assert httpx.get(f"{base_url}/completions").status_code == 405
    assert httpx.get(f"{base_url}/chat/completions").status_code == 405
    paths = httpx.get(base_url.removesuffix("/v1") + "/openapi.json").json()["paths"]
    assert {"/v1/completions", "/v1/chat/completions"} <= set(paths)


def test_a_gzip_body_is_decoded(base_url) -> None:
    body = orjson.dumps({"model": "tiny-random", "prompt": "def main():", "max_tokens": 4})
    r = httpx.post(
        f"{base_url}/completions",
        content=gzip.compress(body),
        headers={"content-type": "application/json", "content-encoding": "gzip"},
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_a_body_over_the_limit_is_413_unread(tiny_model_dir) -> None:
    from starlette.testclient import TestClient

    engine = AsyncLLM(tiny_model_dir, block_size=16, device="cpu", show_progress=False)
    app = build_app(engine, options=ServeOptions(max_body_bytes=1024))
    with TestClient(app) as http:
        big = {"model": "tiny-random", "prompt": "x " * 1000, "max_tokens": 4}
        r = http.post("/v1/completions", json=big)
        assert r.status_code == 413, r.text
        assert "--max-body-bytes" in r.json()["error"]["message"]
        bomb = gzip.compress(orjson.dumps({**big, "prompt": "x" * 100_000}))
        r = http.post("/v1/completions", content=bomb, headers={"content-encoding": "gzip"})
        assert r.status_code == 413 and len(bomb) < 1024  # refused by what it decodes to
        r = http.post("/v1/completions", content=b"{}", headers={"content-encoding": "br"})
        assert r.status_code == 415 and r.json()["error"]["param"] == "content-encoding"
        # The routes FastAPI serves have the same cap; under it they read their body as before.
        assert http.post("/tokenize", json={"prompt": "x " * 1000}).status_code == 413
        assert http.post("/tokenize", json={"prompt": "x x"}).json()["count"] > 0
    assert not engine.engine.has_unfinished_requests()  # nothing reached the engine

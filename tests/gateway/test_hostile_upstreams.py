"""Upstreams that attack the gateway (tests/fakes/hostile_upstream.py), over
loopback, on both wires.

Each attack asserts what the client gets (status, its wire's error format), that no credential or
upstream address reaches it or the log, that memory stayed bounded where the upstream floods, and
that a normal request on the same deployment succeeds right after.
"""

from __future__ import annotations

import base64
import logging
import time

import anthropic
import httpx
import openai
import psutil
import pytest

from flashstack.gateway.app import create_app
from flashstack.gateway.config import Config, ModelConfig, RouterConfig, UpstreamLimits
from flashstack.gateway.providers.http import LineSplitter, LineTooLong
from tests.fakes import hostile_upstream
from tests.fakes.server import FakeServer

OAI_KEY = "sk-hostile-oai-4c1d9e7a2b"  # shaped like an OpenAI key
ANT_KEY = "upstream-ant-secret-8e3f1a"  # shaped like nothing: found because it is configured
PROXY_USER, PROXY_PASS, QUERY_KEY = "proxyuser", "proxy-pass-9d2e", "query-secret-55b1"
BASIC = base64.b64encode(f"{PROXY_USER}:{PROXY_PASS}".encode()).decode()
SECRETS = [OAI_KEY, ANT_KEY, PROXY_PASS, QUERY_KEY, BASIC]
LIMITS = UpstreamLimits(max_body_bytes=1 << 20, max_error_bytes=64 << 10, max_line_bytes=256 << 10)
FLOOD = 256 << 20  # what a flooding upstream offers: far past every cap
EXCERPT_MAX = LIMITS.error_excerpt_chars + 512  # an excerpt plus the gateway's own words
# OpenAI-format upstream, Anthropic-format, Ollama (NDJSON streams), OpenAI behind basic
# auth and ?api-key.
MODELS = ["oai", "ant", "oll", "basic"]
UPSTREAM_FORMATS = ["oai", "ant", "oll"]


@pytest.fixture(scope="module")
def hostile():
    plain = FakeServer(hostile_upstream.create_app()).start()
    guarded = FakeServer(
        hostile_upstream.create_app(
            require={"authorization": f"Basic {BASIC}"}, require_query={"api-key": QUERY_KEY}
        )
    ).start()
    yield plain, guarded
    plain.stop()
    guarded.stop()


def _config(hostile, **router) -> Config:
    plain, guarded = hostile
    models = [
        ModelConfig(
            name="oai", provider="openai", model="m", api_base=plain.url + "/v1", api_key=OAI_KEY
        ),
        ModelConfig(
            name="ant", provider="anthropic", model="m", api_base=plain.url, api_key=ANT_KEY
        ),
        ModelConfig(name="oll", provider="ollama", model="m", api_base=plain.url),
        ModelConfig(
            name="basic",
            provider="openai",
            model="m",
            api_base=f"http://{PROXY_USER}:{PROXY_PASS}@{guarded.host}:{guarded.port}/v1?api-key={QUERY_KEY}",
        ),
    ]
    routing = dict(
        num_retries=0,
        retry_backoff=0,
        health_check_interval=0,
        breaker_failures=10**6,
        breaker_min_requests=10**6,
        upstream_limits=LIMITS,
    )
    return Config(
        models=models, router=RouterConfig(**{**routing, **router}), compression={"mode": "off"}
    )


@pytest.fixture(scope="module")
def gw(hostile):
    with FakeServer(create_app(_config(hostile)), lifespan="on", loop="uvloop") as server:
        yield server


@pytest.fixture(autouse=True)
def no_secret_in_logs(caplog):
    caplog.set_level(logging.INFO)
    yield
    for secret in SECRETS:  # the operator's log may name upstream addresses, never credentials
        assert secret not in caplog.text, f"secret {secret!r} reached the log"


def _assert_clean(text: str, hostile) -> None:
    """No credential and no upstream address (even one the upstream quoted itself) in what
    a client got."""
    for secret in SECRETS:
        assert secret not in text, f"secret {secret!r} leaked"
    for server in hostile:
        assert f":{server.port}" not in text, "an upstream address leaked"


def _openai(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="client-key", max_retries=0, timeout=30)


def _anthropic(gw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key="client-key", max_retries=0, timeout=30)


def _ask(gw, wire: str, model: str, text: str, stream: bool) -> str:
    """The reply's text, through the wire's own SDK."""
    messages = [{"role": "user", "content": text}]
    if wire == "openai":
        r = _openai(gw).chat.completions.create(model=model, messages=messages, stream=stream)
        return (
            "".join(c.choices[0].delta.content or "" for c in r if c.choices)
            if stream
            else r.choices[0].message.content
        )
    client = _anthropic(gw)
    if stream:
        with client.messages.stream(model=model, max_tokens=50, messages=messages) as s:
            return s.get_final_text()
    return client.messages.create(model=model, max_tokens=50, messages=messages).content[0].text


def _refused(gw, wire: str, model: str, text: str, stream: bool, hostile):
    """The SDK's error for an attack refused before the first byte, checked for its
    wire's format."""
    error = openai.APIStatusError if wire == "openai" else anthropic.APIStatusError
    with pytest.raises(error) as exc:
        _ask(gw, wire, model, text, stream)
    e = exc.value
    body = e.response.json()
    if wire == "openai":
        assert set(body["error"]) >= {"message", "type"}, body
        message = body["error"]["message"]
    else:
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        message = body["error"]["message"]
    assert len(message) <= EXCERPT_MAX, len(message)
    _assert_clean(e.response.text + str(dict(e.response.headers)), hostile)
    return e, message


def _still_works(gw, wire: str, model: str, stream: bool) -> None:
    assert _ask(gw, wire, model, "ok", stream) == "echo: ok"


WIRES = ["openai", "anthropic"]
matrix = pytest.mark.parametrize(
    "wire,model,stream", [(w, m, s) for w in WIRES for m in MODELS for s in (False, True)]
)
# Attacks on what the upstream sends back: "basic" is the same OpenAI-format upstream as "oai".
formats = pytest.mark.parametrize(
    "wire,model,stream", [(w, m, s) for w in WIRES for m in UPSTREAM_FORMATS for s in (False, True)]
)


@matrix
def test_normal_requests_work_on_every_upstream_including_basic_auth_and_query_keys(
    gw, wire, model, stream
):
    _still_works(gw, wire, model, stream)


@matrix
@pytest.mark.parametrize("status", [401, 403])
def test_echoed_credentials_on_refusal_become_a_502_without_them(
    gw, hostile, wire, model, stream, status
):
    e, message = _refused(gw, wire, model, f"[[hostile:echo_{status}]]", stream, hostile)
    assert e.status_code == 502, "the client's own key was fine: never its 401/403"
    assert "upstream credentials rejected" in message and f"{model}#0" in message
    # an attempt failed on the upstream
    assert e.response.headers["x-flashstack-route"] == f"{model}#0=502"
    _still_works(gw, wire, model, stream)


@matrix
@pytest.mark.parametrize("status", [400, 500])
def test_echoed_credentials_in_other_errors_are_redacted_and_cut(
    gw, hostile, wire, model, stream, status
):
    e, message = _refused(gw, wire, model, f"[[hostile:echo_{status}]]", stream, hostile)
    assert e.status_code == status
    assert f"upstream {model}#0 said: failed for " in message and "***" in message
    assert "more characters" in message, "a 40 KB upstream message reaches the client as an excerpt"
    _still_works(gw, wire, model, stream)


def _rss() -> int:
    return psutil.Process().memory_info().rss


# (directive, streamed?, what the client sees): floods refused while the gateway reads them.
FLOODS = [
    ("big_body", False, 502),
    ("big_declared", False, 502),
    ("big_error", False, 500),
    ("big_error", True, 500),
    ("giant_line", True, 502),
    ("giant_event", True, 502),
]


@pytest.mark.parametrize("wire", WIRES)
# NDJSON (oll) has no events: its flood is giant_line
@pytest.mark.parametrize(
    "model,mode,stream,status",
    [
        (m, *flood)
        for m in UPSTREAM_FORMATS
        for flood in FLOODS
        if not (m == "oll" and flood[0] == "giant_event")
    ],
)
def test_floods_are_cut_off_while_reading_with_bounded_memory(
    gw, hostile, wire, model, mode, stream, status
):
    before = _rss()
    e, message = _refused(gw, wire, model, f"[[hostile:{mode}:{FLOOD}]]", stream, hostile)
    grew = _rss() - before
    assert e.status_code == status
    if status == 502:
        assert f"upstream {model}#0 sent" in message and "router.upstream_limits.max_" in message
    sent = hostile[0].app.state.sent[mode]
    assert sent < FLOOD // 8, f"the gateway kept reading: the upstream sent {sent} bytes"
    assert grew < 48 << 20, f"RSS grew by {grew >> 20} MiB for a {FLOOD >> 20} MiB flood"
    _still_works(gw, wire, model, stream)


@formats
@pytest.mark.parametrize("mode", ["empty_json", "wrong_shape"])
def test_wrong_shapes_are_a_502_naming_the_deployment_never_an_empty_success(
    gw, hostile, wire, model, stream, mode
):
    e, message = _refused(gw, wire, model, f"[[hostile:{mode}]]", stream, hostile)
    assert (
        e.status_code == 502
        and f"upstream {model}#0 sent" in message
        and "unexpected shape" in message
    )
    _still_works(gw, wire, model, stream)


def _stream_raw(gw, wire: str, model: str, text: str) -> httpx.Response:
    """A streamed request as bytes: the whole SSE body, error event included."""
    path, body = (
        ("/v1/chat/completions", {"model": model, "stream": True})
        if wire == "openai"
        else ("/v1/messages", {"model": model, "stream": True, "max_tokens": 50})
    )
    body["messages"] = [{"role": "user", "content": text}]
    return httpx.post(gw.url + path, json=body, timeout=30)


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("model", UPSTREAM_FORMATS)
@pytest.mark.parametrize("mode", ["late_echo", f"late_giant_line:{FLOOD}"])
def test_failures_after_the_first_token_are_error_events_without_secrets(
    gw, hostile, wire, model, mode
):
    r = _stream_raw(gw, wire, model, f"[[hostile:{mode}]]")
    assert r.status_code == 200 and "first" in r.text, (
        "the token before the failure reached the client"
    )
    _assert_clean(r.text, hostile)
    errors = [line for line in r.text.splitlines() if '"error"' in line]
    assert errors and all(len(line) <= EXCERPT_MAX + 200 for line in errors), r.text[-2000:]
    if wire == "anthropic":
        assert "event: error" in r.text
    if mode.startswith("late_giant"):
        assert hostile[0].app.state.sent["late_giant_line"] < FLOOD // 8
        assert "max_line_bytes" in errors[0]
    else:
        assert ("upstream credentials rejected" in errors[0]) == (model == "ant"), errors[0]
    # The SDKs see a failed stream, not a complete answer.
    error = openai.APIError if wire == "openai" else anthropic.APIError
    with pytest.raises(error):
        _ask(gw, wire, model, f"[[hostile:{mode}]]", True)
    _still_works(gw, wire, model, True)


@pytest.mark.parametrize("mode", ["echo_401", "wrong_shape", "empty_json", f"big_body:{FLOOD}"])
@pytest.mark.parametrize("stream", [False, True])
def test_upstream_faults_count_against_it_in_the_breaker(hostile, mode, stream):
    if mode.startswith("big_body") and stream:
        mode = f"giant_line:{FLOOD}"
    cfg = _config(hostile, breaker_failures=1, breaker_cooldown=60)
    with FakeServer(create_app(cfg), lifespan="on", loop="uvloop") as gw:
        _refused(gw, "openai", "oai", f"[[hostile:{mode}]]", stream, hostile)
        ready = httpx.get(gw.url + "/health/readiness", timeout=10).json()
        assert ready["models"]["oai"][0]["breaker"] == "open"
        assert ready["models"]["ant"][0]["breaker"] == "closed"


def test_readiness_names_no_address_and_no_credential(gw, hostile):
    r = httpx.get(gw.url + "/health/readiness", timeout=10)
    assert r.status_code == 200, r.text  # the basic-auth deployment's probe passes too
    _assert_clean(r.text, hostile)
    assert "127.0.0.1" not in r.text
    assert {d["deployment"] for deps in r.json()["models"].values() for d in deps} == {
        f"{m}#0" for m in MODELS
    }


def test_line_splitter_is_linear_in_a_long_line_fed_in_small_pieces():
    """32 MiB in 4 KiB reads: joined once at the end (the old splitter copied the line
    at every read)."""
    splitter = LineSplitter()
    piece = b"a" * 4096
    t0 = time.process_time()
    for _ in range(8192):
        assert splitter.feed(piece) == []
    assert splitter.feed(b"\r\nnext\n") == [piece * 8192, b"next"]
    assert time.process_time() - t0 < 2.0


def test_line_splitter_raises_as_soon_as_a_line_passes_its_cap():
    splitter = LineSplitter(max_line=10_000)
    fed = 0
    with pytest.raises(LineTooLong):
        while True:
            splitter.feed(b"b" * 1000)
            fed += 1000
    assert fed == 10_000, "stopped at the first read past the cap"
    with pytest.raises(LineTooLong):
        LineSplitter(max_line=10).feed(b"ok\n" + b"c" * 11 + b"\nrest")

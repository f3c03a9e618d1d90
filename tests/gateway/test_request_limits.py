"""Hostile request bodies (issue 24): refused cheaply, in the caller's format, and the
gateway keeps serving.

Over loopback against a real gateway: JSON nested past server.max_json_depth, max_tokens no window
can hold, unknown routes. Each asserts status, the error's wire format, bounded time and memory, and
that a normal request succeeds right after.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import orjson
import pytest

from flashstack.gateway.app import create_app
from flashstack.gateway.config import CompressionConfig, ModelConfig
from flashstack.gateway.sessions.turns import _failure
from tests.fakes.server import FakeServer
from tests.gateway.conftest import API_KEY, gateway_config

MODELS_DIR = Path(__file__).resolve().parents[2] / ".flashstack" / "models"
WINDOW = 1_500
DEPTH = 64  # server.max_json_depth's default
OK_OPENAI = {"model": "gpt", "messages": [{"role": "user", "content": "hi"}]}
OK_ANTHROPIC = {
    "model": "claude",
    "max_tokens": 10,
    "messages": [{"role": "user", "content": "hi"}],
}


@pytest.fixture(scope="module")
def limits_gateway(upstreams):
    """The shared test models plus `tiny` (a 1,500-token window); compression on, its model
    not preloaded."""
    config = gateway_config(upstreams, max_body_bytes=4 * 1024 * 1024)
    config.models.append(
        ModelConfig(
            name="tiny",
            provider="openai",
            model="gpt-4-0613",
            context_window=WINDOW,
            api_base=upstreams["openai"].url + "/v1",
            api_key=API_KEY,
        )
    )
    config.models.append(
        ModelConfig(
            name="tiny-claude",
            provider="anthropic",
            model="claude-sonnet-4-5",
            context_window=WINDOW,
            api_base=upstreams["anthropic"].url,
            api_key=API_KEY,
        )
    )
    config.compression = CompressionConfig(cache_dir=MODELS_DIR)
    server = FakeServer(create_app(config), lifespan="on", loop="uvloop").start()
    yield server
    server.stop()


@pytest.fixture
def gw(limits_gateway):
    with httpx.Client(base_url=limits_gateway.url, timeout=20) as c:
        yield c
        # Right after each attack, on both wires: served as usual.
        assert (
            c.post("/v1/chat/completions", json=OK_OPENAI).json()["choices"][0]["message"][
                "content"
            ]
            == "echo: hi"
        )
        assert c.post("/v1/messages", json=OK_ANTHROPIC).json()["content"][0]["text"] == "echo: hi"


def rss_mb() -> float:
    """This process's resident memory (the gateway runs in one of its threads)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20


def nested(levels: int) -> str:
    """JSON text of `levels` objects, one inside the other."""
    return '{"a":' * (levels - 1) + "{}" + "}" * (levels - 1)


def with_deep(body: dict, levels: int) -> bytes:
    """`body` as JSON with its "__DEEP__" string replaced by `levels` nested objects (no
    recursive encoder)."""
    return orjson.dumps(body).replace(b'"__DEEP__"', nested(levels).encode())


def _tool_arguments(levels: int) -> dict:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "f", "arguments": nested(levels)},
    }
    return {
        "model": "claude",
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
            {"role": "user", "content": "and now?"},
        ],
    }


OPENAI_DEEP = {
    "tools.parameters": (
        {
            **OK_OPENAI,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": "__DEEP__"}}],
        },
        "tools.0.function.parameters",
    ),
    "response_format.schema": (
        {
            **OK_OPENAI,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": "__DEEP__"},
            },
        },
        "response_format.json_schema.schema",
    ),
    "unknown-field": ({**OK_OPENAI, "x_extra": "__DEEP__"}, "x_extra"),
    "metadata": ({**OK_OPENAI, "metadata": {"k": "__DEEP__"}}, "metadata.k"),
}
ANTHROPIC_DEEP = {
    "tool_use.input": (
        {
            **OK_ANTHROPIC,
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": "__DEEP__"}],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}],
                },
            ],
        },
        "messages.1.content.0.input",
    ),
    "tools.input_schema": (
        {**OK_ANTHROPIC, "tools": [{"name": "f", "input_schema": "__DEEP__"}]},
        "tools.0.input_schema",
    ),
}


@pytest.mark.parametrize("levels", [260, 1_000])
@pytest.mark.parametrize("case", list(OPENAI_DEEP))
def test_deep_json_is_a_400_naming_the_field_openai(gw, case, levels):
    body, field = OPENAI_DEEP[case]
    before, start = rss_mb(), time.monotonic()
    r = gw.post(
        "/v1/chat/completions",
        content=with_deep(body, levels),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (
        set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    )
    assert (
        err["param"].startswith(field)
        and field in err["message"]
        and "max_json_depth" in err["message"]
    )
    assert time.monotonic() - start < 2 and rss_mb() - before < 50


@pytest.mark.parametrize("levels", [260, 1_000])
@pytest.mark.parametrize("case", list(ANTHROPIC_DEEP))
def test_deep_json_is_a_400_naming_the_field_anthropic(gw, case, levels):
    body, field = ANTHROPIC_DEEP[case]
    before, start = rss_mb(), time.monotonic()
    r = gw.post(
        "/v1/messages",
        content=with_deep(body, levels),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400, r.text
    out = r.json()
    assert out["type"] == "error" and set(out["error"]) == {"type", "message"}
    assert out["error"]["type"] == "invalid_request_error" and field in out["error"]["message"]
    assert time.monotonic() - start < 2 and rss_mb() - before < 50


@pytest.mark.parametrize("model", ["claude", "gpt"])  # translated (parsed) and passed through alike
def test_deep_tool_call_arguments_are_a_400(gw, model):
    body = {**_tool_arguments(300), "model": model}
    r = gw.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith("messages.1.tool_calls.call_1.arguments")


def test_nesting_within_the_limit_is_served(gw):
    # A JSON Schema as deep as the limit allows: properties → name → schema is two levels per step.
    schema: dict = {"type": "string"}
    for _ in range((DEPTH - 6) // 2):
        schema = {"type": "object", "properties": {"a": schema}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    r = gw.post("/v1/chat/completions", json={**OK_OPENAI, "tools": tools})
    assert r.status_code == 200, r.text
    r = gw.post(
        "/v1/messages", json={**OK_ANTHROPIC, "tools": [{"name": "f", "input_schema": schema}]}
    )
    assert r.status_code == 200, r.text
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    r = gw.post("/v1/chat/completions", json={**OK_OPENAI, "response_format": rf})
    # "echo: hi"
    assert r.status_code == 422 and r.json()["error"]["code"] == "response_format_violation"


# ---- max_tokens: refused on its own, before anything costly --------------------------------------


@pytest.mark.parametrize(
    "path,model", [("/v1/chat/completions", "tiny"), ("/v1/messages", "tiny-claude")]
)
def test_max_tokens_past_the_window_is_refused_first(gw, limits_gateway, path, model):
    # far over the window: compression would have to run
    words = "lorem ipsum dolor sit amet " * 2_000
    body = {"model": model, "max_tokens": 1_400, "messages": [{"role": "user", "content": words}]}
    for max_tokens, param in ((1_400, "messages"), (WINDOW, "max_tokens"), (10**6, "max_tokens")):
        start = time.monotonic()
        r = gw.post(path, json={**body, "max_tokens": max_tokens})
        assert r.status_code == 400, r.text
        assert "max_tokens" in r.text and time.monotonic() - start < 1.0
        if path.endswith("completions"):
            err = r.json()["error"]
            assert err["code"] == "context_length_exceeded" and err["param"] == param
        else:
            assert r.json()["error"]["type"] == "invalid_request_error"
    # The embedding model was never asked for: refusing max_tokens costs no load, no export, no RSS.
    assert limits_gateway.app.services.compressor.state == "idle"


# ---- routes and errors that must not say more than they should -----------------------------------


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_unknown_route_is_404_not_model_not_found(gw, method):
    r = gw.request(method, "/v1/chat/completion", json=OK_OPENAI)
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "not_found" and "is not a route" in err["message"]
    r = gw.request(
        method, "/v1/messagez", json=OK_ANTHROPIC, headers={"anthropic-version": "2023-06-01"}
    )
    assert r.status_code == 404
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "not_found_error"
    # An unknown model still is one.
    r = gw.post("/v1/chat/completions", json={**OK_OPENAI, "model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("model", ["gpt", "claude"])
def test_an_upstream_404_is_the_upstreams_failure_not_model_not_found(gw, model):
    r = gw.post(
        "/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "[[status:404]]"}]},
    )
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_not_found"
    r = gw.post(
        "/v1/messages",
        json={
            **OK_ANTHROPIC,
            "model": model,
            "messages": [{"role": "user", "content": "[[status:404]]"}],
        },
    )
    assert r.status_code == 502 and r.json()["error"]["type"] == "api_error"


def test_stored_turn_errors_carry_no_internal_detail():
    cancelled = _failure(
        asyncio.CancelledError("Cancelled by cancel scope 7f3a2c10 (task Task-41 at /srv/app.py)")
    )
    assert cancelled.message == "the client went away before the reply was complete"
    internal = _failure(KeyError("/etc/flashstack/secret.yaml"))
    assert "secret" not in internal.message and "KeyError" not in internal.message


def test_a_schema_too_deep_for_jsonschema_is_a_400_even_under_a_raised_limit(upstreams):
    config = gateway_config(upstreams)
    config.server.max_json_depth = 200
    server = FakeServer(create_app(config), lifespan="on", loop="uvloop").start()
    try:
        schema: dict = {"type": "string"}
        # 200 levels: inside the limit, past what jsonschema's recursion can check
        for _ in range(98):
            schema = {"type": "object", "properties": {"a": schema}}
        rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        r = httpx.post(
            server.url + "/v1/chat/completions",
            json={**OK_OPENAI, "response_format": rf},
            timeout=20,
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "response_format.json_schema.schema"
        assert (
            httpx.post(server.url + "/v1/chat/completions", json=OK_OPENAI, timeout=20).status_code
            == 200
        )
    finally:
        server.stop()

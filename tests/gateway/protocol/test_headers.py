"""Headers: an allow-list of the client's goes to upstreams of its wire, the client's credential
never, and the upstream's request ids and rate limits come back."""

from __future__ import annotations

import httpx
import pytest

from tests.gateway.protocol import canned, samples
from tests.gateway.protocol.conftest import CLIENT_KEY, UPSTREAM_KEY

UPSTREAM_HEADERS = {
    "x-request-id": "req-up-1",
    "x-ratelimit-remaining-requests": "41",
    "openai-processing-ms": "12",
    "x-internal-debug": "not for clients",
}


@pytest.fixture
def answered(upstream):
    upstream["openai"].app.state.reply = canned.Reply(
        body=samples.openai_response(), events=samples.openai_events(), headers=UPSTREAM_HEADERS
    )
    upstream["anthropic"].app.state.reply = canned.Reply(
        body=samples.anthropic_response(), events=samples.anthropic_events()
    )
    return upstream


CLIENT_HEADERS = {
    "authorization": f"Bearer {CLIENT_KEY}",
    "openai-organization": "org-1",
    "openai-project": "proj-1",
    "anthropic-beta": "x-beta",
    "x-other": "private",
}


@pytest.mark.parametrize("stream", [False, True])
def test_openai_headers_both_ways(protocol_gateway, answered, stream):
    body = {"model": "oai", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    r = httpx.post(
        protocol_gateway.url + "/v1/chat/completions", json=body, headers=CLIENT_HEADERS, timeout=20
    )
    assert r.status_code == 200
    sent = answered["openai"].requests[-1].headers
    assert sent["openai-organization"] == "org-1" and sent["openai-project"] == "proj-1"
    assert sent["authorization"] == f"Bearer {UPSTREAM_KEY}"
    assert "x-other" not in sent and CLIENT_KEY not in str(sent)
    assert (
        r.headers["x-ratelimit-remaining-requests"] == "41"
        and r.headers["openai-processing-ms"] == "12"
    )
    assert r.headers["x-upstream-request-id"] == "req-up-1"
    assert r.headers["x-request-id"] != "req-up-1"  # the gateway's own trace id
    assert "x-internal-debug" not in r.headers
    # anthropic-beta means nothing to an OpenAI upstream: not sent, and said so.
    assert "anthropic-beta" not in sent and r.headers["x-flashstack-dropped"] == "anthropic-beta"


def test_anthropic_headers_stay_with_anthropic(protocol_gateway, answered):
    body = {"model": "claude", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    headers = {
        "x-api-key": CLIENT_KEY,
        "anthropic-version": "2023-06-01",
        "anthropic-beta": "x-beta",
        "openai-organization": "org-1",
    }
    r = httpx.post(protocol_gateway.url + "/v1/messages", json=body, headers=headers, timeout=20)
    assert r.status_code == 200
    sent = answered["anthropic"].requests[-1].headers
    assert sent["anthropic-beta"] == "x-beta" and sent["x-api-key"] == UPSTREAM_KEY
    assert (
        "openai-organization" not in sent
        and r.headers["x-flashstack-dropped"] == "openai-organization"
    )


def test_an_upstream_refusal_keeps_its_rate_limit_headers(protocol_gateway, upstream):
    body = {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}
    upstream["anthropic"].app.state.reply = canned.Reply(
        body=body,
        status=429,
        headers={
            "request-id": "req_429",
            "anthropic-ratelimit-requests-remaining": "0",
            "retry-after": "3",
        },
    )
    r = httpx.post(
        protocol_gateway.url + "/v1/messages",
        timeout=20,
        json={"model": "claude", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-api-key": CLIENT_KEY, "anthropic-version": "2023-06-01"},
    )
    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
    assert (
        r.headers["request-id"] == "req_429"
        and r.headers["anthropic-ratelimit-requests-remaining"] == "0"
    )

"""Fault injection: for each upstream failure, what the client sees, who served, and
the upstream logs.

Topology: model `primary` runs on upstream a, with `fallbacks: [backup]`; `backup` runs on upstream
b. Every request carries a unique tag, so the upstream logs show exactly how often each was
attempted.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import anthropic
import openai
import pytest

from flashstack.gateway.config import ModelConfig
from tests.gateway.router.conftest import (
    anthropic_client,
    ask,
    breaker_of,
    deployment,
    gateway,
    new_tag,
    openai_client,
)

NUM_RETRIES = 1  # attempts on `primary` = 2


def primary_backup(ups, **primary):
    return [
        deployment("primary", ups["a"], fallbacks=["backup"], **primary),
        deployment("backup", ups["b"]),
    ]


def assert_served_once_by_backup(ups, tag, headers, text, attempts_on_a):
    assert text.startswith("b:"), text
    assert headers["x-flashstack-deployment"] == "backup#0"
    assert ups["a"].tags().count(tag) == attempts_on_a, ups["a"].log
    assert ups["b"].tags("ok") == [tag], "served exactly once, by b"
    assert headers["x-flashstack-attempts"] == str(attempts_on_a + 1)


@pytest.mark.parametrize("status", [500, 502, 503, 529, 429])
@pytest.mark.parametrize("stream", [False, True])
def test_server_errors_retry_then_fall_back(ups, status, stream):
    ups["a"].fail("status", status=status)
    with gateway(primary_backup(ups), num_retries=NUM_RETRIES) as gw:
        tag = new_tag()
        text, headers = ask(openai_client(gw), "primary", tag, stream)
    assert_served_once_by_backup(ups, tag, headers, text, attempts_on_a=1 + NUM_RETRIES)
    assert headers["x-flashstack-route"].startswith(
        f"primary#0={status} primary#0={status} backup#0=ok"
    )


def test_retry_after_is_waited_for_on_the_same_deployment(ups):
    ups["a"].fail("status", status=429, retry_after="1", times=1)
    with gateway(primary_backup(ups), num_retries=NUM_RETRIES) as gw:
        tag = new_tag()
        text, headers = ask(openai_client(gw), "primary", tag)
    assert text.startswith("a:") and headers["x-flashstack-deployment"] == "primary#0"
    first, second = [s for s in ups["a"].log if s.tag == tag]
    assert (first.mode, second.mode) == ("status", "ok")
    assert second.at - first.at >= 0.95, "the retry waited for retry-after"
    assert ups["b"].log == []


def test_long_retry_after_moves_on_and_sets_the_cooldown(ups):
    ups["a"].fail("status", status=429, retry_after="120")
    with gateway(primary_backup(ups), num_retries=NUM_RETRIES, breaker_failures=1) as gw:
        tag = new_tag()
        t0 = time.monotonic()
        text, headers = ask(openai_client(gw), "primary", tag)
        assert time.monotonic() - t0 < 5, "did not wait 120 s"
        assert_served_once_by_backup(ups, tag, headers, text, attempts_on_a=1)
        a = breaker_of(gw, "primary#0")
        assert a["breaker"] == "open" and a["cooldown_s"] > 100, a


def test_429_without_retry_after_backs_off_and_retries(ups):
    ups["a"].fail("status", status=429, times=1)
    with gateway(primary_backup(ups), num_retries=NUM_RETRIES) as gw:
        tag = new_tag()
        text, headers = ask(openai_client(gw), "primary", tag, stream=True)
    assert text.startswith("a:") and headers["x-flashstack-attempts"] == "2"
    assert ups["a"].tags().count(tag) == 2 and ups["b"].log == []


@pytest.mark.parametrize("stream", [False, True])
def test_timeout_before_headers(ups, stream):
    ups["a"].fail("hang")
    with gateway(primary_backup(ups, timeout=0.5), num_retries=0, ttft_timeout=0.5) as gw:
        tag = new_tag()
        t0 = time.monotonic()
        text, headers = ask(openai_client(gw), "primary", tag, stream)
    assert time.monotonic() - t0 < 4
    assert_served_once_by_backup(ups, tag, headers, text, attempts_on_a=1)


@pytest.mark.parametrize("stream", [False, True])
def test_stall_after_headers(ups, stream):
    ups["a"].fail("stall")
    with gateway(primary_backup(ups, timeout=0.5), num_retries=0, ttft_timeout=0.5) as gw:
        tag = new_tag()
        text, headers = ask(openai_client(gw), "primary", tag, stream)
    assert_served_once_by_backup(ups, tag, headers, text, attempts_on_a=1)
    if stream:
        assert "ttft_timeout" in headers["x-flashstack-route"]


@pytest.mark.parametrize("stream", [False, True])
def test_refused_connection(ups, stream):
    ups["a"].fail("refuse")
    with gateway(primary_backup(ups), num_retries=NUM_RETRIES) as gw:
        tag = new_tag()
        text, headers = ask(openai_client(gw), "primary", tag, stream)
    assert text.startswith("b:") and headers["x-flashstack-deployment"] == "backup#0"
    assert ups["a"].log == [] and ups["b"].tags("ok") == [tag]
    assert headers["x-flashstack-route"].startswith("primary#0=502 primary#0=502 backup#0=ok")


@pytest.mark.parametrize("stream", [False, True])
def test_reset_before_first_byte(ups, stream):
    ups["a"].fail("reset")
    with gateway(primary_backup(ups), num_retries=NUM_RETRIES) as gw:
        tag = new_tag()
        text, headers = ask(openai_client(gw), "primary", tag, stream)
    assert_served_once_by_backup(ups, tag, headers, text, attempts_on_a=2)


@pytest.mark.parametrize("stream", [False, True])
def test_malformed_json(ups, stream):
    ups["a"].fail("malformed")
    with gateway(primary_backup(ups), num_retries=0) as gw:
        tag = new_tag()
        text, headers = ask(openai_client(gw), "primary", tag, stream)
    assert_served_once_by_backup(ups, tag, headers, text, attempts_on_a=1)


@pytest.mark.parametrize("mode", ["reset_midstream", "truncate"])
def test_failure_after_first_byte_is_an_error_event_not_a_retry(ups, mode):
    ups["a"].fail(mode, after=2)
    with gateway(primary_backup(ups), num_retries=NUM_RETRIES) as gw:
        tag = new_tag()
        got = []
        stream = openai_client(gw).chat.completions.create(
            model="primary", stream=True, messages=[{"role": "user", "content": f"go #{tag}"}]
        )
        with pytest.raises(openai.APIError) as exc:
            for chunk in stream:
                got.extend(c.delta.content or "" for c in chunk.choices)
        assert "".join(got) == "a: w0", "the tokens before the failure reach the client"
        assert "upstream" in str(exc.value.message) or "ended the stream early" in str(
            exc.value.message
        )
    assert ups["a"].tags() == [tag] and ups["b"].log == [], "no second attempt once bytes were sent"


def test_failure_after_first_byte_anthropic_client(ups):
    ups["a"].fail("reset_midstream", after=1)
    with gateway(primary_backup(ups)) as gw:
        client = anthropic.Anthropic(base_url=gw.url, api_key="x", max_retries=0, timeout=20)
        tag = new_tag()
        seen = []
        with pytest.raises(anthropic.APIStatusError):
            with client.messages.stream(
                model="primary", max_tokens=50, messages=[{"role": "user", "content": f"go #{tag}"}]
            ) as s:
                seen.extend(ev.type for ev in s)
        assert "content_block_delta" in seen
    assert ups["a"].tags() == [tag] and ups["b"].log == []


def test_truncated_before_any_token_fails_over(ups):
    ups["a"].fail("truncate", after=0)
    with gateway(primary_backup(ups), num_retries=0) as gw:
        tag = new_tag()
        text, headers = ask(openai_client(gw), "primary", tag, stream=True)
    assert_served_once_by_backup(ups, tag, headers, text, attempts_on_a=1)


def test_slow_first_byte_within_ttft_is_served(ups):
    ups["a"].first_byte_delay = 0.4
    with gateway(primary_backup(ups), ttft_timeout=3) as gw:
        tag = new_tag()
        text, headers = ask(openai_client(gw), "primary", tag, stream=True)
    assert text == "a: w0 w1 w2" and headers["x-flashstack-attempts"] == "1"
    assert ups["b"].log == []


def test_slow_first_byte_past_ttft_fails_over(ups):
    ups["a"].first_byte_delay = 3
    with gateway(primary_backup(ups), num_retries=0, ttft_timeout=0.3) as gw:
        tag = new_tag()
        t0 = time.monotonic()
        text, headers = ask(openai_client(gw), "primary", tag, stream=True)
        assert time.monotonic() - t0 < 2.5
    assert_served_once_by_backup(ups, tag, headers, text, attempts_on_a=1)


@pytest.mark.parametrize("status", [401, 403, 404])
def test_upstream_auth_failures_count_against_the_upstream_and_fall_back(ups, status):
    """The gateway's credentials (or its model name, 404) for `a` are wrong: a's fault (breaker),
    never the client's 401/403/404."""
    ups["a"].fail("status", status=status)
    with gateway(primary_backup(ups), num_retries=0, breaker_failures=1) as gw:
        tag = new_tag()
        text, headers = ask(openai_client(gw), "primary", tag)
        assert_served_once_by_backup(ups, tag, headers, text, attempts_on_a=1)
        assert headers["x-flashstack-route"].startswith("primary#0=502")
        assert breaker_of(gw, "primary#0")["breaker"] == "open"


@pytest.mark.parametrize("status", [400, 422])
def test_client_errors_are_not_retried_and_do_not_trip_breakers(ups, status):
    ups["a"].fail("status", status=status)
    with gateway(primary_backup(ups), num_retries=2, breaker_failures=1) as gw:
        client = openai_client(gw)
        for _ in range(2):
            with pytest.raises(openai.APIStatusError) as exc:
                ask(client, "primary", new_tag())
            assert exc.value.status_code == status
            assert exc.value.response.headers["x-flashstack-attempts"] == "1"
        assert breaker_of(gw, "primary#0")["breaker"] == "closed"
    assert len(ups["a"].log) == 2 and ups["b"].log == []


def test_every_deployment_failing_gives_the_last_error_in_the_callers_format(ups):
    ups["a"].fail("status", status=503)
    ups["b"].fail("status", status=500)
    with gateway(primary_backup(ups), num_retries=1) as gw:
        client = anthropic.Anthropic(base_url=gw.url, api_key="x", max_retries=0, timeout=20)
        tag = new_tag()
        with pytest.raises(anthropic.InternalServerError) as exc:
            client.messages.create(
                model="primary", max_tokens=5, messages=[{"role": "user", "content": f"#{tag}"}]
            )
        assert exc.value.status_code == 500 and "b says 500" in exc.value.message
        assert exc.value.response.headers["x-flashstack-attempts"] == "4"
    assert ups["a"].tags().count(tag) == 2 and ups["b"].tags().count(tag) == 2


def test_truncated_stream_from_any_provider_is_an_error_event(ups):
    """An Anthropic-format upstream that stops after a text delta, without message_stop."""
    truncated = _AnthropicTruncating().start()
    try:
        models = [
            ModelConfig(
                name="claude", provider="anthropic", model="m", api_base=truncated.url, api_key="k"
            )
        ]
        with gateway(models) as gw:
            seen = []
            with pytest.raises(anthropic.APIStatusError) as exc:
                with anthropic_client(gw).messages.stream(
                    model="claude", max_tokens=20, messages=[{"role": "user", "content": "hi"}]
                ) as s:
                    seen.extend(ev.type for ev in s)
            assert "content_block_delta" in seen and "ended the stream before it finished" in str(
                exc.value
            )
    finally:
        truncated.stop()


class _AnthropicTruncating:
    """A raw-socket server sending message_start and one text delta, then closing cleanly."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def start(self):
        self.thread.start()
        return self

    def _serve(self) -> None:
        events = [
            (
                "message_start",
                {
                    "type": "message_start",
                    "message": {
                        "id": "msg_1",
                        "type": "message",
                        "role": "assistant",
                        "model": "m",
                        "content": [],
                        "stop_reason": None,
                        "stop_sequence": None,
                        "usage": {"input_tokens": 1, "output_tokens": 0},
                    },
                },
            ),
            (
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": 0,
                    "content_block": {"type": "text", "text": ""},
                },
            ),
            (
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": "half an"},
                },
            ),
        ]
        body = "".join(f"event: {n}\ndata: {json.dumps(d)}\n\n" for n, d in events).encode()
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, _, rest = data.partition(b"\r\n\r\n")
                length = int(
                    next(
                        (
                            ln.split(b":")[1]
                            for ln in head.split(b"\r\n")
                            if ln.lower().startswith(b"content-length")
                        ),
                        b"0",
                    )
                )
                while len(rest) < length:
                    rest += conn.recv(65536)
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: "
                    b"close\r\n\r\n" + body
                )

    def stop(self) -> None:
        self.sock.close()

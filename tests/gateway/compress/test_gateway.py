"""Compression through the real gateway, with the official SDKs, in front of the fake upstreams."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from .conftest import SMALL_WINDOW, TOPICS


def history(n: int) -> list[dict]:
    msgs = []
    for i in range(n):
        role = "user" if i % 2 == 0 else "assistant"
        text = f"Turn {i}. {TOPICS[i % 4]} " * 3 + ("The vault code is 7351." if i == 2 else "")
        msgs.append({"role": role, "content": text})
    return msgs


@pytest.fixture(scope="module")
def oai(small_gateway):
    return openai.OpenAI(
        base_url=small_gateway.url + "/v1", api_key="unused", max_retries=0, timeout=60
    )


@pytest.fixture(scope="module")
def claude(small_gateway):
    return anthropic.Anthropic(
        base_url=small_gateway.url, api_key="unused", max_retries=0, timeout=60
    )


def test_long_conversation_is_compressed_and_answered(oai):
    messages = [
        {"role": "system", "content": "Be brief."},
        *history(40),
        {"role": "user", "content": "What is the vault code?"},
    ]
    raw = oai.chat.completions.with_raw_response.create(model="tiny", messages=messages)
    resp = raw.parse()
    assert resp.choices[0].message.content == "echo: What is the vault code?"
    h = raw.headers
    assert h["x-flashstack-compression"] == "compressed"
    before, after = int(h["x-flashstack-tokens-before"]), int(h["x-flashstack-tokens-after"])
    assert before > SMALL_WINDOW and after + 100 <= 0.85 * SMALL_WINDOW
    assert int(h["x-flashstack-messages-summarized"]) + int(h["x-flashstack-messages-dropped"]) > 0
    # The upstream saw the compressed prompt: the fake counts words, well under the original's.
    original_words = sum(len(m["content"].split()) for m in messages)
    assert resp.usage.prompt_tokens < original_words / 2


def test_streaming_gets_the_same_headers(oai):
    messages = [*history(40), {"role": "user", "content": "What is the vault code?"}]
    with oai.chat.completions.with_streaming_response.create(
        model="tiny", messages=messages, stream=True
    ) as r:
        assert r.headers["x-flashstack-compression"] == "compressed"
        text = "".join(c.choices[0].delta.content or "" for c in r.parse() if c.choices)
    assert text == "echo: What is the vault code?"


def test_short_conversation_untouched(oai):
    raw = oai.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}]
    )
    assert "x-flashstack-compression" not in raw.headers
    assert raw.parse().choices[0].message.content == "echo: hi"


def test_truncate_on_request(oai):
    messages = [*history(40), {"role": "user", "content": "What is the vault code?"}]
    raw = oai.chat.completions.with_raw_response.create(
        model="tiny", messages=messages, extra_body={"compression": "truncate"}
    )
    assert raw.headers["x-flashstack-compression"] == "truncated"
    assert int(raw.headers["x-flashstack-messages-dropped"]) > 0


def test_off_on_request_passes_through(oai):
    messages = [*history(40), {"role": "user", "content": "What is the vault code?"}]
    raw = oai.chat.completions.with_raw_response.create(
        model="tiny", messages=messages, extra_body={"compression": "off"}
    )
    assert "x-flashstack-compression" not in raw.headers
    assert raw.parse().usage.prompt_tokens >= sum(len(m["content"].split()) for m in messages)


def test_unfittable_is_400_in_openai_format(oai):
    messages = [*history(6), {"role": "user", "content": "word " * 3000}]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="tiny", messages=messages)
    assert e.value.status_code == 400
    assert e.value.code == "context_length_exceeded"
    assert "context window" in e.value.message


def test_unfittable_is_400_in_anthropic_format(claude):
    messages = [*history(6), {"role": "user", "content": "word " * 3000}]
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="tiny-claude", max_tokens=50, messages=messages)
    assert e.value.status_code == 400
    assert (
        e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    )


def test_anthropic_tool_use_history_compressed_without_splitting(claude, upstreams):
    msgs: list[dict] = []
    for i in range(24):
        msgs.append({"role": "user", "content": f"Turn {i}. {TOPICS[i % 4]} " * 3})
        msgs.append(
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Checking."},
                    {
                        "type": "tool_use",
                        "id": f"toolu_{i:03d}",
                        "name": "lookup",
                        "input": {"q": i},
                    },
                ],
            }
        )
        msgs.append(
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": f"toolu_{i:03d}",
                        "content": f"result {i} " * 10,
                    }
                ],
            }
        )
        msgs.append({"role": "assistant", "content": f"Result {i} noted."})
    msgs.append({"role": "user", "content": "Summarize the results."})
    tools = [{"name": "lookup", "description": "look up", "input_schema": {"type": "object"}}]
    raw = claude.messages.with_raw_response.create(
        model="tiny-claude", max_tokens=50, messages=msgs, tools=tools, tool_choice={"type": "none"}
    )
    assert raw.http_response.status_code == 200
    assert raw.headers["x-flashstack-compression"] == "compressed"
    # What the upstream received: every tool_result right after the assistant turn with its tool_use
    # (the real API rejects anything else), and fewer turns than were sent.
    # the last Messages request: a health probe (no body) may have come after it
    calls = [q for q in upstreams["anthropic"].requests if q.path.endswith("/messages")]
    sent = calls[-1].body["messages"]
    assert len(sent) < len(msgs)
    results = 0
    for i, m in enumerate(sent):
        for block in m["content"] if isinstance(m["content"], list) else []:
            if block["type"] == "tool_result":
                results += 1
                prev = sent[i - 1]["content"]
                assert any(b.get("id") == block["tool_use_id"] for b in prev if isinstance(b, dict))
    assert results > 0


def test_bad_compression_field_is_400(small_gateway, oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"compression": "squash"},
        )
    assert "compression" in e.value.message


def test_metrics_count_compressions(small_gateway, oai):
    messages = [*history(40), {"role": "user", "content": "What is the vault code?"}]
    oai.chat.completions.create(model="tiny", messages=messages)
    body = httpx.get(small_gateway.url + "/metrics").text
    line = next(
        ln
        for ln in body.splitlines()
        if ln.startswith('flashstack_compression_requests_total{action="compressed",model="tiny"}')
    )
    assert float(line.split()[-1]) >= 1
    assert "flashstack_compression_tokens_saved_total" in body

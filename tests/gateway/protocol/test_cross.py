"""Across wires: what has a counterpart is mapped, what the client relies on is refused by name,
what is only an optimisation is dropped and named in x-flashstack-dropped."""

from __future__ import annotations

import copy

import anthropic
import openai
import pytest

from tests.gateway.protocol import samples


def _anthropic_without_refused() -> dict:
    kwargs = samples.anthropic_request()
    for name in samples.REFUSED_ANTHROPIC:
        kwargs.pop(name, None)
        kwargs["extra_body"].pop(name, None)
    kwargs["messages"][0]["content"].pop(1)  # the PDF: refused, see below
    return kwargs


def test_anthropic_cache_control_and_thinking_to_an_openai_upstream_are_dropped_and_named(
    clients, answered
):
    raw = clients["gateway"][1].messages.with_raw_response.create(
        model="oai", **_anthropic_without_refused()
    )
    dropped = _request_fields_dropped(raw.headers)  # the response's: test_response_dropped.py
    assert dropped == {
        "system[].cache_control",
        "messages[].content[].cache_control",
        "tools[].cache_control",
        "tools[].defer_loading",
        "messages[].content[].type=thinking",
        "messages[].content[].type=redacted_thinking",
        "messages[].content[].citations",
        "thinking",
        "context_management",
        "top_k",
        "service_tier",
        "inference_geo",
        "speed",
        "x_future_field",
        "output_config.effort",
    }
    sent = answered["openai"].requests[-1]
    assert "cache_control" not in sent.raw.decode() and "thinking" not in sent.body
    assert sent.body["messages"][0] == {
        "role": "system",
        "content": "You are terse.\n\nCite sources.",
    }
    message = raw.parse()
    assert message.content[0].text == '{"a": 1}' and message.stop_reason == "end_turn"
    # OpenAI counts cached tokens in prompt_tokens; Anthropic's input_tokens leave them out.
    assert message.usage.input_tokens == 20 and message.usage.cache_read_input_tokens == 100


def test_a_pdf_document_to_an_openai_upstream_is_a_file_part(clients, answered):
    kwargs = _anthropic_without_refused()
    kwargs["messages"] = samples.anthropic_messages()
    raw = clients["gateway"][1].messages.with_raw_response.create(model="oai", **kwargs)
    assert raw.http_response.status_code == 200
    user = answered["openai"].requests[-1].body["messages"][1]
    assert user["content"][1] == {
        "type": "file",
        "file": {"filename": "doc", "file_data": "data:application/pdf;base64," + samples.PDF},
    }


def test_a_document_by_url_is_refused_by_name(clients, answered):
    doc = {"type": "document", "source": {"type": "url", "url": "https://example.com/a.pdf"}}
    with pytest.raises(anthropic.BadRequestError) as e:
        clients["gateway"][1].messages.create(
            model="oai", max_tokens=8, messages=[{"role": "user", "content": [doc]}]
        )
    assert "messages[].content[].type=document" in str(e.value)
    assert not answered["openai"].requests


def test_an_openai_pdf_file_to_anthropic_is_a_document(clients, answered):
    file = {
        "type": "file",
        "file": {"filename": "a.pdf", "file_data": "data:application/pdf;base64," + samples.PDF},
    }
    clients["gateway"][0].chat.completions.create(
        model="claude", messages=[{"role": "user", "content": [file]}]
    )
    block = answered["anthropic"].requests[-1].body["messages"][0]["content"][0]
    assert block == {
        "type": "document",
        "title": "a.pdf",
        "source": {"type": "base64", "media_type": "application/pdf", "data": samples.PDF},
    }
    with pytest.raises(openai.BadRequestError) as e:
        by_id = {"type": "file", "file": {"file_id": "file-abc"}}
        clients["gateway"][0].chat.completions.create(
            model="claude", messages=[{"role": "user", "content": [by_id]}]
        )
    assert "type=file" in str(e.value)


def test_openai_audio_input_to_anthropic_is_refused_by_name(clients, answered):
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    with pytest.raises(openai.BadRequestError) as e:
        clients["gateway"][0].chat.completions.create(
            model="claude", messages=[{"role": "user", "content": [audio]}]
        )
    assert "type=input_audio" in str(e.value) and not answered["anthropic"].requests


def test_openai_request_to_anthropic_maps_what_has_a_counterpart(clients, answered):
    raw = clients["gateway"][0].chat.completions.with_raw_response.create(
        model="claude",
        messages=samples.openai_messages(),
        reasoning_effort="low",
        user="user-9",
        max_completion_tokens=2048,
        parallel_tool_calls=False,
        tools=[samples.WEATHER_TOOL],
        seed=3,
    )
    sent = answered["anthropic"].requests[-1].body
    # Developer and system messages, wherever they stood; the ones sent as parts make it blocks.
    assert sent["system"] == [
        {"type": "text", "text": t} for t in ("Be terse.", "Answer in JSON.", "Now be verbose.")
    ]
    assert (
        sent["thinking"] == {"type": "enabled", "budget_tokens": 1024}
        and sent["max_tokens"] == 2048
    )
    assert sent["metadata"] == {"user_id": "user-9"}
    assert sent["tool_choice"] == {"type": "auto", "disable_parallel_tool_use": True}
    assert [m["role"] for m in sent["messages"]] == [
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
    ]
    assert _request_fields_dropped(raw.headers) == {
        "seed",
        "messages[].name",
        "tools[].function.strict",
        "messages[].content[].image_url.detail",
    }
    completion = raw.parse()
    # Anthropic's cache reads and writes are part of OpenAI's prompt_tokens.
    assert completion.usage.prompt_tokens == 20 + 1000 + 50
    assert completion.usage.prompt_tokens_details.cached_tokens == 1000
    assert completion.choices[0].message.tool_calls[0].function.name == "get_time"
    assert completion.choices[0].finish_reason == "tool_calls"


SYSTEM_PARTS = {
    "role": "developer",
    "content": [
        {"type": "text", "text": "Be terse."},
        {"type": "text", "text": "Cite.", "cache_control": samples.CACHE},
    ],
}
LATE_PARTS = {"role": "system", "content": [{"type": "text", "text": "Now be verbose."}]}


def test_openai_system_parts_pass_whole_to_an_openai_upstream(clients, answered):
    messages = [SYSTEM_PARTS, {"role": "user", "content": "hi"}, LATE_PARTS]
    clients["gateway"][0].chat.completions.create(model="oai", messages=copy.deepcopy(messages))
    assert answered["openai"].requests[-1].body["messages"] == messages


def test_openai_system_parts_to_anthropic_are_system_blocks(clients, answered):
    messages = [SYSTEM_PARTS, {"role": "user", "content": "hi"}, LATE_PARTS]
    raw = clients["gateway"][0].chat.completions.with_raw_response.create(
        model="claude", messages=copy.deepcopy(messages), response_format={"type": "json_object"}
    )
    system = answered["anthropic"].requests[-1].body["system"]
    assert system[:3] == [
        {"type": "text", "text": "Be terse."},
        {"type": "text", "text": "Cite.", "cache_control": samples.CACHE},
        {"type": "text", "text": "Now be verbose."},
    ]
    # response_format
    assert len(system) == 4 and system[3]["text"].startswith("Reply with one JSON object")
    assert not _request_fields_dropped(raw.headers)


def _request_fields_dropped(headers) -> set[str]:
    """The request's fields named in x-flashstack-dropped (the response's are named
    `response.…`)."""
    names = set(filter(None, headers.get("x-flashstack-dropped", "").split(",")))
    return {n for n in names if not n.startswith("response.")}


def test_anthropic_stream_to_an_openai_client(clients, answered):
    chunks = list(
        clients["gateway"][0].chat.completions.create(
            model="claude",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == '{"sunny": true}' and chunks[-1].usage.prompt_tokens == 1070
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert calls[0].function.name == "get_time"
    assert "".join(tc.function.arguments or "" for tc in calls) == '{"city": "Paris"}'


def test_openai_stream_to_an_anthropic_client(clients, answered):
    kwargs = {"max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}
    with clients["gateway"][1].messages.stream(model="oai", **copy.deepcopy(kwargs)) as s:
        final = s.get_final_message()
    assert final.content[0].text == '{"a": 1}' and final.usage.cache_read_input_tokens == 100


def test_a_block_ollama_cannot_read_is_refused_by_name(anthropic_client):
    # tests/gateway/conftest.py's gateway, in front of the faithful Ollama fake.
    doc = {
        "type": "document",
        "source": {"type": "base64", "media_type": "application/pdf", "data": samples.PDF},
    }
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client.messages.create(
            model="llama", max_tokens=8, messages=[{"role": "user", "content": [doc]}]
        )
    assert "type=document" in str(e.value)

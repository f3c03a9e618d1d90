"""The fake upstreams speak each protocol as the official SDKs parse it, and follow the shared
script."""

from __future__ import annotations

import base64
import json
import time

import anthropic
import httpx
import openai
import pydantic
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from . import anthropic_upstream, ollama_upstream, openai_upstream, script
from .server import FakeServer

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(60))
PNG_B64 = base64.b64encode(PNG).decode()
ANTHROPIC_HEADERS = {"x-api-key": "k", "anthropic-version": "2023-06-01"}
OPENAI_HEADERS = {"authorization": "Bearer k"}
CLAUDE = "claude-sonnet-4-5-20250929"
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
OPENAI_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": WEATHER_TOOL["input_schema"],
    },
}


@pytest.fixture(scope="session")
def claude():
    with FakeServer(anthropic_upstream.create_app()) as srv:
        yield srv


@pytest.fixture(scope="session")
def gpt():
    with FakeServer(openai_upstream.create_app()) as srv:
        yield srv


@pytest.fixture(scope="session")
def llama():
    with FakeServer(ollama_upstream.create_app()) as srv:
        yield srv


@pytest.fixture
def claude_client(claude):
    return anthropic.Anthropic(base_url=claude.url, api_key="k", max_retries=0)


@pytest.fixture
def gpt_client(gpt):
    return openai.OpenAI(base_url=gpt.url + "/v1", api_key="k", max_retries=0)


def strict(type_, data):
    """Validate `data` as the SDK type and reject any field the SDK type does not declare."""
    value = pydantic.TypeAdapter(type_).validate_python(data)
    _no_extra(value)
    return value


def _no_extra(value) -> None:
    if isinstance(value, pydantic.BaseModel):
        assert not value.model_extra, (
            f"{type(value).__name__} has undeclared fields {value.model_extra}"
        )
        for name in type(value).model_fields:
            _no_extra(getattr(value, name))
    elif isinstance(value, list):
        for item in value:
            _no_extra(item)


def sse_events(response: httpx.Response) -> list[tuple[str | None, str]]:
    """(event, data) pairs of an SSE body, as the SDKs' decoders split it."""
    events = []
    for block in response.text.split("\n\n"):
        if not block.strip():
            continue
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        events.append((fields.get("event"), fields["data"]))
    return events


def user(text, **extra):
    return [{"role": "user", "content": text, **extra}]


# --- Anthropic ------------------------------------------------------------------------------------


def test_anthropic_message_is_a_strict_sdk_message(claude):
    body = {"model": CLAUDE, "max_tokens": 100, "messages": user("hello there world")}
    response = httpx.post(claude.url + "/v1/messages", headers=ANTHROPIC_HEADERS, json=body)
    assert response.status_code == 200 and response.headers["request-id"].startswith("req_")
    raw = response.json()
    assert set(raw) == {
        "id",
        "type",
        "role",
        "model",
        "content",
        "stop_reason",
        "stop_sequence",
        "usage",
    }
    message = strict(Message, raw)
    assert message.content[0].text == "echo: hello there world"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (3, 4)
    with pytest.raises(pydantic.ValidationError):  # the check fails when the fake drops a field
        strict(Message, {k: v for k, v in raw.items() if k != "usage"})


def test_anthropic_sdk_create_and_stream_agree(claude_client):
    kwargs = {
        "model": CLAUDE,
        "max_tokens": 100,
        "system": "be brief",
        "messages": user("one two three"),
    }
    created = claude_client.messages.create(**kwargs)
    with claude_client.messages.stream(**kwargs) as stream:
        deltas = list(stream.text_stream)
        final = stream.get_final_message()
    assert deltas == ["echo:", " one", " two", " three"]
    assert final.content[0].text == created.content[0].text == "echo: one two three"
    assert final.stop_reason == created.stop_reason == "end_turn"
    assert final.usage.input_tokens == created.usage.input_tokens == 5
    assert final.usage.output_tokens == created.usage.output_tokens == 4


def test_anthropic_stream_event_sequence_is_exact(claude):
    body = {"model": CLAUDE, "max_tokens": 100, "stream": True, "messages": user("a b")}
    response = httpx.post(claude.url + "/v1/messages", headers=ANTHROPIC_HEADERS, json=body)
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response)
    names = [e for e, _ in events]
    assert names == [
        "message_start",
        "content_block_start",
        "ping",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    for name, data in events:
        parsed = json.loads(data)
        assert parsed["type"] == name
        if name != "ping":
            strict(RawMessageStreamEvent, parsed)
    start, delta = json.loads(events[0][1]), json.loads(events[-2][1])
    # cumulative: the delta repeats the total
    assert start["message"]["usage"]["output_tokens"] == 1
    assert delta["usage"]["output_tokens"] == 3 and delta["usage"]["input_tokens"] == 2
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}


def test_anthropic_tool_use_streams_input_json_deltas(claude, claude_client):
    body = {
        "model": CLAUDE,
        "max_tokens": 100,
        "stream": True,
        "tools": [WEATHER_TOOL],
        "messages": user("weather?"),
    }
    events = [
        json.loads(d)
        for _, d in sse_events(
            httpx.post(claude.url + "/v1/messages", headers=ANTHROPIC_HEADERS, json=body)
        )
    ]
    start = next(e for e in events if e["type"] == "content_block_start")
    assert start["content_block"]["type"] == "tool_use" and start["content_block"]["input"] == {}
    fragments = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"]
    assert len(fragments) > 2 and json.loads("".join(fragments)) == script.TOOL_ARGUMENTS
    del body["stream"]
    with claude_client.messages.stream(**body) as stream:
        final = stream.get_final_message()
    block = final.content[0]
    assert (block.type, block.name, block.input) == (
        "tool_use",
        "get_weather",
        script.TOOL_ARGUMENTS,
    )
    assert block.id.startswith("toolu_") and final.stop_reason == "tool_use"


def test_anthropic_tool_choice_none_and_forced_tool(claude_client):
    other = {**WEATHER_TOOL, "name": "get_time"}
    base = {
        "model": CLAUDE,
        "max_tokens": 100,
        "tools": [WEATHER_TOOL, other],
        "messages": user("hi"),
    }
    assert (
        claude_client.messages.create(**base, tool_choice={"type": "none"}).content[0].text
        == "echo: hi"
    )
    forced = claude_client.messages.create(**base, tool_choice={"type": "tool", "name": "get_time"})
    assert forced.content[0].name == "get_time"


def test_anthropic_tool_result_and_image(claude_client):
    turns = [
        *user("weather?"),
        {
            "role": "assistant",
            "content": [
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": script.TOOL_ARGUMENTS,
                }
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C sunny"}],
        },
    ]
    reply = claude_client.messages.create(
        model=CLAUDE, max_tokens=100, tools=[WEATHER_TOOL], messages=turns
    )
    assert reply.content[0].text == "tool said: 18C sunny" and reply.stop_reason == "end_turn"
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": PNG_B64},
    }
    reply = claude_client.messages.create(
        model=CLAUDE,
        max_tokens=100,
        messages=[{"role": "user", "content": [image, {"type": "text", "text": "what is it?"}]}],
    )
    assert reply.content[0].text == f"image: image/png {len(PNG)}"
    with pytest.raises(anthropic.BadRequestError):
        bad = {**image, "source": {**image["source"], "data": "not base64!"}}
        claude_client.messages.create(
            model=CLAUDE, max_tokens=100, messages=[{"role": "user", "content": [bad]}]
        )


def test_anthropic_stop_reasons(claude_client):
    create = claude_client.messages.create
    capped = create(model=CLAUDE, max_tokens=2, messages=user("one two three four"))
    assert (capped.content[0].text, capped.stop_reason, capped.usage.output_tokens) == (
        "echo: one",
        "max_tokens",
        2,
    )
    forced = create(model=CLAUDE, max_tokens=100, messages=user("x [[max_tokens]]"))
    assert forced.stop_reason == "max_tokens"
    stopped = create(
        model=CLAUDE, max_tokens=100, stop_sequences=["STOP"], messages=user("go STOP here")
    )
    assert (stopped.content[0].text, stopped.stop_reason, stopped.stop_sequence) == (
        "echo: go ",
        "stop_sequence",
        "STOP",
    )
    assert (
        create(model=CLAUDE, max_tokens=100, messages=user("[[json]]")).content[0].text
        == script.JSON_REPLY
    )
    assert (
        create(model=CLAUDE, max_tokens=100, messages=user("[[badjson]]")).content[0].text
        == '{"name": 5}'
    )


def test_anthropic_thinking_block(claude_client):
    with claude_client.messages.stream(
        model=CLAUDE, max_tokens=100, messages=user("hmm [[think]]")
    ) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking.startswith("thinking about:") and final.content[0].signature


def test_anthropic_errors_raise_typed_sdk_exceptions(claude, claude_client):
    with pytest.raises(anthropic.RateLimitError) as rate:
        claude_client.messages.create(model=CLAUDE, max_tokens=10, messages=user("[[status:429]]"))
    assert (
        rate.value.request_id.startswith("req_")
        and rate.value.response.headers["retry-after"] == "1"
    )
    assert rate.value.type == "rate_limit_error"
    with pytest.raises(anthropic.InternalServerError) as overloaded:
        claude_client.messages.create(model=CLAUDE, max_tokens=10, messages=user("[[status:529]]"))
    assert overloaded.value.status_code == 529 and overloaded.value.type == "overloaded_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(
            base_url=claude.url,
            api_key="k",
            max_retries=0,
            default_headers={"authorization": anthropic.Omit()},
        ).messages.create(model=CLAUDE, max_tokens=10, messages=user("hi"))
    no_version = httpx.post(
        claude.url + "/v1/messages",
        headers={"x-api-key": "k"},
        json={"model": CLAUDE, "max_tokens": 10, "messages": user("hi")},
    )
    assert no_version.status_code == 400
    assert no_version.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        claude_client.post(
            "/v1/messages", cast_to=Message, body={"model": CLAUDE, "messages": user("hi")}
        )


def test_anthropic_midstream_error_event(claude, claude_client):
    received = []
    with pytest.raises(anthropic.APIStatusError) as error:
        with claude_client.messages.stream(
            model=CLAUDE, max_tokens=10, messages=user("a [[midstream_error]]")
        ) as s:
            received.extend(s.text_stream)
    assert received == ["echo:", " a"] and error.value.type == "overloaded_error"
    body = {
        "model": CLAUDE,
        "max_tokens": 10,
        "stream": True,
        "messages": user("a [[midstream_error]]"),
    }
    events = sse_events(
        httpx.post(claude.url + "/v1/messages", headers=ANTHROPIC_HEADERS, json=body)
    )
    assert events[-1][0] == "error"
    assert json.loads(events[-1][1])["error"] == {
        "type": "overloaded_error",
        "message": "Overloaded",
    }


def test_anthropic_models_and_recording(claude, claude_client):
    models = list(claude_client.models.list())
    assert models[0].id == anthropic_upstream.MODELS[0] and models[0].type == "model"
    claude_client.messages.create(model=CLAUDE, max_tokens=7, messages=user("recorded"))
    last = claude.requests[-1]
    assert (last.method, last.path, last.body["max_tokens"]) == ("POST", "/v1/messages", 7)
    assert last.headers["anthropic-version"] and last.headers["authorization"] == "Bearer k"


# --- OpenAI ---------------------------------------------------------------------------------------


def test_openai_completion_is_a_strict_sdk_completion(gpt, gpt_client):
    body = {
        "model": "gpt-4o-mini",
        "messages": [{"role": "system", "content": "be brief"}, *user("hi you")],
    }
    response = httpx.post(gpt.url + "/v1/chat/completions", headers=OPENAI_HEADERS, json=body)
    raw = response.json()
    assert set(raw) == {
        "id",
        "object",
        "created",
        "model",
        "choices",
        "usage",
        "service_tier",
        "system_fingerprint",
    }
    assert set(raw["choices"][0]) == {"index", "message", "logprobs", "finish_reason"}
    completion = strict(ChatCompletion, raw)
    assert completion.choices[0].message.content == "echo: hi you"
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (4, 3)
    with pytest.raises(pydantic.ValidationError):
        strict(
            ChatCompletion,
            {
                **raw,
                "choices": [{k: v for k, v in raw["choices"][0].items() if k != "finish_reason"}],
            },
        )
    assert gpt_client.chat.completions.create(**body).choices[0].finish_reason == "stop"


def test_openai_stream_chunks_usage_and_done(gpt, gpt_client):
    body = {
        "model": "gpt-4o-mini",
        "messages": user("one two"),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = httpx.post(gpt.url + "/v1/chat/completions", headers=OPENAI_HEADERS, json=body)
    events = sse_events(response)
    assert all(e is None for e, _ in events) and events[-1][1] == "[DONE]"
    chunks = [strict(ChatCompletionChunk, json.loads(d)) for _, d in events[:-1]]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "echo: one two"
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert all(c.usage is None for c in chunks[:-1])
    sdk_chunks = list(
        gpt_client.chat.completions.create(
            **{k: v for k, v in body.items() if k != "stream"}, stream=True
        )
    )
    assert sdk_chunks[-1].usage.total_tokens == 2 + 3
    no_usage = sse_events(
        httpx.post(
            gpt.url + "/v1/chat/completions",
            headers=OPENAI_HEADERS,
            json={**body, "stream_options": None},
        )
    )
    assert all("usage" not in json.loads(d) for _, d in no_usage[:-1])


def test_openai_tool_call_fragments(gpt, gpt_client):
    body = {"model": "gpt-4o-mini", "messages": user("weather?"), "tools": [OPENAI_TOOL]}
    events = sse_events(
        httpx.post(
            gpt.url + "/v1/chat/completions", headers=OPENAI_HEADERS, json={**body, "stream": True}
        )
    )
    calls = [json.loads(d)["choices"][0]["delta"].get("tool_calls") for _, d in events[:-1]]
    first, rest = calls[0][0], [c[0] for c in calls[1:] if c]
    assert (
        first["index"] == 0
        and first["id"].startswith("call_")
        and first["function"]["name"] == "get_weather"
    )
    assert first["function"]["arguments"] == "" and all(
        set(r) == {"index", "function"} for r in rest
    )
    assert json.loads("".join(r["function"]["arguments"] for r in rest)) == script.TOOL_ARGUMENTS
    with gpt_client.chat.completions.stream(**body) as stream:
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        script.TOOL_ARGUMENTS,
    )
    assert final.choices[0].finish_reason == "tool_calls"
    plain = gpt_client.chat.completions.create(**body)
    assert (
        plain.choices[0].message.content is None
        and plain.choices[0].message.tool_calls[0].id == call.id
    )


def test_openai_tool_result_image_and_stops(gpt_client):
    create = gpt_client.chat.completions.create
    turns = [
        *user("weather?"),
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": "{}"},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    ]
    assert (
        create(model="m", messages=turns, tools=[OPENAI_TOOL]).choices[0].message.content
        == "tool said: 18C"
    )
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + PNG_B64}}
    reply = create(
        model="m", messages=[{"role": "user", "content": [{"type": "text", "text": "?"}, image]}]
    )
    assert reply.choices[0].message.content == f"image: image/png {len(PNG)}"
    capped = create(model="m", messages=user("a b c d"), max_completion_tokens=2)
    assert (capped.choices[0].message.content, capped.choices[0].finish_reason) == (
        "echo: a",
        "length",
    )
    stopped = create(model="m", messages=user("a b STOP c"), stop="STOP")
    assert (stopped.choices[0].message.content, stopped.choices[0].finish_reason) == (
        "echo: a b ",
        "stop",
    )
    assert (
        create(model="m", messages=user("[[json]]"), tool_choice="none", tools=[OPENAI_TOOL])
        .choices[0]
        .message.content
        == script.JSON_REPLY
    )


def test_openai_errors(gpt, gpt_client):
    with pytest.raises(openai.RateLimitError) as rate:
        gpt_client.chat.completions.create(model="m", messages=user("[[status:429]]"))
    assert (
        rate.value.response.headers["retry-after"] == "1"
        and rate.value.code == "rate_limit_exceeded"
    )
    with pytest.raises(openai.InternalServerError):
        gpt_client.chat.completions.create(model="m", messages=user("[[status:503]]"))
    missing_key = httpx.post(
        gpt.url + "/v1/chat/completions", json={"model": "m", "messages": user("hi")}
    )
    error = missing_key.json()["error"]
    assert missing_key.status_code == 401 and set(error) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError) as bad:
        gpt_client.chat.completions.create(model="m", messages=[])
    assert bad.value.param == "messages"
    received = []
    with pytest.raises(openai.APIError, match="server had an error"):
        for chunk in gpt_client.chat.completions.create(
            model="m", messages=user("[[midstream_error]]"), stream=True
        ):
            received.append(chunk.choices[0].delta.content)
    assert received == ["", "echo:", " [[midstream_error]]"]


def test_openai_models(gpt_client):
    assert [m.id for m in gpt_client.models.list()] == list(openai_upstream.MODELS)


# --- Ollama ---------------------------------------------------------------------------------------


def test_ollama_ndjson_stream(llama):
    with httpx.stream(
        "POST", llama.url + "/api/chat", json={"model": "llama3.2", "messages": user("hi you")}
    ) as r:
        assert r.headers["content-type"] == "application/x-ndjson"
        lines = [json.loads(line) for line in r.iter_lines()]
    assert [line["message"]["content"] for line in lines[:-1]] == ["echo:", " hi", " you"]
    assert all(line["done"] is False and "done_reason" not in line for line in lines[:-1])
    final = lines[-1]
    assert (
        final["done"] is True
        and final["done_reason"] == "stop"
        and final["message"]["content"] == ""
    )
    assert (final["prompt_eval_count"], final["eval_count"]) == (2, 3)
    assert {
        "total_duration",
        "load_duration",
        "prompt_eval_duration",
        "eval_duration",
        "created_at",
    } <= set(final)


def test_ollama_non_stream_tools_and_images(llama):
    def chat(**body):
        return httpx.post(
            llama.url + "/api/chat", json={"model": "llama3.2", "stream": False, **body}
        ).json()

    tool = {
        "type": "function",
        "function": {"name": "get_weather", "parameters": WEATHER_TOOL["input_schema"]},
    }
    called = chat(messages=user("weather?"), tools=[tool])
    assert called["message"]["tool_calls"][0]["function"]["arguments"] == script.TOOL_ARGUMENTS
    assert called["done"] is True and called["done_reason"] == "stop"
    turns = [
        *user("weather?"),
        {"role": "assistant", "content": "", "tool_calls": called["message"]["tool_calls"]},
        {"role": "tool", "content": "18C", "tool_name": "get_weather"},
    ]
    assert chat(messages=turns, tools=[tool])["message"]["content"] == "tool said: 18C"
    seen = chat(messages=user("what?", images=[PNG_B64]))
    assert seen["message"]["content"] == f"image: image/png {len(PNG)}"
    capped = chat(messages=user("a b c"), options={"num_predict": 1})
    assert (capped["message"]["content"], capped["done_reason"], capped["eval_count"]) == (
        "echo:",
        "length",
        1,
    )


def test_ollama_tags_version_and_errors(llama):
    tags = httpx.get(llama.url + "/api/tags").json()
    assert tags["models"][0]["name"] == "llama3.2:latest" and "details" in tags["models"][0]
    assert httpx.get(llama.url + "/api/version").json() == {"version": ollama_upstream.VERSION}
    failed = httpx.post(
        llama.url + "/api/chat", json={"model": "llama3.2", "messages": user("[[status:503]]")}
    )
    assert failed.status_code == 503 and set(failed.json()) == {"error"}
    unknown = httpx.post(llama.url + "/api/chat", json={"model": "nope", "messages": user("hi")})
    assert unknown.status_code == 404
    lines = httpx.post(
        llama.url + "/api/chat", json={"model": "llama3.2", "messages": user("[[midstream_error]]")}
    )
    parsed = [json.loads(line) for line in lines.text.splitlines()]
    assert len(parsed) == 3 and "error" in parsed[-1] and not any(p.get("done") for p in parsed)


def test_ollama_official_client_reads_the_fake(llama):
    ollama = pytest.importorskip("ollama")
    client = ollama.Client(host=llama.url)
    streamed = list(client.chat(model="llama3.2", messages=user("hi you"), stream=True))
    assert (
        "".join(p.message.content for p in streamed) == "echo: hi you"
        and streamed[-1].eval_count == 3
    )
    tool = {
        "type": "function",
        "function": {"name": "get_weather", "parameters": WEATHER_TOOL["input_schema"]},
    }
    reply = client.chat(model="llama3.2", messages=user("weather?"), tools=[tool])
    assert reply.message.tool_calls[0].function.arguments == script.TOOL_ARGUMENTS
    assert [m.model for m in client.list().models] == list(ollama_upstream.MODELS)
    with pytest.raises(ollama.ResponseError):
        list(client.chat(model="llama3.2", messages=user("[[midstream_error]]"), stream=True))


# --- shared behaviour -----------------------------------------------------------------------------

STREAM_REQUESTS = {
    "claude": (
        "/v1/messages",
        ANTHROPIC_HEADERS,
        {"model": CLAUDE, "max_tokens": 10, "stream": True},
    ),
    "gpt": ("/v1/chat/completions", OPENAI_HEADERS, {"model": "m", "stream": True}),
    "llama": ("/api/chat", {}, {"model": "llama3.2"}),
}


@pytest.mark.parametrize("fake", list(STREAM_REQUESTS))
def test_disconnect_is_recorded_within_a_second(fake, request):
    srv = request.getfixturevalue(fake)
    path, headers, body = STREAM_REQUESTS[fake]
    with httpx.Client() as client:
        with client.stream(
            "POST",
            srv.url + path,
            headers=headers,
            json={**body, "messages": user("[[slow:0.05]]")},
        ) as response:
            index = len(srv.requests) - 1
            lines = response.iter_lines()
            for _ in range(8):
                next(lines)
        closed_at = time.monotonic()
    deadline = closed_at + 1.0
    while not any(i == index for i, _ in srv.cancelled) and time.monotonic() < deadline:
        time.sleep(0.01)
    cancelled_at = dict(srv.cancelled)[index]
    assert cancelled_at - closed_at < 1.0


def test_completed_streams_are_not_recorded_as_cancelled(claude):
    before = list(claude.cancelled)
    body = {"model": CLAUDE, "max_tokens": 10, "stream": True, "messages": user("done")}
    httpx.post(claude.url + "/v1/messages", headers=ANTHROPIC_HEADERS, json=body)
    time.sleep(0.05)
    assert claude.cancelled == before


def test_big_stream_sends_exactly_n_bytes_in_kib_chunks(gpt):
    size = 10 * 1024 * 1024 + 5
    body = {"model": "m", "stream": True, "messages": user(f"[[big:{size}]]")}
    pieces = []
    with httpx.stream(
        "POST", gpt.url + "/v1/chat/completions", headers=OPENAI_HEADERS, json=body
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                content = json.loads(line[6:])["choices"][0]["delta"].get("content")
                if content:
                    pieces.append(len(content))
    assert (
        sum(pieces) == size
        and max(pieces) == script.BIG_CHUNK_BYTES
        and len(pieces) == size // 1024 + 1
    )


def test_script_rules():
    decide = script.decide
    assert decide(script.Prompt(last_user_text="hi there")).chunks == ["echo:", " hi", " there"]
    assert decide(script.Prompt(last_user_text="[[status:429]]")).fail_status == 429
    tool = decide(script.Prompt(last_user_text="x", tool_name="t"))
    assert tool.stop_reason == "tool_use" and "".join(tool.items) == json.dumps(
        script.TOOL_ARGUMENTS
    )
    assert decide(script.Prompt(tool_name="t", tool_results=["r"])).text() == "tool said: r"
    assert decide(script.Prompt(texts=["a b", "c"])).input_tokens == 3
    slow = decide(script.Prompt(last_user_text="[[slow:2]]"))
    assert slow.interval == 2.0 and next(iter(slow.chunks)) == "tick 0 "


def test_fake_server_stops_and_frees_its_port():
    srv = FakeServer(openai_upstream.create_app()).start()
    url = srv.url
    assert httpx.get(url + "/v1/models", headers=OPENAI_HEADERS).status_code == 200
    srv.stop()
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/v1/models", headers=OPENAI_HEADERS)

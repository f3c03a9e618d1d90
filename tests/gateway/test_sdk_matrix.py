"""{OpenAI client, Anthropic client} × {anthropic, openai, ollama upstream} × {sync, stream} ×
{text, tools, image}.

The official SDKs are the clients; the upstreams are the faithful fakes in tests/fakes.
"""

from __future__ import annotations

import base64
import io
import json

import pytest
from PIL import Image as PILImage

UPSTREAMS = ["claude", "gpt", "llama"]
WEATHER_OPENAI = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
            "required": ["city"],
        },
    },
}
WEATHER_ANTHROPIC = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": WEATHER_OPENAI["function"]["parameters"],
}


def png_b64() -> tuple[str, int]:
    buf = io.BytesIO()
    PILImage.new("RGB", (8, 8), (200, 30, 30)).save(buf, format="PNG")
    raw = buf.getvalue()
    return base64.b64encode(raw).decode(), len(raw)


# ---- OpenAI client ---------------------------------------------------------------------------


def _openai_run(client, stream: bool, **kwargs):
    """(text, tool_calls, finish_reason, usage) from either a plain or a streamed completion."""
    if not stream:
        r = client.chat.completions.create(**kwargs)
        msg = r.choices[0].message
        calls = [
            (c.id, c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []
        ]
        return msg.content or "", calls, r.choices[0].finish_reason, r.usage
    chunks = list(
        client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    text, calls, finish, usage = "", {}, None, None
    for ch in chunks:
        if ch.usage:
            usage = ch.usage
        for choice in ch.choices:
            text += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": None, "name": "", "args": ""})
                entry["id"] = tc.id or entry["id"]
                entry["name"] += (tc.function.name or "") if tc.function else ""
                entry["args"] += (tc.function.arguments or "") if tc.function else ""
            finish = choice.finish_reason or finish
    assert chunks[-1].choices == [] and usage is not None, "usage chunk must come last"
    tool_calls = [(c["id"], c["name"], json.loads(c["args"])) for _, c in sorted(calls.items())]
    return text, tool_calls, finish, usage


@pytest.mark.parametrize("stream", [False, True], ids=["sync", "stream"])
@pytest.mark.parametrize("model", UPSTREAMS)
def test_openai_client_text(openai_client, model, stream):
    text, calls, finish, usage = _openai_run(
        openai_client,
        stream,
        model=model,
        messages=[{"role": "user", "content": "hello there world"}],
    )
    assert text == "echo: hello there world"
    assert calls == [] and finish == "stop"
    assert usage.prompt_tokens == 3 and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["sync", "stream"])
@pytest.mark.parametrize("model", UPSTREAMS)
def test_openai_client_tools(openai_client, model, stream):
    messages = [{"role": "user", "content": "weather in Paris?"}]
    text, calls, finish, _ = _openai_run(
        openai_client, stream, model=model, messages=messages, tools=[WEATHER_OPENAI]
    )
    assert finish == "tool_calls"
    assert len(calls) == 1
    call_id, name, args = calls[0]
    assert name == "get_weather" and args == {"city": "Paris", "unit": "celsius"} and call_id
    # Second turn: the tool result goes back and the model answers from it.
    messages += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(args)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "18C and sunny"},
    ]
    text, calls, finish, _ = _openai_run(
        openai_client, stream, model=model, messages=messages, tools=[WEATHER_OPENAI]
    )
    assert text == "tool said: 18C and sunny" and finish == "stop" and calls == []


@pytest.mark.parametrize("stream", [False, True], ids=["sync", "stream"])
@pytest.mark.parametrize("model", UPSTREAMS)
def test_openai_client_image(openai_client, model, stream):
    data, size = png_b64()
    content = [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
    ]
    text, _, finish, _ = _openai_run(
        openai_client, stream, model=model, messages=[{"role": "user", "content": content}]
    )
    assert text == f"image: image/png {size}" and finish == "stop"


# ---- Anthropic client ------------------------------------------------------------------------


def _anthropic_run(client, stream: bool, **kwargs):
    if not stream:
        return client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as s:
        events = [e.type for e in s]
        final = s.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "message_delta" in events
    return final


@pytest.mark.parametrize("stream", [False, True], ids=["sync", "stream"])
@pytest.mark.parametrize("model", UPSTREAMS)
def test_anthropic_client_text(anthropic_client, model, stream):
    msg = _anthropic_run(
        anthropic_client,
        stream,
        model=model,
        max_tokens=100,
        messages=[{"role": "user", "content": "hello there world"}],
    )
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == "echo: hello there world"
    assert msg.stop_reason == "end_turn"
    assert msg.usage.input_tokens == 3 and msg.usage.output_tokens > 0
    assert msg.model == model and msg.id.startswith("msg_")


@pytest.mark.parametrize("stream", [False, True], ids=["sync", "stream"])
@pytest.mark.parametrize("model", UPSTREAMS)
def test_anthropic_client_tools(anthropic_client, model, stream):
    messages = [{"role": "user", "content": "weather in Paris?"}]
    msg = _anthropic_run(
        anthropic_client,
        stream,
        model=model,
        max_tokens=100,
        messages=messages,
        tools=[WEATHER_ANTHROPIC],
    )
    assert msg.stop_reason == "tool_use"
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert len(uses) == 1
    assert uses[0].name == "get_weather" and uses[0].input == {"city": "Paris", "unit": "celsius"}
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": uses[0].id, "content": "18C and sunny"}
            ],
        },
    ]
    msg = _anthropic_run(
        anthropic_client,
        stream,
        model=model,
        max_tokens=100,
        messages=messages,
        tools=[WEATHER_ANTHROPIC],
    )
    assert msg.content[0].text == "tool said: 18C and sunny" and msg.stop_reason == "end_turn"


@pytest.mark.parametrize("stream", [False, True], ids=["sync", "stream"])
@pytest.mark.parametrize("model", UPSTREAMS)
def test_anthropic_client_image(anthropic_client, model, stream):
    data, size = png_b64()
    content = [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
        {"type": "text", "text": "what is this?"},
    ]
    msg = _anthropic_run(
        anthropic_client,
        stream,
        model=model,
        max_tokens=100,
        messages=[{"role": "user", "content": content}],
    )
    assert msg.content[0].text == f"image: image/png {size}"

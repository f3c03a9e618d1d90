"""`POST /v1/responses` with the official `openai` SDK, translated to an OpenAI-compatible chat
upstream and to Anthropic: what the upstream receives, and the parsed objects and events the SDK
gives back."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.fakes.script import TOOL_ARGUMENTS
from tests.gateway.protocol.samples import png_b64

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
    "required": ["city"],
}
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": WEATHER,
    }
]


def test_text_reply_to_a_chat_upstream(client, upstream):
    r = client.responses.create(
        model="oai",
        input="hello there",
        instructions="Be brief.",
        temperature=0.5,
        top_p=0.9,
        max_output_tokens=50,
        metadata={"tag": "a"},
    )
    assert r.output_text == "echo: hello there"
    assert r.status == "completed" and r.model == "oai" and r.id.startswith("resp_")
    assert (
        r.metadata == {"tag": "a"} and r.instructions == "Be brief." and r.max_output_tokens == 50
    )
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert (
        r.usage.input_tokens_details.cached_tokens == 0
        and r.usage.output_tokens_details.reasoning_tokens == 0
    )
    body = upstream["openai"].requests[-1].body
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello there"},
    ]
    assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0.5, 0.9, 50)
    assert "metadata" not in body


def test_stream_sends_every_event_in_order_with_sequence_numbers(client, upstream):
    with client.responses.stream(
        model="claude",
        input="[[think]] hi",
        reasoning={"effort": "low", "summary": "auto"},
        max_output_tokens=4000,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.reasoning_summary_part.added",
        *["response.reasoning_summary_text.delta"]
        * kinds.count("response.reasoning_summary_text.delta"),
        "response.reasoning_summary_text.done",
        "response.reasoning_summary_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * kinds.count("response.output_text.delta"),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert (
        "".join(e.delta for e in events if e.type == "response.output_text.delta")
        == "echo: [[think]] hi"
    )
    reasoning, message = final.output
    assert (
        reasoning.type == "reasoning"
        and reasoning.summary[0].text == "thinking about: [[think]] hi"
    )
    assert reasoning.encrypted_content  # Claude's signature: it must come back in the next turn
    assert message.type == "message" and final.output_text == "echo: [[think]] hi"
    assert events[-1].response.usage.output_tokens > 0
    assert upstream["anthropic"].requests[-1].body["thinking"] == {
        "type": "enabled",
        "budget_tokens": 1024,
    }


@pytest.mark.parametrize("model", ["oai", "claude"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_round_trip(client, upstream, model, stream):
    first = _create(
        client,
        stream,
        model=model,
        input="weather in Paris?",
        tools=TOOLS,
        parallel_tool_calls=False,
    )
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert (
        call.name == "get_weather"
        and json.loads(call.arguments) == TOOL_ARGUMENTS
        and call.status == "completed"
    )
    second = _create(
        client,
        stream,
        model=model,
        tools=TOOLS,
        input=[
            {"role": "user", "content": "weather in Paris?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"},
        ],
    )
    assert second.output_text == "tool said: 18 C"
    body = upstream["openai" if model == "oai" else "anthropic"].requests[-1].body
    if model == "oai":
        assert body["messages"][1]["tool_calls"][0]["id"] == call.call_id
        assert body["messages"][2] == {
            "role": "tool",
            "tool_call_id": call.call_id,
            "content": "18 C",
        }
    else:
        assert body["messages"][1]["content"][0]["type"] == "tool_use"
        result = body["messages"][2]["content"][0]
        assert (result["type"], result["tool_use_id"]) == ("tool_result", call.call_id)
        assert result["content"] == [{"type": "text", "text": "18 C"}]


def _create(client: openai.OpenAI, stream: bool, **kwargs):
    if not stream:
        return client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as s:
        for ev in s:
            if ev.type == "response.function_call_arguments.done":
                assert json.loads(ev.arguments) == TOOL_ARGUMENTS
        return s.get_final_response()


def test_parallel_tool_calls_false_reaches_each_upstream(client, upstream):
    client.responses.create(
        model="oai",
        input="weather?",
        tools=TOOLS,
        parallel_tool_calls=False,
        tool_choice="required",
    )
    assert upstream["openai"].requests[-1].body["parallel_tool_calls"] is False
    assert upstream["openai"].requests[-1].body["tool_choice"] == "required"
    client.responses.create(
        model="claude",
        input="weather?",
        tools=TOOLS,
        parallel_tool_calls=False,
        tool_choice={"type": "function", "name": "get_weather"},
    )
    assert upstream["anthropic"].requests[-1].body["tool_choice"] == {
        "type": "tool",
        "name": "get_weather",
        "disable_parallel_tool_use": True,
    }


def test_an_image_and_a_pdf_reach_anthropic_as_blocks(client, upstream):
    r = client.responses.create(
        model="claude",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "what is this?"},
                    {"type": "input_image", "image_url": "data:image/png;base64," + png_b64()},
                ],
            }
        ],
    )
    assert r.output_text.startswith("image: image/png")
    content = upstream["anthropic"].requests[-1].body["messages"][0]["content"]
    assert content[1]["type"] == "image" and content[1]["source"]["media_type"] == "image/png"
    client.responses.create(
        model="claude",
        input=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "input_file",
                        "filename": "a.pdf",
                        "file_data": "data:application/pdf;base64,JVBERi0xLjQKJSVFT0YK",
                    },
                    {"type": "input_text", "text": "summarise"},
                ],
            }
        ],
    )
    doc = upstream["anthropic"].requests[-1].body["messages"][0]["content"][0]
    assert doc["type"] == "document" and doc["source"]["data"] == "JVBERi0xLjQKJSVFT0YK"


def test_reasoning_items_come_back_to_claude_as_signed_thinking(client, upstream):
    first = client.responses.create(
        model="claude",
        input="[[think]] plan",
        reasoning={"effort": "low"},
        max_output_tokens=4000,
        include=["reasoning.encrypted_content"],
        store=False,
    )
    items = [o.model_dump(exclude_none=True) for o in first.output]
    client.responses.create(
        model="claude",
        input=[
            {"role": "user", "content": "[[think]] plan"},
            *items,
            {"role": "user", "content": "go on"},
        ],
        reasoning={"effort": "low"},
        max_output_tokens=4000,
    )
    assistant = upstream["anthropic"].requests[-1].body["messages"][1]
    assert assistant["role"] == "assistant"
    assert assistant["content"][0] == {
        "type": "thinking",
        "thinking": "thinking about: [[think]] plan",
        "signature": first.output[0].encrypted_content,
    }
    assert assistant["content"][1] == {"type": "text", "text": "echo: [[think]] plan"}


def test_json_schema_format_is_checked_as_chat_checks_it(client, upstream):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}}
    r = client.responses.create(model="claude", input="[[json]]", text=fmt)
    assert json.loads(r.output_text) == {"name": "Ada", "age": 36}
    with pytest.raises(openai.APIStatusError) as e:
        client.responses.create(model="claude", input="[[badjson]]", text=fmt)
    assert "schema" in e.value.message or "format" in e.value.message


def test_what_cannot_be_honoured_is_refused_by_name(client, upstream):
    for kwargs, named in [
        ({"tools": [{"type": "web_search"}]}, "web_search"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "file_search"),
        (
            {"input": [{"type": "computer_call_output", "call_id": "c", "output": {}}]},
            "computer_call_output",
        ),
        ({"background": True}, "background"),
        ({"include": ["message.output_text.logprobs"]}, "logprobs"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="oai", **{"input": "hi", **kwargs})
        assert named in e.value.message
    assert upstream["openai"].requests == []


def test_optimisation_hints_are_dropped_and_named(gateway, keys, upstream):
    body = {
        "model": "oai",
        "input": "hi",
        "prompt_cache_key": "k1",
        "client_metadata": {"a": "b"},
        "text": {"verbosity": "low"},
        "include": ["reasoning.encrypted_content", "web_search_call.results"],
    }
    r = httpx.post(
        gateway.url + "/v1/responses", json=body, headers={"authorization": f"Bearer {keys[0]}"}
    )
    assert r.status_code == 200, r.text
    request_fields = [
        n for n in r.headers["x-flashstack-dropped"].split(",") if not n.startswith("response.")
    ]
    assert request_fields == [
        "client_metadata",
        "include=web_search_call.results",
        "prompt_cache_key",
        "text.verbosity",
    ]
    # The chat completion's own fields that no Responses object carries are named too.
    assert "response.system_fingerprint" in r.headers["x-flashstack-dropped"].split(",")


def test_a_stream_names_what_it_dropped_in_its_final_event(gateway, keys, upstream):
    body = {"model": "oai", "input": "hi", "prompt_cache_key": "k1", "stream": True}
    headers = {"authorization": f"Bearer {keys[0]}"}
    with httpx.stream(
        "POST", gateway.url + "/v1/responses", json=body, headers=headers, timeout=20
    ) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    final = events[-1]
    assert final["type"] == "response.completed"
    # Complete at the end: the header went out before the upstream's last chunk (its usage,
    # its fingerprint).
    named = final["flashstack_dropped"].split(",")
    assert {"prompt_cache_key", "response.system_fingerprint"} <= set(named)
    assert set(r.headers["x-flashstack-dropped"].split(",")) <= set(named)
    assert "flashstack_dropped" not in final["response"]  # the stored object is the API's own
    stored = httpx.get(f"{gateway.url}/v1/responses/{final['response']['id']}", headers=headers)
    assert stored.status_code == 200 and "flashstack_dropped" not in stored.json()


def test_malformed_requests_get_openai_errors(gateway, keys, upstream):
    auth = {"authorization": f"Bearer {keys[0]}"}
    for body, param in [
        ({"model": "oai"}, "input"),
        ({"model": "oai", "input": 5}, "input"),
        ({"model": "oai", "input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"model": "oai", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"model": "nope", "input": "x"}, "model"),
    ]:
        r = httpx.post(gateway.url + "/v1/responses", json=body, headers=auth)
        assert r.status_code in (400, 404), r.text
        assert r.json()["error"]["param"].startswith(param), r.text
    assert upstream["openai"].requests == []


@pytest.mark.parametrize("stream", [False, True])
def test_a_namespaced_tool_is_called_back_with_its_namespace(client, upstream, stream):
    agents = {
        "type": "namespace",
        "name": "agents",
        "description": "sub-agents",
        "tools": [{"type": "function", "name": "spawn", "parameters": WEATHER}],
    }
    r = _create(client, stream, model="claude", input="go", tools=[agents, *TOOLS])
    assert upstream["anthropic"].requests[-1].body["tools"][0]["name"] == "agents__spawn"
    (call,) = [o.model_dump() for o in r.output if o.type == "function_call"]
    assert (call["namespace"], call["name"]) == ("agents", "spawn")
    nxt = client.responses.create(
        model="claude",
        tools=[agents],
        input=[
            {"role": "user", "content": "go"},
            {k: call[k] for k in ("type", "call_id", "name", "namespace", "arguments")},
            {"type": "function_call_output", "call_id": call["call_id"], "output": "spawned"},
        ],
    )
    assert nxt.output_text == "tool said: spawned"
    assert (
        upstream["anthropic"].requests[-1].body["messages"][1]["content"][0]["name"]
        == "agents__spawn"
    )

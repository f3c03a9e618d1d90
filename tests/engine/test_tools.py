"""Tool calling: the parsers turn Hermes `<tool_call>` and Llama-3 JSON output into OpenAI
`tool_calls`, the same whole and streamed; `flashstack engine serve` on the trained SmolLM2
answers a forced tool call (named or required) with `tool_calls`, streamed as argument deltas."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from flashstack.engine.server_tools import plan_tools
from flashstack.engine.tool_parsers import ToolCallStream, merge, parse
from tests.engine.served import KEY, Served

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
HERMES = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris {x}"}}\n'
    '</tool_call>\n<tool_call>{"arguments": {"zone": "UTC"}, "name": "get_time"}</tool_call>'
)
LLAMA3 = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "a\\"}"}}; '
    '{"name": "get_time", "parameters": {}}'
)


def _streamed(text: str, style: str) -> tuple[str, list, int]:
    s, content, pieces = ToolCallStream(style), "", []
    for ch in text:  # one character at a time: the worst split a detokenizer can make
        c, p = s.feed(ch)
        content, pieces = content + c, pieces + p
    c, p = s.finish()
    return content + c, merge(pieces + p), len(pieces + p)


@pytest.mark.parametrize(
    ("text", "style", "content", "calls"),
    [
        (
            HERMES,
            "hermes",
            "Let me check.",
            [("get_weather", {"city": "Paris {x}"}), ("get_time", {"zone": "UTC"})],
        ),
        (LLAMA3, "llama3_json", None, [("get_weather", {"city": 'a"}'}), ("get_time", {})]),
        (
            '[{"name": "get_time", "parameters": {"zone": "CET"}}]',
            "json_list",
            None,
            [("get_time", {"zone": "CET"})],
        ),
        ("No tools needed {here}.", "llama3_json", "No tools needed {here}.", []),
        (
            "<tool_call>not json</tool_call> done",
            "hermes",
            "<tool_call>not json</tool_call> done",
            [],
        ),
    ],
)
def test_parsers_whole_and_streamed_agree(text, style, content, calls) -> None:
    whole = parse(text, style)
    assert whole.content == content
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole.calls
    ] == calls
    s_content, s_calls, _ = _streamed(text, style)
    assert (s_content.strip() or None) == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in s_calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole.calls
    ]


def test_streamed_arguments_arrive_in_pieces() -> None:
    _, calls, n = _streamed(HERMES, "hermes")
    assert len(calls) == 2 and n > 10  # names first, then the arguments a character at a time


def test_tools_reach_the_prompt() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    # A template that renders `tools` gets them; one that ignores them gets a Hermes system prompt.
    own = plan_tools([WEATHER], None, "{% for t in tools %}{{ t }}{% endfor %}")
    assert own.mode == "auto" and own.prompt(msgs, "{{ tools }}") == (msgs, [WEATHER])
    shown, tools = plan_tools([WEATHER], "auto", "{{ messages }}").prompt(msgs, "{{ messages }}")
    assert tools is None and shown[0]["role"] == "system" and "get_weather" in shown[0]["content"]
    assert shown[1:] == msgs
    assert plan_tools([WEATHER], "none", None).prompt(msgs, None) == (msgs, None)
    assert plan_tools([WEATHER], None, "<|python_tag|> ipython").style == "llama3_json"


@pytest.fixture(scope="module")
def client(smol: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=smol.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _ask(client: openai.OpenAI, **kw):
    kw = {"temperature": 0, "max_tokens": 30, "tools": [WEATHER, TIME], **kw}
    return client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "What is the weather in Paris?"}], **kw
    )


def test_named_tool_choice_parses_into_tool_calls(client) -> None:
    r = _ask(client, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_required_tool_choice_streams_argument_deltas(client) -> None:
    chunks = list(_ask(client, tool_choice="required", stream=True))
    pieces = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert pieces and pieces[0].function.name in ("get_weather", "get_time") and pieces[0].id
    args: dict[int, str] = {}
    for p in pieces:
        args[p.index] = args.get(p.index, "") + (p.function.arguments or "")
    assert sum(1 for p in pieces if p.function.arguments) >= 2  # deltas, not one blob
    by_name = {"get_weather": WEATHER, "get_time": TIME}
    names = {p.index: p.function.name for p in pieces if p.function.name}
    for i, text in args.items():
        jsonschema.validate(json.loads(text), by_name[names[i]]["function"]["parameters"])
    assert [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ] == ["tool_calls"]


def test_tool_choice_none_answers_in_text(client) -> None:
    r = _ask(client, tool_choice="none", max_tokens=5)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
        ({"tool_choice": "sometimes"}, "tool_choice must be"),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "already constrains",
        ),
    ],
)
def test_bad_tool_choice_is_400(client, kw, needle) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        _ask(client, **kw)
    assert needle in err.value.body["message"]

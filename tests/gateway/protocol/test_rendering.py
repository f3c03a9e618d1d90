"""What the translators render for messages the gateway makes itself (a session's history), beside a
client's own: the first as plain strings every server takes, the second as the client sent it."""

from __future__ import annotations

from flashstack.gateway.core import ChatRequest, Message, Text, ToolResult
from flashstack.gateway.translate import anthropic, openai


def _request(wire: str, *messages: Message) -> ChatRequest:
    return ChatRequest(model="m", messages=list(messages), wire=wire, extra={"max_tokens": 8})


def test_history_goes_to_openai_as_strings():
    history = [
        Message("user", [Text("a"), Text("b")]),
        Message("user", [ToolResult("call_1", [Text("18 C")])]),
    ]
    # the client sent [{"type": "text", "text": "c"}]
    own = Message("user", [Text("c")], plain=False)
    body = openai.request_json(_request("openai", *history, own), "up")
    assert body["messages"] == [
        {"role": "user", "content": "ab"},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "user", "content": [{"type": "text", "text": "c"}]},
    ]


def test_history_goes_to_anthropic_as_blocks_or_a_string():
    body = anthropic.request_json(
        _request(
            "anthropic", Message("user", [Text("a")]), Message("assistant", [Text("b"), Text("c")])
        ),
        "up",
    )
    assert body["messages"] == [
        {"role": "user", "content": "a"},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "b"}, {"type": "text", "text": "c"}],
        },
    ]

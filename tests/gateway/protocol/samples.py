"""Requests and responses that carry every documented field of each API (and a field
from the future)."""

from __future__ import annotations

import base64
import inspect
import io

import anthropic
from PIL import Image as PILImage

from flashstack.gateway.translate import fields

FUTURE = {"x_future_field": {"nested": [1, 2.5, None, "s"]}}


def png_b64() -> str:
    buf = io.BytesIO()
    PILImage.new("RGB", (8, 8), (200, 30, 30)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _samples(table: tuple[fields.Field, ...]) -> dict:
    return {
        f.name: f.sample for f in table if f.sample is not None and f.same is fields.Fate.PASSED
    }


# ---- OpenAI --------------------------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": fields.WEATHER,
        "strict": True,
    },
}


def openai_messages() -> list[dict]:
    return [
        {"role": "developer", "content": "Be terse.", "name": "ops"},
        {"role": "system", "content": [{"type": "text", "text": "Answer in JSON."}]},
        {"role": "user", "content": "Weather in Paris?", "name": "ada"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
        {"role": "assistant", "content": "It is sunny.", "refusal": None},
        {
            "role": "developer",
            "content": [{"type": "text", "text": "Now be verbose."}],
            "name": "ops",
        },
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "And this picture?"},
                {
                    "type": "image_url",
                    "image_url": {"url": "data:image/png;base64," + png_b64(), "detail": "low"},
                },
            ],
        },
    ]


def openai_request() -> dict:
    """Keyword arguments for client.chat.completions.create: every field (and one
    from the future)."""
    body = _samples(fields.OPENAI_REQUEST)
    # Fields the SDK names but the table samples leave alone, or that conflict with
    # the samples above.
    for name in ("functions", "function_call", "web_search_options", "audio", "modalities"):
        body.pop(name, None)
    body["tools"] = [WEATHER_TOOL]
    body["tool_choice"] = {"type": "function", "function": {"name": "get_weather"}}
    body["response_format"] = {"type": "json_object"}
    return {"messages": openai_messages(), **body}


OPENAI_USAGE = {
    "prompt_tokens": 120,
    "completion_tokens": 9,
    "total_tokens": 129,
    "prompt_tokens_details": {"cached_tokens": 100, "audio_tokens": 0},
    "completion_tokens_details": {
        "reasoning_tokens": 3,
        "audio_tokens": 0,
        "accepted_prediction_tokens": 1,
        "rejected_prediction_tokens": 0,
    },
}
LOGPROBS = {
    "content": [
        {
            "token": "{",
            "logprob": -0.01,
            "bytes": [123],
            "top_logprobs": [{"token": "{", "logprob": -0.01, "bytes": [123]}],
        }
    ],
    "refusal": None,
}


def openai_response() -> dict:
    return {
        "id": "chatcmpl-canned1",
        "object": "chat.completion",
        "created": 1760000000,
        "model": "gpt-upstream-1",
        "system_fingerprint": "fp_canned",
        "service_tier": "default",
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "logprobs": LOGPROBS,
                "message": {
                    "role": "assistant",
                    "content": '{"a": 1}',
                    "refusal": None,
                    "annotations": [],
                    "x_message_future": True,
                },
            }
        ],
        "usage": OPENAI_USAGE,
        **FUTURE,
    }


def openai_events() -> list[tuple[str, dict]]:
    base = {
        "id": "chatcmpl-canned2",
        "object": "chat.completion.chunk",
        "created": 1760000001,
        "model": "gpt-upstream-1",
        "system_fingerprint": "fp_canned",
        "service_tier": "default",
        "usage": None,
    }

    def chunk(delta: dict, finish: str | None = None, logprobs=None, **more) -> tuple[str, dict]:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        return "", {**base, "choices": [choice], "obfuscation": "x1", **more}

    return [
        chunk({"role": "assistant", "content": "", "refusal": None}),
        chunk({"content": '{"a"'}, logprobs=LOGPROBS),
        chunk({"content": ": 1}"}),
        chunk({}, "stop"),
        ("", {**base, "choices": [], "usage": OPENAI_USAGE}),
    ]


# ---- Anthropic -----------------------------------------------------------------------------------

CACHE = {"type": "ephemeral"}
CACHE_1H = {"type": "ephemeral", "ttl": "1h"}
PDF = base64.b64encode(b"%PDF-1.4\n1 0 obj<<>>endobj\ntrailer<<>>\n%%EOF").decode()


def anthropic_messages() -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Read this.", "cache_control": CACHE},
                {
                    "type": "document",
                    "source": {"type": "base64", "media_type": "application/pdf", "data": PDF},
                    "title": "doc",
                    "citations": {"enabled": True},
                    "cache_control": CACHE,
                },
                {
                    "type": "image",
                    "source": {"type": "base64", "media_type": "image/png", "data": png_b64()},
                },
            ],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Let me look.", "signature": "EqQBCkYsig"},
                {"type": "redacted_thinking", "data": "EmwKAhgBEgy"},
                {
                    "type": "text",
                    "text": "Checking the weather.",
                    "citations": [
                        {
                            "type": "char_location",
                            "cited_text": "Read",
                            "document_index": 0,
                            "document_title": "doc",
                            "start_char_index": 0,
                            "end_char_index": 4,
                        }
                    ],
                },
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                    "cache_control": CACHE,
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "is_error": False,
                    "cache_control": CACHE_1H,
                    "content": [{"type": "text", "text": "18 C"}],
                },
                {"type": "text", "text": "Thanks; summarise."},
            ],
        },
    ]


def anthropic_request() -> dict:
    """Keyword arguments for client.messages.create: every field (and, in
    extra_body, newer ones)."""
    body = _samples(fields.ANTHROPIC_REQUEST)
    body["system"] = [
        {"type": "text", "text": "You are terse.", "cache_control": CACHE},
        {"type": "text", "text": "Cite sources."},
    ]
    body["tools"] = [
        {
            "name": "get_weather",
            "description": "Weather in a city",
            "input_schema": fields.WEATHER,
            "cache_control": CACHE,
        },
        {
            "name": "get_time",
            "description": "Time in a city",
            "input_schema": fields.WEATHER,
            "defer_loading": True,
        },
    ]
    body["tool_choice"] = {"type": "auto", "disable_parallel_tool_use": True}
    body.pop("temperature")  # thinking takes the default temperature
    body.pop("cache_control")  # automatic caching besides the explicit markers: one or the other
    body["output_config"] = {"effort": "high"}
    # What this SDK version has no keyword for goes in extra_body, as a user of it would send it.
    known = set(inspect.signature(anthropic.resources.Messages.create).parameters)
    extra_body = {k: body.pop(k) for k in list(body) if k not in known}
    return {"messages": anthropic_messages(), **body, "extra_body": {**extra_body, **FUTURE}}


REFUSED_ANTHROPIC = tuple(
    f.name for f in fields.ANTHROPIC_REQUEST if f.cross is fields.Fate.REFUSED
)

ANTHROPIC_USAGE = {
    "input_tokens": 20,
    "output_tokens": 9,
    "cache_creation_input_tokens": 50,
    "cache_read_input_tokens": 1000,
    "cache_creation": {"ephemeral_5m_input_tokens": 50, "ephemeral_1h_input_tokens": 0},
    "server_tool_use": {"web_search_requests": 0},
    "service_tier": "standard",
}


def anthropic_response() -> dict:
    return {
        "id": "msg_canned1",
        "type": "message",
        "role": "assistant",
        "model": "claude-upstream-1",
        "content": [
            {"type": "thinking", "thinking": "Short.", "signature": "EqQBsig2"},
            {"type": "redacted_thinking", "data": "EmwKredacted"},
            {"type": "text", "text": '{"sunny": true}', "citations": None},
            {"type": "tool_use", "id": "toolu_2", "name": "get_time", "input": {"city": "Paris"}},
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": ANTHROPIC_USAGE,
        "container": None,
        "context_management": {"applied_edits": []},
    }


def anthropic_events() -> list[tuple[str, dict]]:
    start = anthropic_response() | {
        "content": [],
        "stop_reason": None,
        "usage": {**ANTHROPIC_USAGE, "output_tokens": 1},
    }

    def delta(i: int, d: dict) -> tuple[str, dict]:
        return "content_block_delta", {"type": "content_block_delta", "index": i, "delta": d}

    return [
        ("message_start", {"type": "message_start", "message": start}),
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "thinking", "thinking": "", "signature": ""},
            },
        ),
        ("ping", {"type": "ping"}),
        delta(0, {"type": "thinking_delta", "thinking": "Short."}),
        delta(0, {"type": "signature_delta", "signature": "EqQBsig2"}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 1,
                "content_block": {"type": "redacted_thinking", "data": "EmwKredacted"},
            },
        ),
        ("content_block_stop", {"type": "content_block_stop", "index": 1}),
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 2,
                "content_block": {"type": "text", "text": "", "citations": None},
            },
        ),
        delta(2, {"type": "text_delta", "text": '{"sunny": true}'}),
        ("content_block_stop", {"type": "content_block_stop", "index": 2}),
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 3,
                "content_block": {
                    "type": "tool_use",
                    "id": "toolu_2",
                    "name": "get_time",
                    "input": {},
                },
            },
        ),
        delta(3, {"type": "input_json_delta", "partial_json": '{"city": '}),
        delta(3, {"type": "input_json_delta", "partial_json": '"Paris"}'}),
        ("content_block_stop", {"type": "content_block_stop", "index": 3}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                "usage": {**ANTHROPIC_USAGE, "output_tokens": 9},
                "context_management": {"applied_edits": []},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]

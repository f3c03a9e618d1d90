"""Every documented field of both APIs, and what happens to it on each path through the gateway.

One table per API and direction. The translators read it for the fields the canonical types do not
model (refuse, drop-and-name), docs/protocols.md is rendered from it (`python -m
flashstack.gateway.translate.fields`), and tests/gateway/protocol/ is generated from it: the doc,
the code and the tests cannot drift apart.
"""

from __future__ import annotations

import enum
import re
import sys
from dataclasses import dataclass
from typing import Any

import orjson

from flashstack.gateway.core import ChatRequest, invalid_request


class Fate(enum.StrEnum):
    PASSED = "passed"  # sent on as the client sent it (JSON value equal)
    MAPPED = "mapped"  # sent as its counterpart on the other wire
    # 400 naming the field: the client relies on it, the target cannot honour it
    REFUSED = "refused"
    DROPPED = "dropped"  # not sent, and named in the response header x-flashstack-dropped
    GATEWAY = "gateway"  # the gateway's own field: read here, never sent upstream


@dataclass(frozen=True, slots=True)
class Field:
    """One wire field: `same` on the same-wire path, `cross` on the path to the other wire."""

    name: str  # the JSON path, [] for list items
    cross: Fate
    to: str = ""  # the counterpart (mapped) or why (refused, dropped)
    sample: Any = None  # a value tests send (top-level request fields)
    harmless: tuple[Any, ...] = ()  # values that ask for nothing: treated as absent across wires
    same: Fate = Fate.PASSED
    same_note: str = ""
    named: bool = True  # response rows: False for a dropped field that carries nothing (not named)


F, P, M, R, D, G = Field, Fate.PASSED, Fate.MAPPED, Fate.REFUSED, Fate.DROPPED, Fate.GATEWAY
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}

# ---- requests: top-level fields, then the parts of messages and tools ----------------------------

OPENAI_REQUEST: tuple[Field, ...] = (
    F("model", M, "model", same=M, same_note="renamed to the deployment's model"),
    F("messages", M, "messages, system"),
    F("max_tokens", M, "max_tokens", 64),
    F("max_completion_tokens", M, "max_tokens", 64),
    F("temperature", M, "temperature (capped at 1)", 0.5),
    F("top_p", M, "top_p", 0.9),
    F("n", R, "one choice only", 2, harmless=(1,)),
    F("stop", M, "stop_sequences", ["\n\nEND"]),
    F("stream", M, "stream", False),
    F(
        "stream_options",
        M,
        "usage is always asked for; sent to the client only when it asked",
        {"include_usage": True},
        same_note="include_usage: true is added (usage accounting); the usage "
        "chunk reaches the client only when it asked",
    ),
    F(
        "tools",
        M,
        "tools",
        [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}],
    ),
    F("tool_choice", M, "tool_choice", "auto"),
    F("parallel_tool_calls", M, "tool_choice.disable_parallel_tool_use", True),
    F(
        "response_format",
        M,
        "an instruction in system; the reply is checked",
        {"type": "json_object"},
    ),
    F("user", M, "metadata.user_id", "user-1234"),
    F("metadata", D, "Anthropic's metadata takes user_id only", {"tag": "a"}),
    F("seed", D, "no seed on the Messages API", 7),
    F("presence_penalty", D, "no penalties on the Messages API", 0.5, harmless=(0, 0.0)),
    F("frequency_penalty", D, "no penalties on the Messages API", 0.5, harmless=(0, 0.0)),
    F("logprobs", R, "the Messages API returns no log-probabilities", True, harmless=(False,)),
    F("top_logprobs", R, "the Messages API returns no log-probabilities", 2, harmless=(0,)),
    F("logit_bias", R, "the Messages API cannot bias tokens", {"50256": -100}, harmless=({},)),
    F("store", D, "nothing to store on the Messages API", False),
    F(
        "reasoning_effort",
        M,
        "thinking.budget_tokens (low 1024, medium 4096, high 16384; dropped when "
        "max_tokens leaves no room)",
        "low",
    ),
    F("service_tier", D, "OpenAI's tiers have no Anthropic counterpart", "auto"),
    F(
        "prediction",
        D,
        "predicted outputs are only a latency optimisation",
        {"type": "content", "content": "a"},
    ),
    F("prompt_cache_key", D, "prompt caching hint", "k1"),
    F("safety_identifier", D, "no counterpart", "s1"),
    F("verbosity", D, "no counterpart", "low"),
    F("modalities", R, "text only on the Messages API", ["text", "audio"], harmless=(["text"],)),
    F("audio", R, "no audio output on the Messages API", {"voice": "alloy", "format": "wav"}),
    F("web_search_options", R, "use Anthropic's web_search server tool instead", {}),
    F("functions", R, "deprecated; send tools", [{"name": "f", "parameters": WEATHER}]),
    F("function_call", R, "deprecated; send tool_choice", "auto"),
    F(
        "compression",
        G,
        "flashstack's context compression",
        same=G,
        same_note="read by the gateway",
    ),
)
# `same`: to a model whose every deployment serves the Responses API itself (`responses_api: true`);
# `cross`: through the canonical types to any other (an Anthropic, chat-completions or local model).
RESPONSES_REQUEST: tuple[Field, ...] = (
    F(
        "model",
        M,
        "model (renamed to the deployment's)",
        same=M,
        same_note="renamed to the deployment's model",
    ),
    F(
        "input",
        M,
        "messages (message, function_call, function_call_output and reasoning items; "
        "other item types refused)",
        "hi",
    ),
    F("instructions", M, "system", "Be brief."),
    F(
        "tools",
        M,
        "tools (function tools; a namespace's functions as <namespace>__<name>, their calls "
        "returned with `namespace`; hosted tools such as web_search are refused by name)",
        [{"type": "function", "name": "get_weather", "parameters": WEATHER}],
    ),
    F("tool_choice", M, "tool_choice (required → any; a hosted tool refused)", "auto"),
    F(
        "parallel_tool_calls",
        M,
        "tool_choice.disable_parallel_tool_use / parallel_tool_calls",
        False,
    ),
    F("max_output_tokens", M, "max_tokens", 64),
    F("temperature", M, "temperature", 0.5),
    F("top_p", M, "top_p", 0.9),
    F(
        "text",
        M,
        "format → response_format (json_schema checked as chat's is); verbosity dropped, "
        "named text.verbosity",
        {"format": {"type": "json_object"}},
    ),
    F(
        "reasoning",
        M,
        "effort → reasoning effort / thinking budget; thinking comes back as reasoning items "
        "with a summary_text (its signature in encrypted_content)",
        {"effort": "low", "summary": "auto"},
    ),
    F("stream", M, "stream (the full Responses event sequence, numbered)", False),
    F("user", M, "metadata.user_id / user", "user-1234"),
    F(
        "metadata",
        G,
        "kept on the stored response and echoed back; never sent upstream",
        {"tag": "a"},
    ),
    F(
        "store",
        G,
        "the gateway's response store (fs_responses): GET/DELETE /v1/responses/{id}",
        False,
        same_note="and kept by the gateway too",
    ),
    F(
        "previous_response_id",
        G,
        "the stored response's input and output are prepended (the caller's own responses only)",
        same=G,
        same_note="expanded into `input` (the upstream does not know the gateway's ids)",
    ),
    F(
        "include",
        G,
        "reasoning.encrypted_content honoured; message.output_text.logprobs refused; others "
        "dropped, named include=<value>",
        ["reasoning.encrypted_content"],
    ),
    F("prompt_cache_key", D, "a prompt-caching hint", "k1"),
    F("client_metadata", D, "a client's own tags (Codex CLI)", {"a": "b"}),
    F("service_tier", D, "OpenAI's tiers", "auto"),
    F("safety_identifier", D, "no counterpart", "s1"),
    F(
        "truncation",
        D,
        "the gateway's own compression applies instead",
        "auto",
        harmless=("disabled",),
    ),
    F("stream_options", D, "obfuscation padding only", {"include_obfuscation": False}),
    F("max_tool_calls", R, "a hosted tools' limit", 2),
    F("top_logprobs", R, "log-probabilities are not returned", 2, harmless=(0,)),
    F("background", R, "background responses need OpenAI's queue", True, harmless=(False,)),
    F(
        "conversation",
        R,
        "OpenAI's conversations; use previous_response_id or /v1/sessions",
        "conv_1",
    ),
    F("prompt", R, "reusable prompts live in OpenAI's dashboard", {"id": "pmpt_1"}),
    F(
        "compression",
        G,
        "flashstack's context compression",
        same=G,
        same_note="read by the gateway",
    ),
)
RESPONSES_BY_NAME = {f.name: f for f in RESPONSES_REQUEST}

# Part rows' samples are body fragments (messages, system, tools) that carry the part.
# 1x1
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
PDF_B64 = "JVBERi0xLjQKJSVFT0YK"  # "%PDF-1.4\n%%EOF\n"
HI = {"role": "user", "content": "hi"}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}


def _o(*content: dict) -> dict:
    return {"messages": [{"role": "user", "content": list(content)}]}


OPENAI_PARTS: tuple[Field, ...] = (
    F(
        "messages[].role=developer",
        M,
        "system",
        {"messages": [{"role": "developer", "content": "Be brief."}, HI]},
    ),
    F(
        "messages[].role=system",
        M,
        "system (one after the first turn joins it too)",
        {"messages": [HI, {"role": "system", "content": "Be brief."}]},
    ),
    F(
        "messages[role=system].content[]",
        M,
        "a system text block each (cache_control kept)",
        {
            "messages": [
                {
                    "role": "developer",
                    "content": [
                        {"type": "text", "text": "Be brief."},
                        {"type": "text", "text": "Cite.", "cache_control": {"type": "ephemeral"}},
                    ],
                },
                HI,
            ]
        },
    ),
    F(
        "messages[].name",
        D,
        "no participant names on the Messages API",
        {"messages": [{"role": "user", "content": "hi", "name": "ada"}]},
    ),
    F("messages[].content[].type=text", M, "text block", _o({"type": "text", "text": "hi"})),
    F(
        "messages[].content[].type=image_url",
        M,
        "image block (base64 or url source)",
        _o({"type": "image_url", "image_url": {"url": "data:image/png;base64," + PNG}}),
    ),
    F(
        "messages[].content[].image_url.detail",
        D,
        "no detail level on the Messages API",
        _o(
            {
                "type": "image_url",
                "image_url": {"url": "data:image/png;base64," + PNG, "detail": "low"},
            }
        ),
    ),
    F(
        "messages[].content[].type=refusal",
        M,
        "text block",
        {
            "messages": [
                HI,
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
                HI,
            ]
        },
    ),
    F(
        "messages[].content[].type=input_audio",
        R,
        "no audio input on the Messages API",
        _o({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}),
    ),
    F(
        "messages[].content[].type=file",
        M,
        "document block (a PDF in file_data; a file_id is refused: OpenAI's file storage)",
        _o(
            {
                "type": "file",
                "file": {
                    "filename": "a.pdf",
                    "file_data": "data:application/pdf;base64," + PDF_B64,
                },
            }
        ),
    ),
    F(
        "messages[].tool_calls[]",
        M,
        "tool_use block",
        {
            "messages": [
                HI,
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
            ]
        },
    ),
    F(
        "messages[].role=tool",
        M,
        "tool_result block",
        {
            "messages": [
                HI,
                {"role": "assistant", "tool_calls": [CALL]},
                {
                    "role": "tool",
                    "tool_call_id": "call_1",
                    "content": [{"type": "text", "text": "18 C"}],
                },
            ]
        },
    ),
    F(
        "tools[].function.strict",
        D,
        "strict tool schemas are not sent across",
        {
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "parameters": WEATHER, "strict": True},
                }
            ]
        },
    ),
    F(
        "tools[].type=custom",
        R,
        "custom (free-text) tools have no counterpart",
        {"tools": [{"type": "custom", "custom": {"name": "grep"}}]},
    ),
)

ANTHROPIC_REQUEST: tuple[Field, ...] = (
    F("model", M, "model", same=M, same_note="renamed to the deployment's model"),
    F("messages", M, "messages"),
    F("max_tokens", M, "max_tokens", 64),
    F("system", M, "a system message", "Be brief."),
    F("stop_sequences", M, "stop", ["\n\nEND"]),
    F("stream", M, "stream (with stream_options.include_usage)", False),
    F("temperature", M, "temperature", 0.5),
    F("top_p", M, "top_p", 0.9),
    F("top_k", D, "OpenAI's API has no top_k", 40),
    F("tools", M, "tools[].function", [{"name": "get_weather", "input_schema": WEATHER}]),
    F("tool_choice", M, "tool_choice (any → required)", {"type": "auto"}),
    F("metadata", M, "user (from metadata.user_id)", {"user_id": "user-1234"}),
    F(
        "thinking",
        D,
        "reasoning is configured per model on OpenAI-compatible servers",
        {"type": "enabled", "budget_tokens": 1024},
        harmless=({"type": "disabled"},),
    ),
    F(
        "context_management",
        D,
        "context editing is only an optimisation",
        {"edits": [{"type": "clear_tool_uses_20250919"}]},
    ),
    F("service_tier", D, "Anthropic's tiers have no OpenAI counterpart", "auto"),
    F("cache_control", D, "prompt caching is Anthropic's", {"type": "ephemeral"}),
    F(
        "output_config",
        M,
        "format (json_schema) → response_format, the reply checked; effort and the rest "
        "dropped and named as output_config.<key>",
        {"format": {"type": "json_schema", "schema": {"type": "object"}}},
    ),
    F("inference_geo", D, "no counterpart", "us"),
    F("speed", D, "no counterpart", "fast"),
    F("container", R, "containers exist only on the Messages API", "container_1"),
    F(
        "mcp_servers",
        R,
        "the MCP connector exists only on the Messages API",
        [{"type": "url", "url": "https://example.com/sse", "name": "x"}],
    ),
    F(
        "compression",
        G,
        "flashstack's context compression",
        same=G,
        same_note="read by the gateway",
    ),
)
CACHED = {"type": "ephemeral"}
TOOL = {"name": "get_weather", "input_schema": WEATHER}
CITATION = [
    {
        "type": "char_location",
        "cited_text": "a",
        "document_index": 0,
        "start_char_index": 0,
        "end_char_index": 1,
    }
]


def _a(*content: dict) -> dict:
    return {"messages": [{"role": "user", "content": list(content)}]}


def _after_tool_use(*result: dict) -> dict:
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    return {
        "messages": [
            HI,
            {"role": "assistant", "content": [use]},
            {"role": "user", "content": list(result)},
        ]
    }


def _thought(block: dict) -> dict:
    return {
        "messages": [
            HI,
            {"role": "assistant", "content": [block, {"type": "text", "text": "Hello."}]},
            HI,
        ]
    }


ANTHROPIC_PARTS: tuple[Field, ...] = (
    F(
        "system[].cache_control",
        D,
        "prompt caching is Anthropic's",
        {"system": [{"type": "text", "text": "Be brief.", "cache_control": CACHED}]},
    ),
    F(
        "system[].citations",
        D,
        "no citations on OpenAI's API",
        {"system": [{"type": "text", "text": "Be brief.", "citations": CITATION}]},
    ),
    F(
        "messages[].role=system",
        M,
        "a system message where it stands",
        {"messages": [HI, {"role": "system", "content": "Be brief."}, HI]},
    ),
    F("messages[].content[].type=text", M, "text part", _a({"type": "text", "text": "hi"})),
    F(
        "messages[].content[].type=image",
        M,
        "image_url part (data: URL or url)",
        _a({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}),
    ),
    F(
        "messages[].content[].type=tool_use",
        M,
        "assistant tool_calls[]",
        _after_tool_use({"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"}),
    ),
    F(
        "messages[].content[].type=tool_result",
        M,
        "a tool message",
        _after_tool_use(
            {
                "type": "tool_result",
                "tool_use_id": "toolu_1",
                "content": [{"type": "text", "text": "18 C"}],
            }
        ),
    ),
    F(
        "messages[].content[].is_error",
        D,
        "tool messages carry no error flag",
        _after_tool_use(
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "failed", "is_error": True}
        ),
    ),
    F(
        "messages[].content[].type=thinking",
        D,
        "an earlier turn's reasoning, signed for Claude only",
        _thought({"type": "thinking", "thinking": "Hm.", "signature": "EqQBsig"}),
    ),
    F(
        "messages[].content[].type=redacted_thinking",
        D,
        "encrypted reasoning, readable by Claude only",
        _thought({"type": "redacted_thinking", "data": "EmwKredacted"}),
    ),
    F(
        "messages[].content[].type=document",
        M,
        "file part (a base64 PDF; a text document as a text part; "
        "url and file sources are refused: no counterpart)",
        _a(
            {
                "type": "document",
                "source": {"type": "base64", "media_type": "application/pdf", "data": PDF_B64},
            }
        ),
    ),
    F(
        "messages[].content[].type=search_result",
        R,
        "no counterpart",
        _a(
            {
                "type": "search_result",
                "source": "https://example.com",
                "title": "t",
                "content": [{"type": "text", "text": "a"}],
            }
        ),
    ),
    F(
        "messages[].content[].type=server_tool_use",
        R,
        "server tools run on Anthropic's side",
        {
            "messages": [
                HI,
                {
                    "role": "assistant",
                    "content": [
                        {
                            "type": "server_tool_use",
                            "id": "srvtoolu_1",
                            "name": "web_search",
                            "input": {"query": "a"},
                        }
                    ],
                },
                HI,
            ]
        },
    ),
    F(
        "messages[].content[].cache_control",
        D,
        "prompt caching is Anthropic's",
        _a({"type": "text", "text": "hi", "cache_control": CACHED}),
    ),
    F(
        "messages[].content[].citations",
        D,
        "no citations on OpenAI's API",
        {
            "messages": [
                HI,
                {
                    "role": "assistant",
                    "content": [{"type": "text", "text": "a", "citations": CITATION}],
                },
                HI,
            ]
        },
    ),
    F(
        "tools[].cache_control",
        D,
        "prompt caching is Anthropic's",
        {"tools": [{**TOOL, "cache_control": CACHED}]},
    ),
    F(
        "tools[].defer_loading",
        D,
        "tool search is Anthropic's",
        {"tools": [{**TOOL, "defer_loading": True}]},
    ),
    F(
        "tools[].strict",
        D,
        "strict tool schemas are not sent across",
        {"tools": [{**TOOL, "strict": True}]},
    ),
    F(
        "tools[].type=web_search_20250305",
        R,
        "server tools run on Anthropic's side",
        {"tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 1}]},
    ),
)

# ---- responses ----------------------------------------------------------------------------------

OPENAI_RESPONSE: tuple[Field, ...] = (
    F("id", M, "id (msg_…)"),
    F("model", M, "model", same=M, same_note="renamed to the model the client asked for"),
    F("created", D, "Messages responses carry no timestamp", named=False),
    F("obfuscation", D, "stream padding", named=False),
    F("choices[0].message.content", M, "text block"),
    F("choices[0].message.tool_calls[]", M, "tool_use blocks"),
    F("choices[0].message.reasoning_content", M, "thinking block (no signature)"),
    F(
        "choices[0].message.refusal",
        D,
        "stop_reason refusal when finish_reason is content_filter",
        "No.",
    ),
    F(
        "choices[0].message.annotations",
        D,
        "no counterpart",
        [{"type": "url_citation", "url_citation": {"url": "https://example.com", "title": "a"}}],
    ),
    F(
        "choices[0].logprobs",
        D,
        "cannot be asked for across wires",
        {"content": [{"token": "a", "logprob": -0.1, "bytes": [97], "top_logprobs": []}]},
    ),
    F(
        "choices[0].finish_reason",
        M,
        "stop_reason (stop → end_turn, length → max_tokens, "
        "tool_calls → tool_use, content_filter → refusal)",
    ),
    F(
        "choices[1:]",
        D,
        "n > 1 is refused across wires",
        [{"index": 1, "message": {"content": "b"}}],
    ),
    F("usage.prompt_tokens", M, "usage.input_tokens (less cached tokens)"),
    F("usage.completion_tokens", M, "usage.output_tokens"),
    F("usage.prompt_tokens_details.cached_tokens", M, "usage.cache_read_input_tokens"),
    F("usage.completion_tokens_details", D, "no counterpart", {"reasoning_tokens": 3}),
    F("system_fingerprint", D, "no counterpart", "fp_1"),
    F("service_tier", D, "no counterpart", "default"),
)
ANTHROPIC_RESPONSE: tuple[Field, ...] = (
    F("id", M, "id (chatcmpl-…)"),
    F("model", M, "model", same=M, same_note="renamed to the model the client asked for"),
    F("content[].type=text", M, "message.content"),
    F("content[].type=thinking", M, "message.reasoning_content (the signature is not sent)"),
    F("content[].type=redacted_thinking", D, "readable by Claude only", {"data": "EmwK"}),
    F("content[].type=tool_use", M, "message.tool_calls[]"),
    F("content[].citations", D, "no counterpart", CITATION),
    F("stop_reason", M, "finish_reason"),
    F("stop_sequence", D, "finish_reason stop", "END"),
    F("usage.input_tokens", M, "usage.prompt_tokens (plus cache reads and writes)"),
    F("usage.output_tokens", M, "usage.completion_tokens"),
    F("usage.cache_read_input_tokens", M, "usage.prompt_tokens_details.cached_tokens"),
    F("usage.cache_creation_input_tokens", M, "counted in usage.prompt_tokens"),
    F("usage.cache_creation", D, "no counterpart", {"ephemeral_5m_input_tokens": 50}),
    F("usage.server_tool_use", D, "no counterpart", {"web_search_requests": 1}),
    F("usage.service_tier", D, "no counterpart", "standard"),
    F(
        "container",
        D,
        "no counterpart",
        {"id": "container_1", "expires_at": "2026-12-01T00:00:00Z"},
    ),
    F(
        "context_management",
        D,
        "no counterpart",
        {"applied_edits": [{"type": "clear_tool_uses_20250919"}]},
    ),
)
RESPONSE_TABLES = {"openai": OPENAI_RESPONSE, "anthropic": ANTHROPIC_RESPONSE}

# ---- headers -------------------------------------------------------------------------------------

HEADERS: tuple[Field, ...] = (
    F(
        "anthropic-beta",
        D,
        "beta features of the Messages API",
        same_note="forwarded to Anthropic upstreams",
    ),
    F(
        "anthropic-version",
        D,
        "means nothing there; not named, as every Anthropic SDK sends it",
        same_note="forwarded to Anthropic upstreams",
    ),
    F("openai-organization", D, "OpenAI's", same_note="forwarded to OpenAI-compatible upstreams"),
    F("openai-project", D, "OpenAI's", same_note="forwarded to OpenAI-compatible upstreams"),
    F(
        "authorization, x-api-key",
        G,
        "the gateway's key; upstreams get their configured key",
        same=G,
        same_note="never forwarded",
    ),
)
FORWARDED_HEADERS = {
    "anthropic": ("anthropic-beta", "anthropic-version"),
    "openai": ("openai-organization", "openai-project"),
}
_FEATURE_HEADERS = ("anthropic-beta", "openai-organization", "openai-project")  # named when dropped
RESPONSE_HEADERS = (
    "request-id",
    "x-request-id",
    "openai-processing-ms",
    "openai-organization",
    "anthropic-organization-id",
)
RESPONSE_HEADER_PREFIXES = ("x-ratelimit-", "anthropic-ratelimit-")


def passed_response_headers(headers: Any) -> dict[str, str]:
    """The upstream response headers a client reads (request ids, rate limits), by
    lower-case name."""
    out: dict[str, str] = {}
    for name, value in headers.items():
        low = name.lower()
        if low in RESPONSE_HEADERS or low.startswith(RESPONSE_HEADER_PREFIXES):
            # x-request-id is the gateway's own (routing traces): the upstream's keeps
            # its value renamed.
            out["x-upstream-request-id" if low == "x-request-id" else low] = value
    return out


def response_headers(req: ChatRequest) -> dict[str, str]:
    """The headers the client's response gets from its exchange: the upstream's, and
    x-flashstack-dropped."""
    ex = req.exchange
    if not ex.dropped:
        return ex.headers
    return {**ex.headers, "x-flashstack-dropped": ",".join(sorted(ex.dropped))}


def client_headers(headers: Any) -> dict[str, str]:
    """The client's headers on any provider's allow-list (never its credential)."""
    out: dict[str, str] = {}
    for names in FORWARDED_HEADERS.values():
        for name in names:
            value = headers.get(name)
            if value is not None:
                out[name] = value
    return out


def headers_for(req: ChatRequest, wire: str) -> dict[str, str] | None:
    """The client headers an upstream of `wire` gets; another wire's feature headers are
    named dropped."""
    mine = FORWARDED_HEADERS[wire]
    out: dict[str, str] = {}
    for name, value in req.headers.items():
        if name in mine:
            out[name] = value
        elif name in _FEATURE_HEADERS:
            req.exchange.dropped.add(name)
    return out or None


# ---- response fields the client's wire has no place for ------------------------------------------

RESPONSE_PREFIX = "response."  # a response field in x-flashstack-dropped, apart from the request's
# a translated stream's final event: every name, as the header's
DROPPED_FIELD = "flashstack_dropped"
_STRUCTURE = {"openai": frozenset({"object"}), "anthropic": frozenset({"type", "role"})}
_MESSAGE_KEYS = frozenset(
    {
        "role",
        "content",
        "tool_calls",
        "reasoning_content",
        "reasoning",
        "refusal",
        "annotations",
        "function_call",
    }
)
_BLOCK_TYPES = frozenset({"text", "thinking", "redacted_thinking", "tool_use"})
_KNOWN_TOP = {
    wire: _STRUCTURE[wire] | {f.name.split(".")[0].split("[")[0] for f in rows}
    for wire, rows in RESPONSE_TABLES.items()
}
_PATH = re.compile(r"\[[^\]]*\]|[^.\[]+")


def dropped_response_fields(wire: str, body: dict[str, Any]) -> set[str]:
    """What of an upstream's response of `wire` (or of one stream event, shaped as a response) a
    client of the other wire cannot receive: its table's dropped rows that carry something, and
    fields newer than the table, each as `response.<name>`."""
    names = {
        f.name
        for f in RESPONSE_TABLES[wire]
        if f.cross is D and f.named and _carries(_at(body, f.name))
    }
    names.update(k for k, v in body.items() if k not in _KNOWN_TOP[wire] and _carries([v]))
    if wire == "openai":
        message = (_at(body, "choices[0].message") or [{}])[0]
        if isinstance(message, dict):
            names.update(
                f"choices[0].message.{k}"
                for k, v in message.items()
                if k not in _MESSAGE_KEYS and _carries([v])
            )
    else:
        names.update(
            f"content[].type={b.get('type')}"
            for b in _at(body, "content[]")
            if isinstance(b, dict) and b.get("type") not in _BLOCK_TYPES
        )
    return {RESPONSE_PREFIX + n for n in names}


def _at(node: Any, path: str) -> list[Any]:
    """The values at a table row's path: `a.b`, `a[0]`, `a[1:]` (each item after), `a[]` (each
    item), `a[].type=x` (the items of that type)."""
    values = [node]
    for step in _PATH.findall(path):
        found: list[Any] = []
        for v in values:
            if step.startswith("["):
                if isinstance(v, list):
                    found += _items(v, step[1:-1])
            elif "=" in step:
                key, _, want = step.partition("=")
                found += [v] if isinstance(v, dict) and v.get(key) == want else []
            elif isinstance(v, dict) and step in v:
                found.append(v[step])
        values = found
    return values


def _items(items: list[Any], index: str) -> list[Any]:
    """`[]` every item, `[1:]` those from the second, `[0]` the first (if any)."""
    if not index:
        return items
    if index.endswith(":"):
        return items[int(index[:-1]) :]
    return items[int(index) : int(index) + 1]


def _carries(values: list[Any]) -> bool:
    """Some value says something: not null, empty, false, zero, nor only such values inside."""
    for v in values:
        if isinstance(v, dict):
            if _carries(list(v.values())):
                return True
        elif isinstance(v, list):
            if _carries(v):
                return True
        elif v not in (None, False, 0, ""):
            return True
    return False


# ---- what the translators ask --------------------------------------------------------------------

_BY_NAME = {
    "openai": {f.name: f for f in OPENAI_REQUEST},
    "anthropic": {f.name: f for f in ANTHROPIC_REQUEST},
}
GATEWAY_FIELDS = frozenset(f.name for f in OPENAI_REQUEST + ANTHROPIC_REQUEST if f.same is G)


def check_cross(req: ChatRequest, target: str) -> None:
    """Refuse, or note as dropped, the client's top-level fields that `target` cannot take.

    Fields the canonical types map are left to the translator; a field the table does not know
    (newer than it) is dropped and named: nothing is dropped silently.
    """
    table = _BY_NAME.get(req.wire or "")
    if table is None:
        return
    for name, value in req.extra.items():
        row = table.get(name)
        if value is None or (row is not None and (row.cross is M or value in row.harmless)):
            continue
        if row is not None and row.cross is R:
            raise invalid_request(
                f"{name} cannot be sent to a model served over the {_API[target]} ({row.to}); "
                f"remove {name} or choose a model served over the {_API[req.wire or '']}",
                name,
            )
        req.exchange.dropped.add(name)


def refuse_part(wire: str, path: str, target: str, why: str = "") -> None:
    """A 400 for a content block or tool the target wire has no counterpart for."""
    raise invalid_request(
        f"{path} cannot be sent to a model served over the {_API[target]}"
        + (f" ({why})" if why else "")
        + "; remove it or choose a model served over the "
        + _API.get(wire, "wire it came from"),
        path,
    )


def part_row(wire: str, name: str) -> Field | None:
    table = OPENAI_PARTS if wire == "openai" else ANTHROPIC_PARTS
    return next((f for f in table if f.name == name), None)


_API = {"openai": "OpenAI chat completions API", "anthropic": "Anthropic Messages API"}

# ---- docs/protocols.md ---------------------------------------------------------------------------

_INTRO = """# Protocol fidelity: every field, on every path

Generated from `flashstack/gateway/translate/fields.py` by
`python -m flashstack.gateway.translate.fields > docs/protocols.md`; a test fails when it is stale,
and the protocol tests (tests/gateway/protocol/) are generated from the same table.

The rule: a request passes through whole. Same wire in and out (an OpenAI client to an
OpenAI-compatible upstream, an Anthropic client to Anthropic): the upstream receives every field the
client sent, JSON-equal apart from `model`, unknown and future fields included, and the client
receives every field the upstream returned, streamed (event by event) and not. Across wires: a field
with a counterpart is mapped; one the target cannot honour and the client relies on is refused with
a 400 naming it; one that is only an optimisation is dropped and named in the response header
`x-flashstack-dropped` (comma-separated). A field newer than this table is dropped and named too.

Fates: **passed** (as sent), **mapped** (to its counterpart), **refused** (400), **dropped**
(named in `x-flashstack-dropped`), **gateway** (the gateway's own; never sent upstream).

In the response tables, **dropped** means the client's wire has no place for the field: it is named
`response.<field>` in `x-flashstack-dropped` whenever the upstream's response carried it (a value
other than null, empty, false or zero), and so is a field newer than the table (`response.<key>`,
`response.choices[0].message.<key>`, `response.content[].type=<type>`). A stream's headers go out
with its first content event, so they name what the upstream had sent by then (OpenAI's
`system_fingerprint` and `service_tier` ride on every chunk; Anthropic's `message_start` carries the
usage and the container). What comes later (later tokens' logprobs, the final usage, citations) is
named in the stream's final event: across wires it carries `"flashstack_dropped": "<the header's
comma-separated list, complete>"`, on the chunk with the `finish_reason` (OpenAI), on
`message_delta` (Anthropic), or on `response.completed` / `response.incomplete` (Responses; beside
its `response` object, which stays the one `GET /v1/responses/{id}` returns); the SDKs keep it
(`chunk.model_extra`, `event.model_extra`).

Sessions store every field of each message as its wire gave it: the parts (text, images, tool calls
and results, thinking with its signature, redacted thinking, verbatim blocks of types the gateway
does not model such as documents) with their `cache_control` and every other key, the message's own
keys, and whether its content was a string or a list. A history replayed from a session reaches the
upstream as the client sent it, and a stored reply as the client received it: from an upstream of
the client's wire, streamed or not, whole (Anthropic: every block with every key, citations,
redacted thinking and server tools' blocks included; OpenAI: the message with every key a request
message takes, `refusal`, `name`, `audio` by its `id`, and each tool call's own keys, while its
reply-only keys, `annotations`, unknown ones and `reasoning_content` / `reasoning` /
`reasoning_details`, stay in the session, except the reasoning of a turn that called tools, which
DeepSeek's thinking mode needs back); across wires its text, thinking with its signature and tool
calls, a list of blocks for Anthropic, a string for OpenAI. An idempotent retry (the same
`Idempotency-Key`) gets that stored reply again, streamed or not, every block and key included
(streamed to an OpenAI client, the message's other keys in one delta before the finish and each tool
call's own keys in its first delta, as the upstream's chunks carried them). A session used from both
wires sends a message's wire-only fields (OpenAI's `name`, an image's `detail`, any unknown key;
`cache_control` towards OpenAI) to its own wire only: to the other they are dropped and named in
`x-flashstack-dropped` (`messages[].name`, `messages[].content[].image_url.detail`, …).
"""


_RESPONSES_OUT = """## Responses: what the client gets back

The `response` object (and, streamed, `response.created`, `response.in_progress`,
`response.output_item.added`, `response.content_part.added`, `response.output_text.delta` / `.done`,
`response.reasoning_summary_part.added`, `response.reasoning_summary_text.delta` / `.done`,
`response.function_call_arguments.delta` / `.done`, `response.content_part.done`,
`response.output_item.done`, then `response.completed` or `response.incomplete`, each with its
`sequence_number`; a failure after the start is `error` then `response.failed`, and nothing is
stored). Text is a `message` item with one `output_text` part, a tool call a `function_call` item,
thinking a `reasoning` item (its summary the thinking text; its signature, or Anthropic's redacted
thinking, in `encrypted_content`, which comes back unchanged in a later input). `usage.input_tokens`
counts cached tokens too (`input_tokens_details.cached_tokens`);
`output_tokens_details.reasoning_tokens` is the upstream's count. Translated, an upstream's own
response fields that the canonical response does not carry (logprobs, annotations,
`system_fingerprint`) do not reach a Responses client, and are named `response.<field>` in
`x-flashstack-dropped` (streamed: those sent before the first content event, and the whole list in
`flashstack_dropped` on `response.completed` / `response.incomplete`); from a Responses upstream (`responses_api: true`) the body and every event
arrive as the upstream sent them, the model renamed (hosted tools, unknown item types and fields
included).

### Codex CLI

Codex CLI (0.171, `wire_api = "responses"`) works against any model of the gateway; tested
against a Responses upstream, a chat-completions upstream (a shell tool called and answered) and
the bundled SmolLM2-135M on the local engine (`tests/gateway/responses/test_codex.py`). Codex sends
an ~18 KB system prompt and about twenty tools by default, more than a small local model's window;
for SmolLM2 a `config.toml` of this shape keeps its request near 1,100 tokens (three function
tools, which the local provider renders into the model's prompt):

```toml
model = "smollm2-135m-instruct"
model_provider = "flashstack"
web_search = "disabled"                      # only OpenAI runs its hosted tools
model_instructions_file = "/path/to/short-instructions.md"
include_environment_context = false
include_permissions_instructions = false

[skills]
include_instructions = false

[agents]
enabled = false

[features]
goals = false
view_image = false
apps = false
plugins = false
shell_snapshot = false
skill_search = false
tool_suggest = false
image_generation = false
sleep_tool = false

[model_providers.flashstack]
name = "flashstack gateway"
base_url = "http://127.0.0.1:8400/v1"
env_key = "FLASHSTACK_API_KEY"
wire_api = "responses"
```

On a CPU the first request also loads the engine: a `ttft_timeout` above the default 30 s for the
local model keeps Codex from retrying it. Codex sends no `temperature`: the model's
`default_temperature: 0` makes its answers greedy.

## `POST /v1/embeddings` and `POST /v1/completions`

| model | embeddings | legacy completions |
| --- | --- | --- |
| OpenAI-compatible upstream | body passed as sent (model renamed), reply as it came | the same, streamed or not |
| `minilm` (in process) | `input` text(s) of at most 256 word pieces (longer: 400); `encoding_format` float or base64; `dimensions` other than 384 refused; other fields named in `x-flashstack-dropped` | — |
| local engine | — | one raw prompt (text or token ids), no chat template: `max_tokens` (default 16), `temperature`, `top_p`, `stop`, `seed`, `stream`, `stream_options`; `echo`, `logprobs`, `suffix`, `best_of` > 1, `logit_bias`, `n` > 1 refused; other fields named in `x-flashstack-dropped` |
| Anthropic upstream | 400 | 400 (chat only) |

Both go through the router as a chat does (retries, fallbacks, breakers, one attempt span per
try), to the model's deployments that can serve them; a stream may move to another deployment
until its first event. They are counted as a chat is: the key's models (403), rpm, tpm and budget
(429), a row in the request log priced from the upstream's usage (`minilm` costs 0), and a trace
(`embeddings <model>`, `text_completion <model>`). A legacy completion streamed to an
OpenAI-compatible upstream asks it for usage (`stream_options.include_usage`) whatever the client
asked: it is what the key is charged by; a client that did not ask does not get the usage chunk.
`GET /v1/models` lists `minilm` beside the configured models.
"""  # noqa: E501 (Markdown: a table row is one line)


def _table(title: str, rows: tuple[Field, ...], same: str, cross: str) -> str:
    lines = [f"## {title}", "", f"| field | {same} | {cross} |", "| --- | --- | --- |"]
    for f in rows:
        same_cell = f.same.value + (f": {f.same_note}" if f.same_note else "")
        cross_cell = f.cross.value + (f": {f.to}" if f.to else "")
        if not f.named:
            cross_cell += " (not named: it tells the client nothing)"
        if f.harmless:
            cross_cell += (
                " (nothing happens for "
                + " or ".join(f"`{orjson.dumps(v).decode()}`" for v in f.harmless)
                + ")"
            )
        lines.append(f"| `{f.name}` | {same_cell} | {cross_cell} |")
    return "\n".join(lines) + "\n"


_ESTIMATED_USAGE = """## Usage the gateway counts

An upstream reply that comes without usage, streamed or not (llama.cpp's server sends none in a
stream, whatever `stream_options` asks; a proxy may strip it from a whole reply), is counted by the
gateway: the prompt with the model's own tokenizer and chat template where the gateway has them (a
`local` model, or a deployment's `tokenizer:` naming the GGUF or model directory its upstream
serves), the answer as its text re-encoded; otherwise with the gateway's token counter (cl100k_base,
or bytes / 3.6 without it). The usage the client gets (a chat completion's `usage`, or OpenAI's
usage chunk when it asked with `stream_options.include_usage`; Anthropic's `usage` or
`message_delta` usage; a Responses `response.usage`) then carries `"flashstack_estimate":
"<counter>"`: `tokenizer` (the model's own), `cl100k_base`, `claude-estimate` or `estimate`. Without
that field the counts are the upstream's. Spend, budgets and tpm limits are charged the same counts,
and a session's idempotent replay of such a reply carries the same field.
"""


def render_markdown() -> str:
    """docs/protocols.md."""
    o2o, o2a = "OpenAI client → OpenAI-compatible upstream", "OpenAI client → Anthropic upstream"
    a2a, a2o = (
        "Anthropic client → Anthropic upstream",
        "Anthropic client → OpenAI-compatible upstream",
    )
    up_o, up_a = "OpenAI-compatible upstream → OpenAI client", "→ Anthropic client"
    up_a2, up_o2 = "Anthropic upstream → Anthropic client", "→ OpenAI client"
    sections = [
        _INTRO,
        _table(
            "OpenAI chat completions request (`POST /v1/chat/completions`)",
            OPENAI_REQUEST,
            o2o,
            o2a,
        ),
        _table("OpenAI request: messages, content parts and tools", OPENAI_PARTS, o2o, o2a),
        _table("Anthropic Messages request (`POST /v1/messages`)", ANTHROPIC_REQUEST, a2a, a2o),
        _table("Anthropic request: system, content blocks and tools", ANTHROPIC_PARTS, a2a, a2o),
        _table("OpenAI chat completion response (and chunks)", OPENAI_RESPONSE, up_o, up_a),
        _table("Anthropic Message response (and stream events)", ANTHROPIC_RESPONSE, up_a2, up_o2),
        _table(
            "OpenAI Responses request (`POST /v1/responses`)",
            RESPONSES_REQUEST,
            "→ a Responses upstream (`responses_api: true`)",
            "→ any other upstream, through the canonical types",
        ),
        _RESPONSES_OUT,
        _table("Request headers", HEADERS, "same wire", "other wire"),
        "## Response headers\n\nPassed back to the client from the upstream that answered, its "
        "errors included: "
        + ", ".join(f"`{h}`" for h in RESPONSE_HEADERS)
        + ", and every `x-ratelimit-*` and "
        "`anthropic-ratelimit-*` header. The upstream's `x-request-id` arrives as "
        "`x-upstream-request-id`: `x-request-id` is the gateway's own (its routing trace).\n",
        _ESTIMATED_USAGE,
        "## `POST /v1/messages/count_tokens`\n\nCounted by the deployment the request would be "
        "routed to (of several deployments of the model, the first configured whose breaker is not "
        "open, one whose last health probe passed first): forwarded to an Anthropic upstream (body "
        "as sent, model renamed); counted with the model's own tokenizer and chat template (tools "
        "included) for a local model (`provider: local`) and for a deployment naming its model's "
        "`tokenizer:` (the GGUF llama.cpp serves); otherwise a 400 saying that counting is not "
        "available for that model, naming the deployment.\n",
    ]
    return "\n".join(sections)


if __name__ == "__main__":
    sys.stdout.write(render_markdown())

"""The compression pipeline on canonical requests: what it keeps, what it never splits,
when it refuses."""

from __future__ import annotations

import dataclasses

import pytest

from flashstack.gateway import tokens
from flashstack.gateway.compress import SUMMARY_HEADER, request_options
from flashstack.gateway.compress.units import unit_spans
from flashstack.gateway.core import ChatRequest, GatewayError, Message, Text, ToolCall, ToolResult

from .conftest import long_conversation, model


def prompt_tokens(planner, req: ChatRequest) -> int:
    return planner.measure(tokens.counter_for(model()), req)[2]


def assert_tool_pairs_whole(req: ChatRequest) -> None:
    calls = {p.id for m in req.messages for p in m.parts if isinstance(p, ToolCall)}
    results = {p.tool_call_id for m in req.messages for p in m.parts if isinstance(p, ToolResult)}
    assert calls == results, (
        f"split pairs: calls without results {calls - results}, results without calls "
        f"{results - calls}"
    )
    for i, m in enumerate(req.messages):  # every result directly follows the message with its call
        for p in m.parts:
            if isinstance(p, ToolResult):
                assert any(
                    isinstance(q, ToolCall) and q.id == p.tool_call_id
                    for q in req.messages[i - 1].parts
                )


def test_unit_spans_keep_calls_with_results():
    msgs = [
        Message("user", [Text("hi")]),
        Message("assistant", [ToolCall("a", "f", "{}"), ToolCall("b", "g", "{}")]),
        Message("user", [ToolResult("a", [Text("1")])]),
        Message("user", [ToolResult("b", [Text("2")])]),
        Message("assistant", [Text("done")]),
    ]
    assert unit_spans(msgs) == [(0, 1), (1, 4), (4, 5)]


@pytest.mark.parametrize("divisor", [2, 3, 4, 6])
async def test_tool_pairs_never_split_and_system_kept(compressor, divisor):
    c = compressor()
    planner = await c.planner()
    req = long_conversation()
    target = prompt_tokens(planner, req) // divisor
    out, outcome = await c.compress(req, model(), target)
    assert_tool_pairs_whole(out)
    # the caller's system prompt, first and whole
    assert out.system[0].text == "You are a careful assistant."
    assert prompt_tokens(planner, out) <= target
    assert outcome.action == "compressed" and outcome.tokens_after < outcome.tokens_before
    assert out.messages[-1].parts[0].text == "What is the vault code?"


async def test_relevant_fact_survives_where_truncation_loses_it(compressor):
    c = compressor()
    planner = await c.planner()
    req = long_conversation()
    target = prompt_tokens(planner, req) // 3
    squeezed, _ = await c.compress(req, model(), target, "auto")
    truncated, t_outcome = await c.compress(req, model(), target, "truncate")
    text = lambda r: r.system_text() + " ".join(tokens.message_text(m) for m in r.messages)  # noqa: E731
    assert "7351" in text(squeezed)
    assert "7351" not in text(truncated)
    assert t_outcome.action == "truncated" and t_outcome.messages_dropped > 0
    assert_tool_pairs_whole(truncated)


async def test_summaries_go_into_the_system_prompt(compressor):
    c = compressor()
    planner = await c.planner()
    req = long_conversation(60)
    out, outcome = await c.compress(req, model(), prompt_tokens(planner, req) // 3)
    assert outcome.messages_summarized > 0
    assert out.system[-1].text.startswith(SUMMARY_HEADER)
    assert len(out.system) == 2


async def test_same_input_same_output(compressor):
    req = long_conversation()
    a, _ = await compressor().compress(req, model(), 800)
    b, _ = await compressor().compress(long_conversation(), model(), 800)
    assert a == b


async def test_last_turns_and_pinned_kept_verbatim(compressor):
    c = compressor(keep_last_turns=4)
    planner = await c.planner()
    req = long_conversation()
    out, _ = await c.compress(req, model(), prompt_tokens(planner, req) // 3, pinned=frozenset({0}))
    assert out.messages[-4:] == req.messages[-4:]
    assert out.messages[0] == req.messages[0]


async def test_unfittable_conversation_is_refused(compressor):
    c = compressor()
    req = long_conversation()
    huge = Message("user", [Text("word " * 3000 + "What is the vault code?")])
    req = dataclasses.replace(req, messages=[*req.messages[:-1], huge])
    with pytest.raises(GatewayError) as e:
        await c.compress(req, model(), 1000)
    assert e.value.status == 400 and e.value.code == "context_length_exceeded"


async def test_fast_path_does_not_load_the_model(compressor):
    from flashstack.gateway.compress import Compressor
    from flashstack.gateway.config import CompressionConfig

    # loading would fail: no model under /nonexistent
    c = Compressor(CompressionConfig(), "/nonexistent")
    req = ChatRequest(model="m", messages=[Message("user", [Text("hello")])])
    out, outcome = await c.maybe_compress(req, model(context_window=8000))
    assert out is req and outcome.action == "none" and c.state == "idle"


async def test_trigger_at_threshold(compressor):
    c = compressor(threshold=0.85)
    planner = await c.planner()
    req = long_conversation()
    n = prompt_tokens(planner, req)
    # Fits: prompt + reserve just under 85 % of the window → untouched.
    window = int((n + 100) / 0.85) + 2
    out, outcome = await c.maybe_compress(req, model(context_window=window, max_output_tokens=100))
    assert out is req and outcome.action == "none"
    out, outcome = await c.maybe_compress(
        req, model(context_window=window - 40, max_output_tokens=100)
    )
    assert outcome.action == "compressed"
    assert prompt_tokens(planner, out) + 100 <= 0.85 * (window - 40)


@pytest.mark.parametrize(
    "value",
    [
        "squash",
        3,
        {"mode": "auto", "pinned": [999]},
        {"mode": "x"},
        {"pinned": "all"},
        {"other": 1},
        {"pinned": [True]},
    ],
)
def test_bad_compression_field_is_the_callers_error(value):
    req = ChatRequest(
        model="m", messages=[Message("user", [Text("hi")])], extensions={"compression": value}
    )
    with pytest.raises(GatewayError) as e:
        request_options(req)
    assert e.value.status == 400 and e.value.param.startswith("compression")


class StubRouter:
    """Stands in for the router: answers summaries and counts calls."""

    def __init__(self, answer: str) -> None:
        self.answer, self.calls = answer, 0

    def config_of(self, name):
        return model(context_window=4000)

    async def complete(self, request):
        from flashstack.gateway.core import ChatResponse, StopReason, Usage

        self.calls += 1
        assert "at most 3 sentences" in request.messages[0].parts[0].text
        return ChatResponse("id", "m", [Text(self.answer)], StopReason.END_TURN, Usage())


async def test_llm_summaries_are_used_and_cached(embedder):
    from flashstack.gateway.compress import Compressor
    from flashstack.gateway.config import CompressionConfig

    from .conftest import MODELS_DIR

    router = StubRouter("Short summary.")
    c = Compressor(
        CompressionConfig(summarizer="llm"), MODELS_DIR.parent, router, embedder=embedder
    )
    req = long_conversation(60)
    out, outcome = await c.compress(req, model(), 1200)
    assert "- Short summary." in out.system[-1].text
    calls = router.calls
    assert calls > 0
    await c.compress(req, model(), 1200)
    assert router.calls == calls  # each cluster was summarized once


async def test_llm_summary_too_long_falls_back_to_extractive(embedder):
    from flashstack.gateway.compress import Compressor
    from flashstack.gateway.config import CompressionConfig

    from .conftest import MODELS_DIR

    c = Compressor(
        CompressionConfig(summarizer="llm"),
        MODELS_DIR.parent,
        StubRouter("blah " * 500),
        embedder=embedder,
    )
    out, _ = await c.compress(long_conversation(60), model(), 1200)
    assert "blah" not in out.system_text() and SUMMARY_HEADER in out.system_text()

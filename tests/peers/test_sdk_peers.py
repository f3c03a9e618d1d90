"""Both official SDKs × {llama.cpp, engine server, LiteLLM (chat and messages)} ×
{stream, non-stream}.

Each answer through the gateway is compared with the same request sent straight to the peer in the
same mode (stream or not), greedy: the same text and the same usage, so nothing is lost, invented or
miscounted on the way. Errors the real peers raise reach the caller in its own SDK's format.
"""

from __future__ import annotations

from dataclasses import dataclass

import anthropic
import openai
import pytest

from flashstack.gateway.core import ESTIMATE_FIELD
from tests.peers.conftest import ENGINE_MODEL, LITELLM_MODEL, LLAMACPP_MODEL

QUESTION = "What is the capital of France? Answer in one word."
MAX_TOKENS = 12
# The peer each gateway model sends to, and the wire it speaks there.
PEER_OF = {
    "llamacpp": ("llamacpp", "openai", LLAMACPP_MODEL),
    "engine": ("engine_server", "openai", ENGINE_MODEL),
    "litellm-chat": ("litellm", "openai", LITELLM_MODEL),
    "litellm-messages": ("litellm", "anthropic", LITELLM_MODEL),
}
MODELS = list(PEER_OF)
# llama-cpp-python 0.3.36 sends no usage in a stream (it ignores stream_options.include_usage): the
# gateway counts with the GGUF's tokenizer (the llamacpp model's `tokenizer`) and says so.
COUNTED_BY_GATEWAY = {("llamacpp", True): "tokenizer"}


@dataclass(frozen=True)
class Answer:
    text: str
    input_tokens: int | None  # None: the answer carried no usage
    output_tokens: int | None
    stop: str  # OpenAI's finish_reason words, whichever wire answered
    # the usage's flashstack_estimate: the gateway counted, not the upstream
    estimated: str | None = None


_ANTHROPIC_STOP = {
    "end_turn": "stop",
    "max_tokens": "length",
    "stop_sequence": "stop",
    "tool_use": "tool_calls",
}


def ask_openai(client: openai.OpenAI, model: str, stream: bool, content: str = QUESTION) -> Answer:
    kwargs = dict(
        model=model,
        messages=[{"role": "user", "content": content}],
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    if not stream:
        r = client.chat.completions.create(**kwargs)
        u = r.usage
        assert u.total_tokens == u.prompt_tokens + u.completion_tokens
        return Answer(
            r.choices[0].message.content or "",
            u.prompt_tokens,
            u.completion_tokens,
            r.choices[0].finish_reason,
        )
    text, finish, usage = "", None, None
    chunks = list(
        client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    for ch in chunks:
        usage = ch.usage or usage
        for choice in ch.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    if usage is None:
        return Answer(text, None, None, finish)
    assert chunks[-1].usage is not None, "the usage chunk comes last"
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    return Answer(
        text,
        usage.prompt_tokens,
        usage.completion_tokens,
        finish,
        (usage.model_extra or {}).get(ESTIMATE_FIELD),
    )


def ask_anthropic(
    client: anthropic.Anthropic, model: str, stream: bool, content: str = QUESTION
) -> Answer:
    # This SDK has no `temperature` argument any more; the Messages API still takes the field.
    kwargs = dict(
        model=model,
        messages=[{"role": "user", "content": content}],
        max_tokens=MAX_TOKENS,
        extra_body={"temperature": 0},
    )
    estimated = None
    if stream:
        with client.messages.stream(**kwargs) as s:
            for event in s:
                # the SDK's final message keeps no unknown usage field
                if event.type == "message_delta":
                    estimated = (event.usage.model_extra or {}).get(ESTIMATE_FIELD)
            r = s.get_final_message()
    else:
        r = client.messages.create(**kwargs)
    text = "".join(b.text for b in r.content if b.type == "text")
    return Answer(
        text, r.usage.input_tokens, r.usage.output_tokens, _ANTHROPIC_STOP[r.stop_reason], estimated
    )


def openai_at(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def anthropic_at(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=60)


_DIRECT: dict[tuple[str, bool], Answer] = {}


def direct_answer(request: pytest.FixtureRequest, model: str, stream: bool) -> Answer:
    """The peer's own answer to QUESTION, asked in its own wire without the gateway."""
    if (model, stream) not in _DIRECT:
        fixture, wire, upstream_model = PEER_OF[model]
        peer = request.getfixturevalue(fixture)
        ask = (
            ask_openai(openai_at(peer.url), upstream_model, stream)
            if wire == "openai"
            else ask_anthropic(anthropic_at(peer.url), upstream_model, stream)
        )
        _DIRECT[model, stream] = ask
    return _DIRECT[model, stream]


@pytest.fixture(scope="module")
def gw_openai(peer_gateway) -> openai.OpenAI:
    return openai_at(peer_gateway.url)


@pytest.fixture(scope="module")
def gw_anthropic(peer_gateway) -> anthropic.Anthropic:
    return anthropic_at(peer_gateway.url)


@pytest.mark.parametrize("stream", [False, True], ids=["sync", "stream"])
@pytest.mark.parametrize("model", MODELS)
def test_openai_sdk_gets_the_peers_answer(request, gw_openai, model, stream):
    got = ask_openai(gw_openai, model, stream)
    assert "paris" in got.text.lower(), got  # a trained model's real answer, not an echo
    assert_same_answer(request, got, model, stream)


@pytest.mark.parametrize("stream", [False, True], ids=["sync", "stream"])
@pytest.mark.parametrize("model", MODELS)
def test_anthropic_sdk_gets_the_peers_answer(request, gw_anthropic, model, stream):
    got = ask_anthropic(gw_anthropic, model, stream)
    assert "paris" in got.text.lower(), got
    assert_same_answer(request, got, model, stream)


def assert_same_answer(
    request: pytest.FixtureRequest, got: Answer, model: str, stream: bool
) -> None:
    """The peer's own text, stop reason and counts; where its stream had no counts (llama.cpp), the
    gateway's count equals the peer's own in its non-stream answer, and is marked as
    the gateway's."""
    want = direct_answer(request, model, stream)
    assert (got.text, got.stop) == (want.text, want.stop)
    assert got.estimated == COUNTED_BY_GATEWAY.get((model, stream)), got
    if want.input_tokens is None:
        want = direct_answer(request, model, False)
    assert (got.input_tokens, got.output_tokens) == (want.input_tokens, want.output_tokens)
    assert got.input_tokens and got.output_tokens, "counted: never 0"


@pytest.mark.parametrize("stream", [False, True], ids=["sync", "stream"])
def test_engine_server_and_in_process_engine_answer_alike(gw_openai, stream):
    """`flashstack engine serve` over HTTP and the `local` provider run one engine:
    greedy, one answer."""
    assert ask_openai(gw_openai, "engine", stream) == ask_openai(gw_openai, "local", stream)


# A prompt longer than every peer's context (llama.cpp here: 2048 tokens; the engine:
# the GGUF's 8192).
TOO_LONG = "word " * 9000


def refusal_status(model: str, stream: bool) -> int:
    """What the caller gets: the peer's 400, except where llama.cpp streams. llama-cpp-python
    answers a stream it cannot run with 200 and an empty body, so the gateway can only say the
    upstream failed."""
    return 502 if model == "llamacpp" and stream else 400


@pytest.mark.parametrize("stream", [False, True], ids=["sync", "stream"])
@pytest.mark.parametrize("model", MODELS)
def test_a_peers_refusal_reaches_the_openai_sdk_in_its_format(gw_openai, model, stream):
    with pytest.raises(openai.APIStatusError) as info:
        ask_openai(gw_openai, model, stream, TOO_LONG)
    status, body = info.value.status_code, info.value.response.json()
    assert status == refusal_status(model, stream), body
    want_type = "invalid_request_error" if status == 400 else "api_error"
    assert set(body) == {"error"} and body["error"]["type"] == want_type, body
    assert body["error"]["message"], body


@pytest.mark.parametrize("stream", [False, True], ids=["sync", "stream"])
@pytest.mark.parametrize("model", MODELS)
def test_a_peers_refusal_reaches_the_anthropic_sdk_in_its_format(gw_anthropic, model, stream):
    with pytest.raises(anthropic.APIStatusError) as info:
        ask_anthropic(gw_anthropic, model, stream, TOO_LONG)
    status, body = info.value.status_code, info.value.response.json()
    assert status == refusal_status(model, stream), body
    want_type = "invalid_request_error" if status == 400 else "api_error"
    assert body["type"] == "error" and body["error"]["type"] == want_type, body
    assert body["error"]["message"], body

"""Same wire in and out, with the official SDKs: nothing a client sends or an upstream
returns is lost.

Each test makes one call straight at a canned recording upstream and the same call through the
gateway: the upstream's recorded body must be the same JSON apart from `model`, and the client's
parsed object the same apart from `model` (streams: event by event).
"""

from __future__ import annotations

import copy

import pytest

from tests.gateway.protocol import canned, samples
from tests.gateway.protocol.conftest import ANTHROPIC_MODEL, CLIENT_KEY, OPENAI_MODEL


def _without_model(body: dict) -> dict:
    return {k: v for k, v in body.items() if k != "model"}


def _both(clients, upstream, wire: str, call):
    """(result direct, result through the gateway, body direct, body through the gateway)."""
    log = upstream[wire].requests
    model = {"openai": (OPENAI_MODEL, "oai"), "anthropic": (ANTHROPIC_MODEL, "claude")}[wire]
    index = 0 if wire == "openai" else 1
    direct = call(clients["direct"][index], model[0])
    direct_body = log[-1].body
    through = call(clients["gateway"][index], model[1])
    through_body = log[-1].body
    assert through_body["model"] == model[0]  # the gateway renamed it to the deployment's
    return direct, through, direct_body, through_body


def _dump(obj, model_to_drop: str | None = None) -> dict:
    d = obj.model_dump(exclude_unset=False)
    d.pop("model", None)
    if isinstance(d.get("message"), dict):
        d["message"].pop("model", None)
    return d


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_openai_request_reaches_the_upstream_whole(clients, upstream, stream):
    upstream["openai"].app.state.reply = canned.Reply(
        body=samples.openai_response(), events=samples.openai_events()
    )
    kwargs = samples.openai_request()
    kwargs["stream"] = stream
    if stream:
        kwargs["stream_options"] = {"include_usage": True}

    def call(client, model):
        result = client.chat.completions.create(
            model=model, **copy.deepcopy(kwargs), extra_body=samples.FUTURE
        )
        return list(result) if stream else result

    _, _, direct_body, through_body = _both(clients, upstream, "openai", call)
    assert _without_model(through_body) == _without_model(direct_body)
    assert direct_body["messages"][0]["role"] == "developer" and "x_future_field" in direct_body


def test_openai_response_reaches_the_client_whole(clients, upstream):
    upstream["openai"].app.state.reply = canned.Reply(body=samples.openai_response())
    kwargs = samples.openai_request()

    def call(client, model):
        return client.chat.completions.with_raw_response.create(
            model=model, **copy.deepcopy(kwargs)
        ).parse()

    direct, through, _, _ = _both(clients, upstream, "openai", call)
    assert _dump(through) == _dump(direct)
    assert (
        through.system_fingerprint == "fp_canned"
        and through.choices[0].logprobs.content[0].token == "{"
    )
    assert through.usage.prompt_tokens_details.cached_tokens == 100
    assert through.model_extra["x_future_field"] == samples.FUTURE["x_future_field"]


@pytest.mark.parametrize("include_usage", [True, False], ids=["usage", "no-usage"])
def test_openai_stream_reaches_the_client_event_by_event(clients, upstream, include_usage):
    upstream["openai"].app.state.reply = canned.Reply(events=samples.openai_events())
    kwargs = samples.openai_request()
    kwargs.update(stream=True, stream_options={"include_usage": include_usage})

    def call(client, model):
        return list(client.chat.completions.create(model=model, **copy.deepcopy(kwargs)))

    direct, through, _, through_body = _both(clients, upstream, "openai", call)
    assert [_dump(c) for c in through] == [_dump(c) for c in direct]
    # the gateway always counts usage
    assert through_body["stream_options"]["include_usage"] is True
    assert (through[-1].usage is not None) is include_usage
    assert (
        through[1].choices[0].logprobs is not None and through[0].system_fingerprint == "fp_canned"
    )


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_anthropic_request_reaches_the_upstream_whole(clients, upstream, stream):
    upstream["anthropic"].app.state.reply = canned.Reply(
        body=samples.anthropic_response(), events=samples.anthropic_events()
    )
    kwargs = samples.anthropic_request()
    kwargs["stream"] = stream

    def call(client, model):
        result = client.messages.create(
            model=model,
            **copy.deepcopy(kwargs),
            extra_headers={"anthropic-beta": "context-management-2025-06-27"},
        )
        return list(result) if stream else result

    _, _, direct_body, through_body = _both(clients, upstream, "anthropic", call)
    assert _without_model(through_body) == _without_model(direct_body)
    assert direct_body["system"][0]["cache_control"] == samples.CACHE and "thinking" in direct_body
    headers = upstream["anthropic"].requests[-1].headers
    assert headers["anthropic-beta"] == "context-management-2025-06-27"
    assert CLIENT_KEY not in str(headers)  # the client's own key never travels upstream


def test_anthropic_response_reaches_the_client_whole(clients, upstream):
    upstream["anthropic"].app.state.reply = canned.Reply(
        body=samples.anthropic_response(),
        headers={"request-id": "req_canned", "anthropic-ratelimit-tokens-remaining": "99"},
    )
    kwargs = samples.anthropic_request()

    def call(client, model):
        return client.messages.with_raw_response.create(model=model, **copy.deepcopy(kwargs))

    direct, through, _, _ = _both(clients, upstream, "anthropic", call)
    assert _dump(through.parse()) == _dump(direct.parse())
    assert through.headers["request-id"] == "req_canned"
    assert through.headers["anthropic-ratelimit-tokens-remaining"] == "99"
    usage = through.parse().usage
    assert (
        usage.cache_read_input_tokens == 1000
        and usage.cache_creation.ephemeral_5m_input_tokens == 50
    )


def test_anthropic_stream_reaches_the_client_event_by_event(clients, upstream):
    upstream["anthropic"].app.state.reply = canned.Reply(events=samples.anthropic_events())
    kwargs = samples.anthropic_request() | {"stream": True}

    def call(client, model):
        return list(client.messages.create(model=model, **copy.deepcopy(kwargs)))

    direct, through, _, _ = _both(clients, upstream, "anthropic", call)
    assert [_dump(e) for e in through] == [_dump(e) for e in direct]
    assert [e.type for e in through].count("content_block_start") == 4


def test_openai_n_choices_reach_the_client(clients, upstream):
    # The canonical response holds the first choice (sessions store it); the client gets every one.
    body = samples.openai_response()
    body["choices"].append(
        {**body["choices"][0], "index": 1, "message": {"role": "assistant", "content": '{"b": 2}'}}
    )
    events = samples.openai_events()
    second = [
        ("", {**data, "choices": [{**c, "index": 1} for c in data["choices"]]})
        for _, data in events[1:3]
    ]
    upstream["openai"].app.state.reply = canned.Reply(
        body=body, events=events[:3] + second + events[3:]
    )
    kwargs = {"messages": [{"role": "user", "content": "hi"}], "n": 2}

    def call(client, model):
        return (
            client.chat.completions.create(model=model, **kwargs),
            list(client.chat.completions.create(model=model, stream=True, **kwargs)),
        )

    (direct, direct_chunks), (through, through_chunks), _, _ = _both(
        clients, upstream, "openai", call
    )
    assert [c.message.content for c in through.choices] == ['{"a": 1}', '{"b": 2}']
    assert _dump(through) == _dump(direct)
    assert [_dump(c) for c in through_chunks] == [_dump(c) for c in direct_chunks]

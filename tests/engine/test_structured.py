"""Structured output by constrained decoding: `flashstack engine serve` on the trained SmolLM2,
the official SDK; response_format json_schema / json_object and vLLM's guided_regex /
guided_choice always produce what they ask for, and a grammar that cannot compile is a 400."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

from tests.engine.served import KEY, Served

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(smol: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=smol.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _ask(client: openai.OpenAI, content: str, **kw):
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": content}], **kw
    )


def test_json_schema_response_validates(client) -> None:
    r = _ask(
        client,
        "Describe a person.",
        max_tokens=40,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON},
        },
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_json_schema_streamed_with_sampling_validates(client) -> None:
    chunks = _ask(
        client,
        "Invent someone.",
        max_tokens=40,
        stream=True,
        temperature=1.0,
        seed=7,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON},
        },
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), PERSON)


def test_json_object_is_json(client) -> None:
    r = _ask(
        client,
        'Answer in JSON like {"capital": "..."}: what is the capital of France?',
        max_tokens=30,
        response_format={"type": "json_object"},
    )
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_guided_choice_and_regex(client) -> None:
    choice = _ask(
        client,
        "Is the sky blue?",
        max_tokens=5,
        extra_body={"guided_choice": ["yes", "no", "maybe"]},
    )
    assert choice.choices[0].message.content in ("yes", "no", "maybe")
    regex = client.completions.create(
        model="smol",
        prompt="The year is",
        max_tokens=8,
        temperature=0,
        extra_body={"guided_regex": r" [12][0-9]{3}"},
    )
    assert re.fullmatch(r" [12][0-9]{3}", regex.choices[0].text)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "bogus"}},
                }
            },
            "bogus",
        ),
        ({"extra_body": {"guided_regex": "[a-"}}, "guided_regex"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        (
            {"response_format": {"type": "json_object"}, "extra_body": {"guided_choice": ["a"]}},
            "one of",
        ),
    ],
)
def test_bad_grammar_is_400(client, body, needle) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        _ask(client, "hi", max_tokens=3, **body)
    assert needle in err.value.body["message"]


def test_a_vocabulary_xgrammar_refuses_leaves_only_guided_requests_refused(tmp_path) -> None:
    from types import SimpleNamespace

    from bench.engine_serving import word_level_tokenizer
    from flashstack.engine.guided import GuideSpec
    from flashstack.engine.metrics import ServerMetrics
    from flashstack.engine.server import _Handler
    from flashstack.engine.tokenizer import load_tokenizer
    from flashstack.gateway.core import GatewayError

    word_level_tokenizer(64, tmp_path)  # no end-of-sequence token: xgrammar refuses it
    engine = SimpleNamespace(
        tokenizer=load_tokenizer(tmp_path), info=SimpleNamespace(vocab_size=64, model="w")
    )
    h = _Handler(engine, ["w"], ServerMetrics(lambda: None, "w"))
    h.prepare_grammars()  # serve() calls it before serving: it must not raise
    with pytest.raises(GatewayError) as err:
        asyncio.run(h.guide(GuideSpec(any_json=True)))
    assert err.value.status == 400 and "structured output is unavailable" in str(err.value)

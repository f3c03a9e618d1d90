"""Stop reasons, stop sequences, system prompts, usage and response_format, across protocols."""

from __future__ import annotations

import json

import openai
import pytest

MODELS = ["claude", "gpt", "llama"]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
RF = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


@pytest.mark.parametrize("model", MODELS)
def test_max_tokens_maps_to_length_and_back(openai_client, anthropic_client, model):
    r = openai_client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "a b c [[max_tokens]]"}]
    )
    assert r.choices[0].finish_reason == "length"
    m = anthropic_client.messages.create(
        model=model, max_tokens=50, messages=[{"role": "user", "content": "a b c [[max_tokens]]"}]
    )
    assert m.stop_reason == "max_tokens"


@pytest.mark.parametrize("model", MODELS)
def test_system_prompt_reaches_upstream(openai_client, anthropic_client, upstreams, model):
    r = openai_client.chat.completions.create(
        model=model,
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "developer", "content": "and kind"},
            {"role": "user", "content": "hi"},
        ],
    )
    assert r.usage.prompt_tokens == 5  # words of system + developer + user
    m = anthropic_client.messages.create(
        model=model,
        max_tokens=20,
        system="be very brief",
        messages=[{"role": "user", "content": "hi"}],
    )
    assert m.usage.input_tokens == 4


@pytest.mark.parametrize("model", ["claude", "gpt"])
def test_stop_sequence(anthropic_client, openai_client, model):
    m = anthropic_client.messages.create(
        model=model,
        max_tokens=50,
        stop_sequences=["three"],
        messages=[{"role": "user", "content": "one two three four"}],
    )
    assert m.content[0].text.rstrip() == "echo: one two"
    assert m.stop_reason in ("stop_sequence", "end_turn")
    if model == "claude":
        assert m.stop_reason == "stop_sequence" and m.stop_sequence == "three"
    r = openai_client.chat.completions.create(
        model=model, stop="three", messages=[{"role": "user", "content": "one two three four"}]
    )
    assert (
        r.choices[0].message.content.rstrip() == "echo: one two"
        and r.choices[0].finish_reason == "stop"
    )


@pytest.mark.parametrize("model", MODELS)
def test_json_schema_output_is_validated(openai_client, model):
    r = openai_client.chat.completions.create(
        model=model, response_format=RF, messages=[{"role": "user", "content": "who [[json]]"}]
    )
    assert json.loads(r.choices[0].message.content) == {"name": "Ada", "age": 36}
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        openai_client.chat.completions.create(
            model=model,
            response_format=RF,
            messages=[{"role": "user", "content": "who [[badjson]]"}],
        )
    assert "does not match" in exc.value.message and "age" in exc.value.message


@pytest.mark.parametrize("model", MODELS)
def test_json_schema_violation_in_a_stream_is_an_error_event(openai_client, model):
    stream = openai_client.chat.completions.create(
        model=model,
        response_format=RF,
        stream=True,
        messages=[{"role": "user", "content": "who [[badjson]]"}],
    )
    with pytest.raises(openai.APIError) as exc:
        for _ in stream:
            pass
    assert "does not match" in str(exc.value)


def test_json_object_mode_rejects_non_json(openai_client):
    r = openai_client.chat.completions.create(
        model="gpt",
        response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "[[json]]"}],
    )
    assert json.loads(r.choices[0].message.content)["name"] == "Ada"
    with pytest.raises(openai.UnprocessableEntityError):
        openai_client.chat.completions.create(
            model="gpt",
            response_format={"type": "json_object"},
            messages=[{"role": "user", "content": "plain words"}],
        )


def test_anthropic_stream_usage_is_cumulative_not_summed(anthropic_client):
    with anthropic_client.messages.stream(
        model="claude",
        max_tokens=100,
        messages=[{"role": "user", "content": "one two three four five"}],
    ) as s:
        final = s.get_final_message()
    with anthropic_client.messages.stream(
        model="gpt",
        max_tokens=100,
        messages=[{"role": "user", "content": "one two three four five"}],
    ) as s:
        via_openai = s.get_final_message()
    direct = anthropic_client.messages.create(
        model="claude",
        max_tokens=100,
        messages=[{"role": "user", "content": "one two three four five"}],
    )
    assert final.usage.output_tokens == direct.usage.output_tokens
    assert (
        final.usage.input_tokens == direct.usage.input_tokens == via_openai.usage.input_tokens == 5
    )


def test_models_endpoint_reads_in_both_sdks(openai_client, anthropic_client):
    ids = [m.id for m in openai_client.models.list()]
    # minilm: the in-process embedding model
    assert ids == ["claude", "gpt", "llama", "textonly", "minilm"]
    page = anthropic_client.models.list()
    assert [m.id for m in page.data] == ids
    assert openai_client.models.retrieve("gpt").owned_by == "openai"
    with pytest.raises(openai.NotFoundError):
        openai_client.models.retrieve("nope")
    assert anthropic_client.models.retrieve("claude").display_name == "claude"
    assert openai_client.models.retrieve("minilm").owned_by == "flashstack"


def test_health_endpoints(gateway):
    import httpx

    assert httpx.get(gateway.url + "/health/liveness").json() == {"status": "ok"}
    r = httpx.get(gateway.url + "/health/readiness")
    body = r.json()
    assert r.status_code == 200 and body["status"] == "ready"
    assert set(body["models"]) == {"claude", "gpt", "llama", "textonly"}
    assert all(d["ok"] for deps in body["models"].values() for d in deps)

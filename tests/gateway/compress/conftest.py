"""Shared pieces: one embedder per test session, conversations with tool calls, a
small-window gateway."""

from __future__ import annotations

from pathlib import Path

import pytest

from flashstack.gateway.app import create_app
from flashstack.gateway.compress import Compressor
from flashstack.gateway.config import CompressionConfig, Config, ModelConfig, ServerConfig
from flashstack.gateway.core import ChatRequest, Message, Text, ToolCall, ToolResult
from tests.fakes.server import FakeServer
from tests.gateway.conftest import API_KEY

# The built ONNX models live where `flashstack serve` keeps them, so a machine builds them once.
MODELS_DIR = Path(__file__).resolve().parents[3] / ".flashstack" / "models"
SMALL_WINDOW = 1_500

TOPICS = [
    "The billing database migration to PostgreSQL needs a maintenance window and a rollback plan.",
    "The frontend checkout page flickers on Safari and the design team wants new icons.",
    "The Lisbon offsite hotel is booked and the train to Porto leaves on Thursday morning.",
    "The embedding model overfits after two epochs and needs harder negatives in the eval set.",
]


@pytest.fixture(scope="session")
def embedder():
    from flashstack.gateway.compress.embed import Embedder

    e = Embedder(MODELS_DIR)
    yield e
    e.close()


@pytest.fixture
def compressor(embedder):
    def make(**cfg) -> Compressor:
        return Compressor(CompressionConfig(**cfg), MODELS_DIR.parent, embedder=embedder)

    return make


def model(**kw) -> ModelConfig:
    return ModelConfig(
        **{
            "name": "m",
            "provider": "openai",
            "model": "gpt-4-0613",
            "api_base": "http://unused",
            **kw,
        }
    )


def long_conversation(
    n: int = 40, tools_every: int = 5, fact: str = "The vault code is 7351."
) -> ChatRequest:
    """n older messages over four topics, a tool call + result every few turns, one planted fact."""
    msgs: list[Message] = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        if i % tools_every == tools_every - 1:
            call = ToolCall(f"call_{i}", "lookup", f'{{"q": "item {i}"}}')
            msgs.append(Message("assistant", [Text(f"Let me look up item {i}."), call]))
            msgs.append(
                Message("user", [ToolResult(f"call_{i}", [Text(f"Item {i}: {topic} " * 3)])])
            )
            continue
        role = "user" if len(msgs) % 2 == 0 else "assistant"
        text = f"Message {i}. {topic} " * 4
        if i == 3:
            text += fact
        msgs.append(Message(role, [Text(text)]))
    if msgs[-1].role == "user":
        msgs.append(Message("assistant", [Text("Noted.")]))
    msgs.append(Message("user", [Text("What is the vault code?")]))
    return ChatRequest(model="m", messages=msgs, system=[Text("You are a careful assistant.")])


@pytest.fixture(scope="session")
def small_gateway(upstreams):
    """A gateway whose `tiny` model has a 1,500-token window, served by the fake OpenAI upstream."""
    config = Config(
        server=ServerConfig(max_body_bytes=4 * 1024 * 1024),
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
            ModelConfig(
                name="tiny-claude",
                provider="anthropic",
                model="claude-sonnet-4-5",
                context_window=SMALL_WINDOW,
                max_output_tokens=100,
                api_base=upstreams["anthropic"].url,
                api_key=API_KEY,
            ),
        ],
        compression=CompressionConfig(cache_dir=MODELS_DIR, preload=True),
        state_dir=MODELS_DIR.parent,
    )
    server = FakeServer(create_app(config), lifespan="on", loop="uvloop").start()
    # preloaded: no request is truncated meanwhile
    assert server.app.services.compressor.wait_loaded(60)
    yield server
    server.stop()

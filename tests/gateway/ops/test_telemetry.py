"""OpenTelemetry: a server span per request, a client span per attempt, GenAI
attributes, W3C context."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from flashstack.gateway import telemetry
from flashstack.gateway.app import create_app
from flashstack.gateway.config import Config, ModelConfig, RouterConfig, TelemetryConfig
from flashstack.gateway.telemetry import Tracing
from tests.fakes.server import FakeServer
from tests.gateway.ops import metered_upstream

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once closed: a connection is refused


@pytest.fixture(scope="module")
def upstream():
    server = FakeServer(
        metered_upstream.create_app(input_tokens=1000, cache_read=100, cache_write=50)
    ).start()
    yield server
    server.stop()


def _config(upstream: FakeServer, tmp, **telemetry_fields) -> Config:
    dead = f"http://127.0.0.1:{_closed_port()}"
    return Config(
        router=RouterConfig(
            num_retries=1,
            retry_backoff=0,
            health_check_interval=0,
            breaker_failures=10**6,
            breaker_min_requests=10**6,
        ),
        models=[
            ModelConfig(
                name="flaky",
                provider="anthropic",
                model="claude-haiku-4-5",
                api_base=dead,
                api_key="k",
                fallbacks=["sonnet"],
            ),
            ModelConfig(
                name="sonnet",
                provider="anthropic",
                model="claude-sonnet-4-5",
                api_base=upstream.url,
                api_key="k",
            ),
        ],
        telemetry=TelemetryConfig(**telemetry_fields),
        state_dir=tmp,
    )


@pytest.fixture(scope="module")
def traced(upstream, tmp_path_factory):
    exporter = InMemorySpanExporter()
    tracing = Tracing.with_processor(SimpleSpanProcessor(exporter))
    app = create_app(_config(upstream, tmp_path_factory.mktemp("state")), tracing=tracing)
    server = FakeServer(app, lifespan="on", loop="uvloop").start()
    yield server, exporter
    server.stop()


def _post(
    url: str, stream: bool = False, model: str = "flaky", headers: dict | None = None
) -> httpx.Response:
    body = {
        "model": model,
        "max_tokens": 100,
        "stream": stream,
        "temperature": 0.5,
        "messages": [{"role": "user", "content": "hello"}],
    }
    return httpx.post(
        url + "/v1/messages",
        json=body,
        timeout=20,
        headers={"anthropic-version": "2023-06-01", **(headers or {})},
    )


def _wait_for(exporter: InMemorySpanExporter, n: int) -> list:
    deadline = time.monotonic() + 5
    while len(exporter.get_finished_spans()) < n and time.monotonic() < deadline:
        time.sleep(0.01)  # a stream's spans end after its last event went out
    return list(exporter.get_finished_spans())


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_span_tree_retries_and_fallback(traced, upstream, stream):
    server, exporter = traced
    exporter.clear()
    upstream.app.state.headers.clear()
    r = _post(server.url, stream, headers={"traceparent": TRACEPARENT})
    assert r.status_code == 200, r.text
    spans = _wait_for(exporter, 4)
    root = next(s for s in spans if s.kind.name == "SERVER")
    attempts = sorted((s for s in spans if s.kind.name == "CLIENT"), key=lambda s: s.start_time)
    assert len(spans) == 4 and len(attempts) == 3
    # The client's trace continues: the request span is the child of its traceparent.
    assert (
        f"{root.context.trace_id:032x}" == CLIENT_TRACE
        and f"{root.parent.span_id:016x}" == CLIENT_SPAN
    )
    # retries and fallbacks: siblings
    assert all(a.parent.span_id == root.context.span_id for a in attempts)
    assert root.name == "chat flaky"
    assert (
        root.attributes["gen_ai.request.model"] == "flaky"
        and root.attributes["http.response.status_code"] == 200
    )
    assert (
        root.attributes["flashstack.attempts"] == 3
        and root.attributes["flashstack.deployment"] == "sonnet#0"
    )
    # Two attempts on the dead deployment (the retry, then the fallback's), both failed.
    for a in attempts[:2]:
        assert a.name == "chat claude-haiku-4-5" and a.status.status_code.name == "ERROR"
        assert (
            a.attributes["flashstack.deployment"] == "flaky#0"
            and a.attributes["error.type"] == "502"
        )
    ok = attempts[2]
    assert ok.name == "chat claude-sonnet-4-5" and ok.status.status_code.name == "UNSET"
    assert [a.attributes["flashstack.attempt"] for a in attempts] == [1, 2, 3]
    expected = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "anthropic",
        "gen_ai.request.model": "claude-sonnet-4-5",
        "gen_ai.request.max_tokens": 100,
        "gen_ai.request.temperature": 0.5,
        "gen_ai.response.model": "claude-sonnet-4-5",
        "gen_ai.response.finish_reasons": ("end_turn",),
        "gen_ai.usage.input_tokens": 1150,
        "gen_ai.usage.output_tokens": 100,
        "gen_ai.usage.cache_read.input_tokens": 100,
        "gen_ai.usage.cache_creation.input_tokens": 50,
    }
    assert {k: ok.attributes.get(k) for k in expected} == expected
    assert (
        root.attributes["gen_ai.usage.input_tokens"] == 1150
        and root.attributes["flashstack.cost_usd"] > 0
    )
    # The serving attempt's context went upstream.
    sent = upstream.app.state.headers[-1]["traceparent"]
    assert sent == f"00-{CLIENT_TRACE}-{ok.context.span_id:016x}-01"


def test_without_traceparent_a_new_trace_and_a_4xx_is_not_an_error(traced):
    server, exporter = traced
    exporter.clear()
    assert _post(server.url, model="nope").status_code == 404
    (root,) = _wait_for(exporter, 1)
    assert root.parent is None and root.attributes["http.response.status_code"] == 404
    assert root.status.status_code.name == "UNSET" and root.attributes["error.type"] == "404"


def test_off_by_default_and_the_standard_variables():
    off = TelemetryConfig()
    assert not telemetry.enabled(off, {})
    assert Tracing.from_config(off, {}) is None
    assert telemetry.enabled(off, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert not telemetry.enabled(
        off, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"}
    )
    assert not telemetry.enabled(
        TelemetryConfig(enabled=False), {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c"}
    )
    assert telemetry.outgoing_headers({"a": "b"}) == {"a": "b"}  # no attempt traced: nothing added


class Receiver:
    """An OTLP/HTTP trace receiver: decodes each protobuf ExportTraceServiceRequest it is sent."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.content_types: list[str] = []
        self.tokens: list[str] = []  # each export's x-collector-token header
        self.lock = threading.Lock()

        async def traces(request: Request) -> Response:
            msg = ExportTraceServiceRequest.FromString(await request.body())
            with self.lock:
                self.requests.append(msg)
                self.content_types.append(request.headers.get("content-type", ""))
                self.tokens.append(request.headers.get("x-collector-token", ""))
            return Response(b"", media_type="application/x-protobuf")

        self.server = FakeServer(
            Starlette(routes=[Route("/v1/traces", traces, methods=["POST"])])
        ).start()

    def spans(self) -> list:
        with self.lock:
            return [
                (r.resource, s)
                for m in self.requests
                for r in m.resource_spans
                for ss in r.scope_spans
                for s in ss.spans
            ]


def test_exported_over_otlp_http_protobuf(upstream, tmp_path):
    receiver = Receiver()
    try:
        config = _config(
            upstream,
            tmp_path,
            enabled=True,
            endpoint=receiver.server.url + "/v1/traces",
            service_name="gw-under-test",
            headers={"x-collector-token": "t0ken"},
        )
        gateway = FakeServer(create_app(config), lifespan="on", loop="uvloop").start()
        try:
            assert (
                _post(gateway.url, model="sonnet", headers={"traceparent": TRACEPARENT}).status_code
                == 200
            )
        finally:
            gateway.stop()  # shutdown flushes the batch
        spans = receiver.spans()
    finally:
        receiver.server.stop()
    assert receiver.content_types and all(
        c == "application/x-protobuf" for c in receiver.content_types
    )
    assert len(spans) == 2
    resource = {a.key: a.value.string_value for a in spans[0][0].attributes}
    assert resource["service.name"] == "gw-under-test"
    by_kind = {s.kind: s for _, s in spans}
    server, client = by_kind[2], by_kind[3]  # SPAN_KIND_SERVER, SPAN_KIND_CLIENT
    assert server.trace_id.hex() == CLIENT_TRACE and server.parent_span_id.hex() == CLIENT_SPAN
    assert client.trace_id == server.trace_id and client.parent_span_id == server.span_id
    attrs = {a.key: a.value for a in client.attributes}
    assert attrs["gen_ai.request.model"].string_value == "claude-sonnet-4-5"
    assert attrs["gen_ai.usage.output_tokens"].int_value == 100
    assert attrs["gen_ai.usage.input_tokens"].int_value == 1150


def test_the_standard_otel_variables_alone_turn_export_on(upstream, tmp_path, monkeypatch):
    """No telemetry in the config: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (and the exporter's own
    OTEL_EXPORTER_OTLP_HEADERS) are enough, as the OpenTelemetry SDK reads them."""
    receiver = Receiver()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.server.url + "/v1/traces")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-collector-token=from-env")
        gateway = FakeServer(create_app(_config(upstream, tmp_path)), lifespan="on").start()
        try:
            assert _post(gateway.url, model="sonnet").status_code == 200
        finally:
            gateway.stop()  # shutdown flushes the batch
        spans = receiver.spans()
    finally:
        receiver.server.stop()
    assert sorted(s.kind for _, s in spans) == [2, 3]  # the request's server span and its attempt's
    assert receiver.tokens == ["from-env"]

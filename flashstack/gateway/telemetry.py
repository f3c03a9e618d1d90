"""OpenTelemetry traces: a server span per request, a client span per upstream attempt, and for the
local engine its queue, prefill and decode under the attempt.

Off by default (`telemetry.enabled`, or the standard OTEL_EXPORTER_OTLP_*ENDPOINT variables); off,
nothing here imports the SDK and a request pays one `is None` test. Attributes follow the
OpenTelemetry GenAI semantic conventions (`gen_ai.request.model`, `gen_ai.usage.input_tokens`, ...).
A client's W3C `traceparent` is the request span's parent, and each attempt's own context goes
upstream in the `traceparent` of its HTTP request (providers/http.py asks `outgoing_headers`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from flashstack.gateway.config import ModelConfig, TelemetryConfig
from flashstack.gateway.core import ChatRequest, GatewayError, Usage

# The attempt span whose HTTP request is being sent (and its tracer). A context variable, not an
# argument, because the request goes out several calls below the router, inside the provider,
# within this one task.
_ATTEMPT: ContextVar[Any] = ContextVar("flashstack_attempt_span", default=None)
_TRACER: ContextVar[Any] = ContextVar("flashstack_attempt_tracer", default=None)
# The local engine's stages, each the span of one stretch of its per-request
# timeline (RequestTimes).
ENGINE_STAGES = (
    ("queue", "arrival", "first_scheduled"),
    ("prefill", "first_scheduled", "first_token"),
    ("decode", "first_token", "finished"),
)
_PROVIDER_NAMES = {"anthropic": "anthropic", "openai": "openai"}  # GenAI well-known provider names
_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def enabled(cfg: TelemetryConfig, env: Mapping[str, str]) -> bool:
    """On when configured so, or (unset) when an OTLP endpoint variable is set and the SDK
    not disabled."""
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    return cfg.enabled if cfg.enabled is not None else any(env.get(v) for v in _ENDPOINT_VARS)


class Tracing:
    """A tracer of its own (never the process-global provider), and the spans the gateway makes."""

    def __init__(self, provider: Any) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.tracer = provider.get_tracer("flashstack.gateway")
        self._trace = trace
        self._propagator = TraceContextTextMapPropagator()

    @classmethod
    def from_config(cls, cfg: TelemetryConfig, env: Mapping[str, str]) -> Tracing | None:
        """OTLP/HTTP export in batches, or None when tracing is off."""
        if not enabled(cfg, env):
            return None
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        exporter = OTLPSpanExporter(endpoint=cfg.endpoint, headers=cfg.headers or None)
        return cls.with_processor(BatchSpanProcessor(exporter), cfg)

    @classmethod
    def with_processor(cls, processor: Any, cfg: TelemetryConfig | None = None) -> Tracing:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        cfg = cfg or TelemetryConfig(enabled=True)
        provider = TracerProvider(
            resource=Resource.create({"service.name": cfg.service_name}),
            sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)),
        )
        provider.add_span_processor(processor)
        return cls(provider)

    def request_span(self, headers: Mapping[str, str], method: str, path: str) -> Any:
        """The server span of one request, child of the client's `traceparent` when it sent one."""
        parent = self._propagator.extract(headers) if "traceparent" in headers else None
        return self.tracer.start_span(
            "chat",
            context=parent,
            kind=self._trace.SpanKind.SERVER,
            attributes={
                "gen_ai.operation.name": "chat",
                "http.request.method": method,
                "url.path": path,
            },
        )

    def attempt_span(
        self,
        parent: Any,
        dep_id: str,
        cfg: ModelConfig,
        req: ChatRequest,
        n: int,
        operation: str = "chat",
    ) -> Any:
        """The client span of one attempt on one deployment (retries and fallbacks are siblings)."""
        attrs = request_attributes(req)
        attrs.update(
            {
                "gen_ai.operation.name": operation,
                "gen_ai.provider.name": _PROVIDER_NAMES.get(cfg.provider, cfg.provider),
                "gen_ai.request.model": cfg.model,  # what this upstream was asked for
                "flashstack.deployment": dep_id,
                "flashstack.model": cfg.name,
                "flashstack.attempt": n,
            }
        )
        return self.tracer.start_span(
            f"{operation} {cfg.model}",
            context=self._trace.set_span_in_context(parent),
            kind=self._trace.SpanKind.CLIENT,
            attributes=attrs,
        )

    def shutdown(self) -> None:
        self.provider.shutdown()  # flushes what the batch processor still holds


def request_attributes(req: ChatRequest) -> dict[str, Any]:
    attrs: dict[str, Any] = {"gen_ai.request.model": req.model}
    for name, value in (
        ("max_tokens", req.max_tokens),
        ("temperature", req.temperature),
        ("top_p", req.top_p),
        ("top_k", req.top_k),
        ("seed", req.seed),
    ):
        if value is not None:
            attrs[f"gen_ai.request.{name}"] = value
    if req.stop:
        attrs["gen_ai.request.stop_sequences"] = list(req.stop)
    return attrs


def usage_attributes(usage: Usage) -> dict[str, int]:
    """GenAI usage: input tokens count every prompt token, cached ones too, which are
    also given apart."""
    return {
        "gen_ai.usage.input_tokens": usage.input_tokens
        + usage.cache_read_input_tokens
        + usage.cache_creation_input_tokens,
        "gen_ai.usage.output_tokens": usage.output_tokens,
        "gen_ai.usage.cache_read.input_tokens": usage.cache_read_input_tokens,
        "gen_ai.usage.cache_creation.input_tokens": usage.cache_creation_input_tokens,
    }


def end_attempt(
    span: Any,
    error: BaseException | None = None,
    usage: Usage | None = None,
    response_model: str | None = None,
    finish_reason: str | None = None,
) -> None:
    if span is None:
        return
    if usage is not None:
        span.set_attributes(usage_attributes(usage))
    if response_model:
        span.set_attribute("gen_ai.response.model", response_model)
    if finish_reason:
        span.set_attribute("gen_ai.response.finish_reasons", [finish_reason])
    if error is not None:
        _failed(span, error)
    span.end()


def _failed(span: Any, error: BaseException) -> None:
    from opentelemetry.trace import Status, StatusCode

    if isinstance(error, GatewayError):
        kind = error.code or str(error.status)
        span.set_attribute("http.response.status_code", error.status)
        message = error.message
    else:
        kind, message = type(error).__name__, "the request was interrupted"
    span.set_attribute("error.type", kind)
    span.set_status(Status(StatusCode.ERROR, message[:200]))


def end_request(span: Any, status: int, attributes: dict[str, Any]) -> None:
    if span is None:
        return
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("http.response.status_code", status)
    span.set_attributes({k: v for k, v in attributes.items() if v is not None})
    if status >= 400:
        span.set_attribute("error.type", str(status))
    if status >= 500:  # a server span's error is the server's fault (a 4xx is the client's)
        span.set_status(Status(StatusCode.ERROR))
    span.end()


@contextmanager
def sending(span: Any, tracing: Tracing | None = None) -> Iterator[None]:
    """Within the block, HTTP requests to upstreams carry `span`'s context (and the local engine's
    stages become its children, made by `tracing`)."""
    if span is None:
        yield
        return
    token = _ATTEMPT.set(span)
    tracer = _TRACER.set(tracing.tracer if tracing is not None else None)
    try:
        yield
    finally:
        _TRACER.reset(tracer)
        _ATTEMPT.reset(token)


@dataclass(frozen=True, slots=True)
class EngineTrace:
    """Where the local engine's stage spans go: the attempt being sent when its request began."""

    attempt: Any
    tracer: Any

    @classmethod
    def current(cls) -> EngineTrace | None:
        span, tracer = _ATTEMPT.get(), _TRACER.get()
        return None if span is None or tracer is None else cls(span, tracer)

    def stages(
        self, times: Any, prompt_tokens: int, cached_tokens: int, output_tokens: int
    ) -> None:
        """`queue`, `prefill` and `decode` under the attempt, timed by the engine's own timestamps
        (`times`: RequestTimes, time.monotonic() seconds); a stage it never reached has none."""
        from opentelemetry import trace

        to_unix_ns = time.time_ns() - time.monotonic_ns()  # one offset: the stages keep their order
        context = trace.set_span_in_context(self.attempt)
        attributes = {
            "queue": {},
            "prefill": {
                "gen_ai.usage.input_tokens": prompt_tokens,
                "gen_ai.usage.cache_read.input_tokens": cached_tokens,
            },
            "decode": {"gen_ai.usage.output_tokens": output_tokens},
        }
        for name, begin, end in ENGINE_STAGES:
            t0, t1 = getattr(times, begin), getattr(times, end)
            if t0 is None or t1 is None:
                continue
            span = self.tracer.start_span(
                name,
                context=context,
                kind=trace.SpanKind.INTERNAL,
                start_time=int(t0 * 1e9) + to_unix_ns,
                attributes=attributes[name],
            )
            span.end(end_time=int(t1 * 1e9) + to_unix_ns)


def outgoing_headers(headers: dict[str, str] | None) -> dict[str, str] | None:
    """`headers` plus the W3C traceparent (and tracestate) of the attempt being sent, if any."""
    span = _ATTEMPT.get()
    if span is None:
        return headers
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return headers
    out = dict(headers or {})
    out["traceparent"] = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"
    if ctx.trace_state:
        out["tracestate"] = ctx.trace_state.to_header()
    return out

"""Prometheus metrics of the router, in a registry of its own (one per gateway app)."""

from __future__ import annotations

from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

M = TypeVar("M", Counter, Gauge, Histogram)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _Labelled(Generic[M]):
    """A labelled metric whose children are looked up in a dict: prometheus_client's `labels()`
    takes a lock and re-validates the values on every call, ~10 % of a request's CPU
    (docs/benchmarks.md)."""

    __slots__ = ("metric", "children")

    def __init__(self, metric: M) -> None:
        self.metric = metric
        self.children: dict[tuple[str, ...], M] = {}

    def labels(self, *values: str) -> M:
        child = self.children.get(values)
        if child is None:
            child = self.children[values] = self.metric.labels(*values)
        return child


class RouterMetrics:
    """Requests, latency and TTFT histograms, fallbacks, retries, breaker state, in-flight."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = _Labelled(
            Counter(
                "flashstack_requests",
                "Routed chat requests by outcome",
                ["model", "outcome"],
                registry=r,
            )
        )
        self.attempts = _Labelled(
            Counter(
                "flashstack_upstream_attempts",
                "Attempts on a deployment by result",
                ["deployment", "result"],
                registry=r,
            )
        )
        self.latency = _Labelled(
            Histogram(
                "flashstack_request_latency_seconds",
                "Time to the routed response (non-stream) or first token (stream)",
                ["model", "stream"],
                buckets=_LATENCY_BUCKETS,
                registry=r,
            )
        )
        self.ttft = _Labelled(
            Histogram(
                "flashstack_upstream_ttft_seconds",
                "Time to first token per deployment",
                ["deployment"],
                buckets=_LATENCY_BUCKETS,
                registry=r,
            )
        )
        self.fallbacks = _Labelled(
            Counter(
                "flashstack_fallbacks",
                "Fallbacks taken between model groups",
                ["from_model", "to_model", "reason"],
                registry=r,
            )
        )
        self.retries = _Labelled(
            Counter("flashstack_retries", "Retries inside one model group", ["model"], registry=r)
        )
        self.breaker = _Labelled(
            Gauge(
                "flashstack_breaker_state",
                "Circuit breaker per deployment: 0 closed, 1 half-open, 2 open",
                ["deployment"],
                registry=r,
            )
        )
        self.breaker_opened = _Labelled(
            Counter(
                "flashstack_breaker_opened",
                "Times this replica opened a breaker",
                ["deployment"],
                registry=r,
            )
        )
        self.in_flight = _Labelled(
            Gauge(
                "flashstack_in_flight",
                "Requests in flight on a deployment (this replica)",
                ["deployment"],
                registry=r,
            )
        )
        self.health = _Labelled(
            Gauge(
                "flashstack_health_check_up",
                "Last active health probe: 1 passed, 0 failed",
                ["deployment"],
                registry=r,
            )
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""Prometheus metrics of the router, in a registry of its own (one per gateway app)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class RouterMetrics:
    """Requests, latency and TTFT histograms, fallbacks, retries, breaker state, in-flight."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("flashstack_requests", "Routed chat requests by outcome",
                                ["model", "outcome"], registry=r)
        self.attempts = Counter("flashstack_upstream_attempts", "Attempts on a deployment by result",
                                ["deployment", "result"], registry=r)
        self.latency = Histogram("flashstack_request_latency_seconds",
                                 "Time to the routed response (non-stream) or first token (stream)",
                                 ["model", "stream"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("flashstack_upstream_ttft_seconds", "Time to first token per deployment",
                              ["deployment"], buckets=_LATENCY_BUCKETS, registry=r)
        self.fallbacks = Counter("flashstack_fallbacks", "Fallbacks taken between model groups",
                                 ["from_model", "to_model", "reason"], registry=r)
        self.retries = Counter("flashstack_retries", "Retries inside one model group", ["model"], registry=r)
        self.breaker = Gauge("flashstack_breaker_state",
                             "Circuit breaker per deployment: 0 closed, 1 half-open, 2 open",
                             ["deployment"], registry=r)
        self.breaker_opened = Counter("flashstack_breaker_opened", "Times this replica opened a breaker",
                                      ["deployment"], registry=r)
        self.in_flight = Gauge("flashstack_in_flight", "Requests in flight on a deployment (this replica)",
                               ["deployment"], registry=r)
        self.health = Gauge("flashstack_health_check_up",
                            "Last active health probe: 1 passed, 0 failed", ["deployment"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

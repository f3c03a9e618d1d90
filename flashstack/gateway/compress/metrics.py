"""Prometheus counters of compression, in a registry of their own (GET /metrics appends them)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest

from flashstack.gateway.compress.outcome import Outcome


class CompressionMetrics:
    """Prometheus counters of compression, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "flashstack_compression_requests",
            "Requests compression acted on, by action",
            ["model", "action"],
            registry=r,
        )
        self.tokens_saved = Counter(
            "flashstack_compression_tokens_saved", "Prompt tokens removed", ["model"], registry=r
        )
        self.summarized = Counter(
            "flashstack_compression_messages_summarized",
            "Messages replaced by summaries",
            ["model"],
            registry=r,
        )
        self.dropped = Counter(
            "flashstack_compression_messages_dropped",
            "Messages dropped entirely",
            ["model"],
            registry=r,
        )
        self.refused = Counter(
            "flashstack_compression_refused",
            "Requests refused as context_length_exceeded",
            ["model"],
            registry=r,
        )
        self.fallbacks = Counter(
            "flashstack_compression_fallbacks",
            "Requests truncated instead of compressed",
            ["model", "reason"],
            registry=r,
        )
        self.summarizer_fallbacks = Counter(
            "flashstack_compression_summarizer_fallbacks",
            "Compressed requests whose model summaries were (partly) extractive instead",
            ["model", "reason"],
            registry=r,
        )

    def record(self, model: str, outcome: Outcome) -> None:
        self.requests.labels(model, outcome.action).inc()
        self.tokens_saved.labels(model).inc(max(0, outcome.tokens_before - outcome.tokens_after))
        self.summarized.labels(model).inc(outcome.messages_summarized)
        self.dropped.labels(model).inc(outcome.messages_dropped)
        if outcome.fallback is not None:
            self.fallbacks.labels(model, outcome.fallback).inc()
        if outcome.summarizer_fallback is not None:
            self.summarizer_fallbacks.labels(model, outcome.summarizer_fallback).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""The engine server's `/metrics`: Prometheus text under vLLM's names, so its dashboards work."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from flashstack.engine.llm import EngineStats
from flashstack.engine.outputs import StreamDelta

# vLLM's own buckets, so a histogram here lines up with one scraped from vLLM.
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_TPOT_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
    20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
)  # fmt: skip


class _EngineState(Collector):
    """Gauges and counters read from the engine at scrape time: nothing to keep in sync."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self.stats, self.model_name = stats, model_name

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        st = self.stats()
        labels = [self.model_name]
        running, waiting = st.running, st.waiting
        usage = st.used_blocks / st.num_blocks
        yield self._gauge("vllm:num_requests_running", "Requests in the running batch.", running)
        yield self._gauge("vllm:num_requests_waiting", "Requests waiting or swapped out.", waiting)
        yield self._gauge("vllm:kv_cache_usage_perc", "KV blocks in use (0 to 1).", usage)
        yield self._gauge("vllm:gpu_cache_usage_perc", "vLLM v0's vllm:kv_cache_usage_perc.", usage)
        # The block manager counts full blocks; vLLM counts tokens.
        bs = st.block_size
        queries, hits = st.prefix_queries * bs, st.prefix_hits * bs
        for name, doc, value in (
            ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", queries),
            ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", hits),
            ("vllm:num_preemptions", "Preemptions since start.", st.preemptions),
        ):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(labels, value)
            yield c

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=["model_name"])
        g.add_metric([self.model_name], value)
        return g


class ServerMetrics:
    """One registry per server: engine state at scrape time, request histograms as requests end."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineState(stats, model_name))
        self.model_name = model_name
        labels = ["model_name"]

        reg = self.registry

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=reg).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=reg).labels(model_name)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.tpot = hist(
            "vllm:time_per_output_token_seconds", "Mean gap between output tokens.", _TPOT_BUCKETS
        )
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Arrival to end.", _LATENCY_BUCKETS)
        self.queue = hist(
            "vllm:request_queue_time_seconds", "Arrival to first scheduled step.", _LATENCY_BUCKETS
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of ended requests.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.")
        self.success = Counter(
            "vllm:request_success",
            "Requests ended, by finish reason.",
            [*labels, "finished_reason"],
            registry=reg,
        )

    def observe_finished(self, delta: StreamDelta) -> None:
        """Record a request's last delta (its timeline rides on it)."""
        self.prompt_tokens.inc(delta.prompt_tokens)
        self.generation_tokens.inc(delta.completion_tokens)
        self.success.labels(self.model_name, delta.finish_reason or "abort").inc()
        t = delta.times
        if t is None:
            return
        for hist, value in (
            (self.ttft, t.time_to_first_token),
            (self.tpot, t.time_per_output_token(delta.completion_tokens)),
            (self.e2e, t.e2e_latency),
            (self.queue, t.queue_time),
        ):
            if value is not None:
                hist.observe(value)

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)

"""Context-window compression: keep what the next answer needs, summarize or drop the rest.

When prompt + output reserve passes `threshold` × the model's window, messages are grouped into
units that must stay whole (a tool call with its results), and the newest `keep_last_turns`
messages, pinned messages, the system prompt and tool schemas are kept. The other units are ranked
by embedding similarity to the latest user turn: the most relevant stay verbatim, the rest are
clustered with DBSCAN (cosine distance) and each cluster is replaced by a summary in the system
prompt: extractive (its most central sentences), or written by a routed model (`llm`) or by a model
on the in-process engine (`local`, gateway/summarize.py), which fall back to the extractive one.
A conversation whose kept part alone does not fit gets a 400 `context_length_exceeded`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import math
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from prometheus_client import CollectorRegistry, Counter, generate_latest

from flashstack.config import CompressionConfig, CompressionMode, ModelConfig
from flashstack.gateway import tokens
from flashstack.gateway.core import ChatRequest, ErrorKind, GatewayError, Message, Text, ToolCall, ToolResult
from flashstack.gateway.core import invalid_request
from flashstack.gateway.summarize import SUMMARIZE_PROMPT, LocalSummarizer

if TYPE_CHECKING:
    import numpy as np  # imported where used: 16 MB that a gateway which never compresses need not hold

    from flashstack.gateway.embed import Budget, Embedder
    from flashstack.gateway.router import Router

log = logging.getLogger("flashstack.gateway.compress")

MODES: tuple[CompressionMode, ...] = ("auto", "off", "truncate")
# Why a request that needed compression was truncated instead (x-flashstack-compression-fallback).
Fallback = Literal["warming-up", "unavailable", "budget"]
# Why a cluster's summary is extractive although a model summarizer is configured
# (x-flashstack-summarizer-fallback); the request is still compressed.
SummarizerFallback = Literal["warming-up", "unavailable", "budget", "error"]
LoadState = Literal["idle", "loading", "ready", "failed"]  # of the embedding model
VERBATIM_SHARE = 0.6  # of the free budget, for the most relevant old units; the rest for summaries
MIN_SUMMARY_TOKENS = 24  # a cluster summary shorter than this says nothing; drop the cluster instead
CHUNK_WORDS = 180  # MiniLM reads 256 word pieces; longer messages are embedded in chunks
MAX_SENTENCES = 200  # per cluster, for extractive summaries
SOURCE_UNITS = 3  # extractive summaries draw on this many most central + most relevant units
SUMMARY_HEADER = (
    "Earlier parts of this conversation were compressed by the gateway to fit the model's context "
    "window. Summaries of the omitted messages, oldest first:"
)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")


def context_length_exceeded(message: str, param: str = "messages") -> GatewayError:
    """The 400 a conversation gets when even its kept part does not fit the window."""
    return GatewayError(ErrorKind.INVALID_REQUEST, message, param=param, code="context_length_exceeded")


# ---- what the caller asked for ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Options:
    """The request's `compression` extension: a mode, or {"mode": ..., "pinned": [message indexes]}."""

    mode: CompressionMode | None = None
    pinned: frozenset[int] = frozenset()


def request_options(req: ChatRequest) -> Options:
    """Parse `compression` from the request's extension fields; bad values are the caller's 400."""
    raw = req.extensions.get("compression")
    if raw is None:
        return Options()
    if isinstance(raw, str):
        return Options(_mode(raw))
    if not isinstance(raw, dict) or set(raw) - {"mode", "pinned"}:
        raise invalid_request(
            'compression must be "auto", "off", "truncate" or an object {"mode": ..., "pinned": [indexes]}',
            "compression",
        )
    pinned = raw.get("pinned", [])
    if not isinstance(pinned, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(req.messages) for i in pinned
    ):
        raise invalid_request(
            f"compression.pinned must list message indexes between 0 and {len(req.messages) - 1}",
            "compression.pinned",
        )
    mode = raw.get("mode")
    return Options(None if mode is None else _mode(mode), frozenset(pinned))


def shift_pinned(req: ChatRequest, offset: int) -> None:
    """Keep `compression.pinned` pointing at the caller's messages once `offset` stored ones precede them."""
    raw = req.extensions.get("compression")
    if offset and isinstance(raw, dict) and raw.get("pinned"):
        req.extensions["compression"] = {**raw, "pinned": [i + offset for i in raw["pinned"]]}


def _mode(value: Any, param: str = "compression") -> CompressionMode:
    if value not in MODES:
        raise invalid_request(f"{param} must be one of {', '.join(MODES)}; got {value!r}", param)
    return value


def session_mode(metadata: dict[str, Any]) -> CompressionMode | None:
    """A session's `metadata.compression`, checked (400 at session create/update when it is bad)."""
    value = metadata.get("compression")
    return None if value is None else _mode(value, "metadata.compression")


# ---- what happened ---------------------------------------------------------------------------


@dataclass(slots=True)
class Outcome:
    """What compression did to one request; becomes response headers and metrics."""

    action: Literal["none", "compressed", "truncated"]
    tokens_before: int
    tokens_after: int
    messages_summarized: int = 0
    messages_dropped: int = 0
    fallback: Fallback | None = None  # truncated although the mode was auto, and why
    # How many summaries each summarizer wrote: extractive, llm:<model>, local:<model>.
    summarizers: dict[str, int] = field(default_factory=dict)
    summarizer_fallback: SummarizerFallback | None = None  # a model summary replaced by an extractive one

    def stamp(self, response: Any) -> Any:
        """`response` with this outcome's headers added."""
        response.headers.update(self.headers())
        return response

    def headers(self) -> dict[str, str]:
        if self.action == "none":
            return {}
        out = {
            "x-flashstack-compression": self.action,
            "x-flashstack-tokens-before": str(self.tokens_before),
            "x-flashstack-tokens-after": str(self.tokens_after),
            "x-flashstack-messages-summarized": str(self.messages_summarized),
            "x-flashstack-messages-dropped": str(self.messages_dropped),
        }
        if self.fallback is not None:
            out["x-flashstack-compression-fallback"] = self.fallback
        if self.summarizers:
            out["x-flashstack-summarizer"] = ", ".join(f"{k}={n}" for k, n in self.summarizers.items())
        if self.summarizer_fallback is not None:
            out["x-flashstack-summarizer-fallback"] = self.summarizer_fallback
        return out


class CompressionMetrics:
    """Prometheus counters of compression, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("flashstack_compression_requests", "Requests compression acted on, by action",
                                ["model", "action"], registry=r)
        self.tokens_saved = Counter("flashstack_compression_tokens_saved", "Prompt tokens removed",
                                    ["model"], registry=r)
        self.summarized = Counter("flashstack_compression_messages_summarized", "Messages replaced by summaries",
                                  ["model"], registry=r)
        self.dropped = Counter("flashstack_compression_messages_dropped", "Messages dropped entirely",
                               ["model"], registry=r)
        self.refused = Counter("flashstack_compression_refused", "Requests refused as context_length_exceeded",
                               ["model"], registry=r)
        self.fallbacks = Counter("flashstack_compression_fallbacks", "Requests truncated instead of compressed",
                                 ["model", "reason"], registry=r)
        self.summarizer_fallbacks = Counter(
            "flashstack_compression_summarizer_fallbacks",
            "Compressed requests whose model summaries were (partly) extractive instead", ["model", "reason"],
            registry=r)

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


# ---- units: messages that must stay together -------------------------------------------------


@dataclass(slots=True)
class Unit:
    """Messages [start, end) kept, summarized or dropped as one (a tool call and its results)."""

    start: int
    end: int
    text: str
    tokens: int
    vector: np.ndarray | None = None
    relevance: float = 0.0
    message_texts: tuple[str, ...] = ()  # embedded per message, so stored message embeddings apply


def unit_spans(messages: Sequence[Message]) -> list[tuple[int, int]]:
    """Contiguous spans such that no tool call is ever separated from its results."""
    called_at: dict[str, int] = {}
    reach = list(range(len(messages)))  # reach[i]: the last message that must stay with message i
    for j, msg in enumerate(messages):
        for p in msg.parts:
            if isinstance(p, ToolCall):
                called_at[p.id] = j
            elif isinstance(p, ToolResult) and p.tool_call_id in called_at:
                i = called_at[p.tool_call_id]
                reach[i] = max(reach[i], j)
    spans, start, end = [], 0, -1
    for i in range(len(messages)):
        end = max(end, reach[i])
        if i == end:
            spans.append((start, i + 1))
            start = i + 1
    return spans


def query_index(messages: Sequence[Message]) -> int:
    """The latest user turn with text of its own (not only tool results); else the last message."""
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m.role == "user" and any(isinstance(p, Text) and p.text.strip() for p in m.parts):
            return i
    return len(messages) - 1


# ---- the plan (blocking; runs on the embedder's thread) --------------------------------------


@dataclass(slots=True)
class Cluster:
    units: list[Unit]
    relevance: float
    summary: str = ""
    tokens: int = 0
    source: str = "extractive"  # the summarizer that wrote `summary`
    cached: bool = False  # `summary` came from the session's stored summaries

    @property
    def n_messages(self) -> int:
        return sum(u.end - u.start for u in self.units)

    def key(self, summarizer: str) -> str:
        h = hashlib.sha256(summarizer.encode())
        for u in self.units:
            h.update(hashlib.sha256(u.text.encode()).digest())
        return h.hexdigest()


@dataclass(slots=True)
class Plan:
    """Which units stay verbatim and which clusters become summaries, within `target` tokens."""

    target: int
    tokens_before: int
    fixed_tokens: int  # system prompt, tools, per-request overhead
    kept: list[Unit]  # verbatim, in order
    clusters: list[Cluster]  # summarized, most relevant first
    dropped: list[Unit] = field(default_factory=list)
    truncated: bool = False
    header_tokens: int = 0  # the summaries' heading in the system prompt

    def tokens_after(self) -> int:
        summaries = sum(c.tokens for c in self.clusters) + (self.header_tokens if self.clusters else 0)
        return self.fixed_tokens + sum(u.tokens for u in self.kept) + summaries


def summary_budget_per_cluster(free: int, n: int) -> int:
    return max(MIN_SUMMARY_TOKENS, free // max(1, n))


def split_sentences(text: str) -> list[str]:
    return [s.strip() for s in _SENTENCE_END.split(text) if s and s.strip()]


def chunks(text: str) -> list[str]:
    """Pieces MiniLM can read whole (it truncates at 256 word pieces)."""
    words = text.split()
    if len(words) <= CHUNK_WORDS:
        return [text or " "]
    return [" ".join(words[i:i + CHUNK_WORDS]) for i in range(0, len(words), CHUNK_WORDS)]


def dbscan_labels(vectors: np.ndarray, eps: float, min_samples: int = 2) -> np.ndarray:
    """DBSCAN over cosine distance of unit vectors; noise points become clusters of their own."""
    import numpy as np
    from sklearn.cluster import DBSCAN

    if len(vectors) == 0:
        return np.zeros(0, np.int64)
    dist = np.clip(1.0 - vectors @ vectors.T, 0.0, 2.0)
    labels = DBSCAN(eps=eps, min_samples=min_samples, metric="precomputed").fit_predict(dist)
    next_label = labels.max() + 1
    for i in np.flatnonzero(labels < 0):
        labels[i] = next_label
        next_label += 1
    return labels


class Planner:
    """The blocking part of compression: counting, embedding, ranking, clustering, extracting.

    Without an embedder (not loaded yet) it measures and truncates only.
    """

    def __init__(self, cfg: CompressionConfig, embedder: Embedder | None = None,
                 counts: OrderedDict[tuple[str, str | bytes], int] | None = None) -> None:
        self.cfg = cfg
        self.embedder = embedder
        self._counts = counts if counts is not None else OrderedDict()

    def with_embedder(self, embedder: Embedder) -> Planner:
        """A planner that compresses with `embedder`, sharing this one's token counts."""
        return Planner(self.cfg, embedder, self._counts)

    def count(self, counter: tokens.Counter, text: str) -> int:
        key = (counter.name, count_key(text))
        n = self._counts.get(key)
        if n is None:
            n = self._counts[key] = counter.tokens(text)
            if len(self._counts) > 100_000:
                self._counts.popitem(last=False)
        return n

    def units(self, counter: tokens.Counter, messages: Sequence[Message]) -> list[Unit]:
        out = []
        for start, end in unit_spans(messages):
            texts = [tokens.message_text(m) for m in messages[start:end]]
            n = sum(self.count(counter, t) + tokens.PER_MESSAGE + tokens.PER_IMAGE * tokens.image_count(m)
                    for t, m in zip(texts, messages[start:end]))
            out.append(Unit(start, end, "\n".join(texts), n, message_texts=tuple(texts)))
        return out

    def fixed_tokens(self, counter: tokens.Counter, req: ChatRequest) -> int:
        return self.count(counter, tokens.fixed_text(req)) + tokens.PER_REQUEST

    def measure(self, counter: tokens.Counter, req: ChatRequest) -> tuple[int, list[Unit], int]:
        """(fixed tokens, units, total prompt tokens) of a request."""
        fixed = self.fixed_tokens(counter, req)
        units = self.units(counter, req.messages)
        return fixed, units, fixed + sum(u.tokens for u in units)

    def plan(self, counter: tokens.Counter, req: ChatRequest, target: int, mode: CompressionMode,
             pinned: frozenset[int] = frozenset(), summaries: dict[str, str] | None = None,
             summarizer: str = "extractive", budget: Budget | None = None) -> Plan:
        """Choose what stays verbatim, what is summarized and what is dropped to fit `target`.

        `summaries`: a session's stored summaries by cluster key; one of `summarizer` is reused if it fits.
        `budget`: what compressing may cost; past it BudgetExceeded is raised (the caller truncates).
        """
        fixed, units, total = self.measure(counter, req)
        last = len(req.messages) - self.cfg.keep_last_turns
        q = query_index(req.messages)
        protected = [u.end > last or u.start <= q < u.end or any(u.start <= i < u.end for i in pinned)
                     for u in units]
        kept = [u for u, p in zip(units, protected) if p]
        free = target - fixed - sum(u.tokens for u in kept)
        if free < 0:
            raise context_length_exceeded(
                f"this conversation needs {total} prompt tokens; even after compression its system prompt, "
                f"tools, pinned and last {self.cfg.keep_last_turns} messages take {target - free} tokens, "
                f"more than the {target} this model has room for with the output reserved. Shorten them, "
                "lower max_tokens, or choose a model with a larger context window"
            )
        old = [u for u, p in zip(units, protected) if not p]
        if mode == "truncate":
            return self._truncate(target, total, fixed, kept, old, free)
        return self._compress(counter, req, target, total, fixed, kept, old, free, q, summaries, summarizer, budget)

    @staticmethod
    def _truncate(target: int, total: int, fixed: int, kept: list[Unit], old: list[Unit], free: int) -> Plan:
        keep, dropped = [], []
        for u in reversed(old):  # newest first
            if u.tokens <= free and not dropped:
                keep.append(u)
                free -= u.tokens
            else:
                dropped.append(u)
        kept = sorted(kept + keep, key=lambda u: u.start)
        return Plan(target, total, fixed, kept, [], sorted(dropped, key=lambda u: u.start), truncated=True)

    def _compress(self, counter: tokens.Counter, req: ChatRequest, target: int, total: int, fixed: int,
                  kept: list[Unit], old: list[Unit], free: int, q: int, summaries: dict[str, str] | None,
                  summarizer: str, budget: Budget | None) -> Plan:
        from flashstack.gateway.embed import BudgetExceeded

        if self.embedder is None:
            raise RuntimeError("Planner without an embedder can only truncate")
        if len(old) > self.cfg.max_units:  # DBSCAN's distance matrix alone grows with the square
            raise BudgetExceeded("units")
        query = tokens.message_text(req.messages[q])
        qvec = self.embedder.embed([query], budget)[0]
        self._rank(old, qvec, budget)
        verbatim, rest, used = [], [], 0
        for u in sorted(old, key=lambda u: (-u.relevance, -u.start)):
            if used + u.tokens <= free * VERBATIM_SHARE:
                verbatim.append(u)
                used += u.tokens
            else:
                rest.append(u)
        header = self.count(counter, SUMMARY_HEADER) + tokens.PER_MESSAGE
        clusters = self._clusters(rest)
        clusters, dropped = self._extract(counter, clusters, qvec, free - used - header, summaries, summarizer,
                                          budget)
        return Plan(target, total, fixed, sorted(kept + verbatim, key=lambda u: u.start), clusters,
                    sorted(dropped, key=lambda u: u.start), header_tokens=header)

    def _rank(self, units: list[Unit], qvec: np.ndarray, budget: Budget | None = None) -> None:
        import numpy as np

        assert self.embedder is not None
        pieces = [[c for t in (u.message_texts or (u.text,)) for c in chunks(t)] for u in units]
        flat = [c for cs in pieces for c in cs]
        if not flat:
            return
        vecs = self.embedder.embed(flat, budget)
        starts = np.cumsum([0] + [len(cs) for cs in pieces[:-1]])
        relevance = np.maximum.reduceat(vecs @ qvec, starts)  # a unit is as relevant as its best chunk
        means = np.add.reduceat(vecs, starts, axis=0)
        means /= np.maximum(np.linalg.norm(means, axis=1, keepdims=True), 1e-9)
        for u, r, v in zip(units, relevance.tolist(), means):
            u.relevance, u.vector = r, v

    def _clusters(self, units: list[Unit]) -> list[Cluster]:
        import numpy as np

        if not units:
            return []
        labels = dbscan_labels(np.stack([u.vector for u in units]), self.cfg.dbscan_eps)
        groups: dict[int, list[Unit]] = {}
        for u, label in zip(units, labels):
            groups.setdefault(int(label), []).append(u)
        clusters = [Cluster(sorted(g, key=lambda u: u.start), max(u.relevance for u in g)) for g in groups.values()]
        return sorted(clusters, key=lambda c: (-c.relevance, c.units[0].start))

    def _extract(self, counter: tokens.Counter, clusters: list[Cluster], qvec: np.ndarray, free: int,
                 summaries: dict[str, str] | None = None, summarizer: str = "extractive",
                 budget: Budget | None = None) -> tuple[list[Cluster], list[Unit]]:
        """Summaries (stored, else extractive), most relevant cluster first, while they fit in `free` tokens."""
        out, dropped = [], []
        for n, c in enumerate(clusters):
            cap = min(free, max(MIN_SUMMARY_TOKENS, free // (len(clusters) - n)))
            if cap < MIN_SUMMARY_TOKENS:
                dropped.extend(c.units)
                continue
            stored = summaries.get(c.key(summarizer)) if summaries else None
            if stored and (n_stored := self.count(counter, "- " + stored) + 1) <= cap:
                c.summary, c.tokens, c.source, c.cached = stored, n_stored, summarizer, True
                free -= c.tokens
                out.append(c)
                continue
            c.summary = self.extractive_summary(counter, c, qvec, cap, budget)
            c.tokens = self.count(counter, "- " + c.summary) + 1 if c.summary else 0
            if not c.summary or c.tokens > free:
                dropped.extend(c.units)
                continue
            free -= c.tokens
            out.append(c)
        return out, dropped

    def extractive_summary(self, counter: tokens.Counter, c: Cluster, qvec: np.ndarray, cap: int,
                           budget: Budget | None = None) -> str:
        """The cluster's most central sentences (and those nearest the question), in their order, ≤ cap tokens."""
        import numpy as np

        assert self.embedder is not None
        centroid = np.stack([u.vector for u in c.units]).mean(0)
        centroid /= max(float(np.linalg.norm(centroid)), 1e-9)
        # Sentences come from the most central and the most relevant units only: embedding every
        # sentence of a large cluster would double the cold cost for sentences that never win.
        central = sorted(c.units, key=lambda u: (-float(u.vector @ centroid), u.start))[:SOURCE_UNITS]
        relevant = sorted(c.units, key=lambda u: (-u.relevance, u.start))[:SOURCE_UNITS]
        sources = sorted({u.start: u for u in central + relevant}.values(), key=lambda u: u.start)
        sentences = list(dict.fromkeys(s for u in sources for s in split_sentences(u.text)))[:MAX_SENTENCES]
        if not sentences:
            return ""
        vecs = self.embedder.embed(sentences, budget)
        # Centrality says what the cluster was about; nearness to the question keeps what the next
        # answer needs if the cluster holds it.
        score = vecs @ centroid + vecs @ qvec
        best = sorted(np.argsort(-score, kind="stable")[: self.cfg.summary_sentences].tolist())
        while best:
            text = " ".join(sentences[i] for i in best)
            if self.count(counter, text) + 3 <= cap:
                return text
            best.remove(min(best, key=lambda i: score[i]))  # drop the weakest sentence and retry
        return _clip(counter, sentences[int(np.argmax(score))], cap - 3)


def count_key(text: str) -> str | bytes:
    """A token-count cache key: short texts themselves (a str caches its own hash), long ones a digest,
    so 100,000 cached counts never hold 100,000 request bodies."""
    return text if len(text) <= 512 else hashlib.blake2b(text.encode(), digest_size=16).digest()


def _clip(counter: tokens.Counter, text: str, cap: int) -> str:
    words = text.split()
    while words and counter.tokens(" ".join(words) + " …") > cap:
        words = words[: max(0, min(len(words) - 1, int(len(words) * 0.8)))]
    return " ".join(words) + " …" if words else ""


# ---- the compressor --------------------------------------------------------------------------


class Compressor:
    """Checks every chat request against its model's window and compresses it when it must.

    The embedding model never loads on a request's path: `start_loading` loads it in a thread of
    its own (at start-up with `preload`, else when a request first needs it), and until it is
    loaded a request over the window is truncated, said in x-flashstack-compression-fallback.
    A local summarizer loads the same way; until then summaries are extractive, said in
    x-flashstack-summarizer-fallback.
    """

    def __init__(self, cfg: CompressionConfig, state_dir: Path, router: Router | None = None,
                 embedder: Embedder | None = None) -> None:
        self.cfg = cfg
        self.cache_dir = cfg.cache_dir or Path(state_dir) / "models"
        self.router = router
        self.metrics = CompressionMetrics()
        self._planner = Planner(cfg, embedder)
        self._loader: threading.Thread | None = None
        self._loader_lock = threading.Lock()
        self._loaded = threading.Event()  # set once the load finished, loaded or not
        # One thread for measuring, planning and embedding: two at once on a 2-core box only contend.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flashstack-compress")
        self._summaries: OrderedDict[str, str] = OrderedDict()  # model summaries per cluster key
        self.local = LocalSummarizer(cfg, router) if cfg.summarizer == "local" else None

    # ---- the embedding model -----------------------------------------------------------------

    @property
    def state(self) -> LoadState:
        """The embedding model's: idle (never asked for), loading, ready or failed (see the log)."""
        if self._planner.embedder is not None:
            return "ready"
        if self._loader is None:
            return "idle"
        return "failed" if self._loaded.is_set() else "loading"

    @property
    def summarizer_state(self) -> LoadState | None:
        """The local summarizer's load state; None when the summarizer is not `local`."""
        return None if self.local is None else self.local.state

    def start_loading(self) -> None:
        """Load the embedding model in a background thread, and a local summarizer (in an event loop
        only: else the first request that needs it starts it), once; nothing waits for them."""
        with self._loader_lock:
            if self._loader is None and self._planner.embedder is None:
                self._loader = threading.Thread(target=self._load, name="flashstack-embed-load", daemon=True)
                self._loader.start()
        if self.local is not None:
            self.local.start_loading()

    def _load(self) -> None:
        try:
            self._planner = self._planner.with_embedder(self._load_embedder())
        except Exception:  # a missing package or a failed build: truncation still serves every request
            log.exception("the embedding model could not be loaded; requests over their model's window are "
                          "truncated instead of compressed")
        finally:
            self._loaded.set()

    def _load_embedder(self) -> Embedder:
        from flashstack.gateway.embed import Embedder

        return Embedder(self.cache_dir, threads=self.cfg.embed_threads, cache_size=self.cfg.embed_cache_size)

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """Block until the models are loaded (True) or one failed to load / timed out (False); for tools and
        tests, off the event loop. A local summarizer is waited for once its load has started."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._wait_embedder(timeout):
            return False
        if self.local is None or self.local.state == "idle":
            return True
        return self.local.wait_loaded(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def _wait_embedder(self, timeout: float | None = None) -> bool:
        if self._planner.embedder is None:
            self.start_loading()
            self._loaded.wait(timeout)
        return self._planner.embedder is not None

    async def planner(self) -> Planner:
        """The planner with its models loaded, waiting for them (offline tools; requests never wait)."""
        if not await asyncio.to_thread(self._wait_embedder):
            raise RuntimeError("the embedding model could not be loaded; see the log of flashstack.gateway.compress")
        if self.local is not None and not await self.local.loaded():
            raise RuntimeError("the local summarizer could not be loaded; see the log of flashstack.gateway.summarize")
        return self._planner

    async def embed_texts(self, texts: list[str]) -> tuple[Any, list[int]]:
        """Unit vectors and word-piece counts for `texts` (POST /v1/embeddings, model minilm), on the
        compression thread, once the model is loaded. A text over the model's 256 word pieces is
        refused (a 400 naming it), never embedded cut short."""
        from flashstack.gateway.embed import MAX_TOKENS

        if not await asyncio.to_thread(self._wait_embedder):
            raise GatewayError(ErrorKind.OVERLOADED, "the embedding model could not be loaded; see the gateway log")
        embedder = self._planner.embedder
        assert embedder is not None
        counts = await self._run(embedder.token_counts, texts)
        for i, n in enumerate(counts):
            if n > MAX_TOKENS:
                raise invalid_request(f"input[{i}] is {n} word pieces; minilm reads at most {MAX_TOKENS}: "
                                      "split the text", "input")
        return await self._run(embedder.embed, texts), counts

    # ---- one request -------------------------------------------------------------------------

    def mode_for(self, req: ChatRequest, cfg: ModelConfig, options: Options,
                 memory: SessionMemory | None = None) -> CompressionMode:
        """The request's mode, else its session's, else its model's, else the default."""
        return (options.mode or (memory.mode if memory else None) or self.cfg.model_modes.get(cfg.name)
                or self.cfg.mode)

    async def maybe_compress(self, req: ChatRequest, cfg: ModelConfig,
                             memory: SessionMemory | None = None) -> tuple[ChatRequest, Outcome]:
        """`req` itself when it fits (or compression is off), else a compressed copy; never a silent cut."""
        options = request_options(req)
        mode = self.mode_for(req, cfg, options, memory)
        window = tokens.context_window(cfg)
        if mode == "off" or window is None or not req.messages:
            return req, Outcome("none", 0, 0)
        reserve = tokens.output_reserve(req, cfg, window)
        limit = math.floor(self.cfg.threshold * window)
        if reserve >= limit:  # refused on its fields alone: before any tokenizer, thread or model
            raise context_length_exceeded(
                f"max_tokens ({reserve}) leaves no room for the prompt in this model's {window}-token "
                f"window (compression threshold {self.cfg.threshold}); lower max_tokens"
            )
        if tokens.request_upper_bound(cfg, req) + reserve <= limit:
            return req, Outcome("none", 0, 0)  # cannot be over: no tokenizer, no thread hop
        budget = self._budget()  # from arrival: time spent waiting for the compression thread counts
        counter = await self._run(tokens.counter_for, cfg)  # a tokenizer's first load takes a while
        fixed, units, total = await self._run(self._planner.measure, counter, req)
        if total + reserve <= limit:
            return req, Outcome("none", total, total)
        try:
            new, outcome = await self.compress(req, cfg, limit - reserve, mode, options.pinned, memory, budget)
        except GatewayError as e:
            if e.code == "context_length_exceeded":
                self.metrics.refused.labels(cfg.name).inc()
            raise
        self.metrics.record(cfg.name, outcome)
        return new, outcome

    async def compress(self, req: ChatRequest, cfg: ModelConfig, target: int, mode: CompressionMode = "auto",
                       pinned: frozenset[int] = frozenset(), memory: SessionMemory | None = None,
                       budget: Budget | None = None) -> tuple[ChatRequest, Outcome]:
        """A copy of `req` whose prompt fits `target` tokens (the trigger already fired).

        Truncated instead when the embedding model is not loaded, or compressing would overspend `budget`.
        """
        from flashstack.gateway.embed import BudgetExceeded

        planner = self._planner
        counter = await self._run(tokens.counter_for, cfg)
        fallback: Fallback | None = None
        if mode == "auto" and planner.embedder is None:
            self.start_loading()
            fallback = "unavailable" if self.state == "failed" else "warming-up"
        elif mode == "auto":
            try:
                return await self._compress(planner, counter, req, cfg, target, pinned, memory,
                                            budget or self._budget())
            except BudgetExceeded as e:
                log.info("compression of a %s request over its budget (%s); truncating it", cfg.name, e)
                fallback = "budget"
        plan = await self._run(planner.plan, counter, req, target, "truncate", pinned)
        outcome = outcome_of(plan)
        outcome.fallback = fallback
        return apply(req, plan), outcome

    async def _compress(self, planner: Planner, counter: tokens.Counter, req: ChatRequest, cfg: ModelConfig,
                        target: int, pinned: frozenset[int], memory: SessionMemory | None,
                        budget: Budget) -> tuple[ChatRequest, Outcome]:
        from flashstack.gateway.embed import BudgetExceeded

        assert planner.embedder is not None
        summarizer = self._summarizer_name(req)
        stored_vectors: dict[str, bytes] = {}
        if memory is None:
            plan = await self._run(planner.plan, counter, req, target, "auto", pinned, None, summarizer, budget)
        else:
            stored_vectors, stored_summaries = await memory.load()
            await self._run(seed_vectors, planner.embedder, req.messages, memory.turn.history_ids, stored_vectors)
            plan = await self._run(planner.plan, counter, req, target, "auto", pinned, stored_summaries,
                                   summarizer, budget)
        summarizer_fallback: SummarizerFallback | None = None
        if self.cfg.summarizer == "llm" and plan.clusters and self.router is not None:
            await self._llm_summaries(plan, req, cfg, counter)
        elif self.local is not None and plan.clusters:
            summarizer_fallback = await self._local_summaries(self.local, plan, counter, budget)
        if memory is not None:
            await memory.save_summaries({c.key(c.source): c.summary for c in plan.clusters
                                         if not c.cached and c.source == summarizer})
            try:
                memory.turn.vectors.update(await self._run(
                    new_vectors, planner.embedder, req.messages, memory.turn.history_ids,
                    len(memory.turn.history), len(memory.turn.history) + len(memory.turn.inputs),
                    stored_vectors, budget))
            except BudgetExceeded:
                pass  # the plan stands; the inputs' embeddings are computed (and stored) by a later turn
        outcome = outcome_of(plan)
        outcome.summarizer_fallback = summarizer_fallback
        return apply(req, plan), outcome

    def _budget(self) -> Budget:
        from flashstack.gateway.embed import Budget

        return Budget.of(self.cfg.max_embed_tokens, self.cfg.max_plan_seconds)

    def _summarizer_name(self, req: ChatRequest) -> str:
        """What wrote a summary, part of its cache key: `extractive` or `llm:<model>`."""
        if self.cfg.summarizer == "llm" and self.router is not None:
            return "llm:" + (self.cfg.summarizer_model or req.model)
        if self.local is not None:
            return self.local.name
        return "extractive"

    async def _run(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` on the compression thread: the event loop never waits on a tokenizer or the model."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _llm_summaries(self, plan: Plan, req: ChatRequest, cfg: ModelConfig, counter: tokens.Counter) -> None:
        model = self.cfg.summarizer_model or req.model
        fresh = [c for c in plan.clusters if not c.cached]  # a stored summary is not asked for again
        results = await asyncio.gather(*(self._llm_summary(c, model, counter) for c in fresh))
        for c, text in zip(fresh, results):
            if text is not None:  # else the extractive summary stays
                _replace_summary(plan, c, text, "llm:" + model, counter)

    async def _local_summaries(self, local: LocalSummarizer, plan: Plan, counter: tokens.Counter,
                               budget: Budget) -> SummarizerFallback | None:
        """Model-written summaries for the clusters, all at once (the engine batches them), until
        `budget`'s deadline; the extractive ones stay where they do not come in time, or do not fit."""
        fresh = [c for c in plan.clusters if not c.cached]
        for c in [c for c in fresh if c.key(local.name) in self._summaries]:
            _replace_summary(plan, c, self._remember(c.key(local.name)), local.name, counter)
            fresh.remove(c)
        if not fresh:
            return None
        if local.state != "ready":
            local.start_loading()
            return "unavailable" if local.state == "failed" else "warming-up"
        tasks = {asyncio.ensure_future(local.summarize(self._cluster_text(c, self.cfg.summary_input_tokens, counter),
                                                       self._summary_room(plan, c))): c for c in fresh}
        try:
            done, pending = await asyncio.wait(tasks, timeout=max(0.0, budget.deadline - time.monotonic()))
        finally:  # past the deadline, or the request itself cancelled (client gone)
            for t in tasks:
                t.cancel()  # the engine aborts a generation still running and frees its KV blocks
        fallback: SummarizerFallback | None = "budget" if pending else None
        for t, c in tasks.items():  # most relevant cluster first: it has first claim on the room
            if t not in done:
                continue
            if t.exception() is not None:
                log.warning("local summarizer %s failed (%s); using the extractive summary", local.name, t.exception())
                fallback = fallback or "error"
            elif text := t.result():
                self._remember(c.key(local.name), text)
                _replace_summary(plan, c, text, local.name, counter)
        if pending:
            log.info("%d of %d local summaries not done within the compression budget; extractive ones kept",
                     len(pending), len(tasks))
        return fallback

    def _summary_room(self, plan: Plan, c: Cluster) -> int:
        """Tokens a model summary of `c` may generate: its configured bound, within the plan's free room."""
        return max(8, min(self.cfg.summary_max_tokens, plan.target - plan.tokens_after() + c.tokens))

    def _remember(self, key: str, text: str | None = None) -> str:
        """A model summary by cluster key: stored (with `text`) or looked up, in an LRU of 10,000."""
        if text is None:
            self._summaries.move_to_end(key)
            return self._summaries[key]
        self._summaries[key] = text
        if len(self._summaries) > 10_000:
            self._summaries.popitem(last=False)
        return text

    async def _llm_summary(self, c: Cluster, model: str, counter: tokens.Counter) -> str | None:
        key = c.key("llm:" + model)
        if key in self._summaries:
            return self._remember(key)
        assert self.router is not None
        text = self._summarizer_input(c, model, counter)
        request = ChatRequest(model=model, messages=[Message("user", [Text(SUMMARIZE_PROMPT.format(
            n=self.cfg.summary_sentences, text=text))])], max_tokens=max(32, c.tokens), temperature=0.0)
        try:
            summary = (await self.router.complete(request)).text().strip()
        except GatewayError as e:
            log.warning("LLM summarizer %s failed (%s); using the extractive summary", model, e.message)
            return None
        return self._remember(key, summary) if summary else None

    def _summarizer_input(self, c: Cluster, model: str, counter: tokens.Counter) -> str:
        """The cluster's text, cut to leave room for the summarizer's own prompt and answer."""
        assert self.router is not None
        window = tokens.context_window(self.router.config_of(model)) or 8_192
        return self._cluster_text(c, int(window * self.cfg.threshold) - 256 - max(32, c.tokens), counter)

    @staticmethod
    def _cluster_text(c: Cluster, room: int, counter: tokens.Counter) -> str:
        """The cluster's units in order, the most relevant ones if not all fit in `room` tokens (the most
        relevant one clipped if none does)."""
        parts, used = [], 0
        for u in sorted(c.units, key=lambda u: -u.relevance):
            if used + u.tokens > room:
                continue
            parts.append((u.start, u.text))
            used += u.tokens
        if not parts:
            best = max(c.units, key=lambda u: u.relevance)
            return _clip(counter, best.text, max(1, room))
        return "\n\n".join(t for _, t in sorted(parts))

    def render_metrics(self) -> bytes:
        return self.metrics.render()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._planner.embedder is not None:
            self._planner.embedder.close()

    async def aclose(self) -> None:
        """`close`, and the local summarizer's engine unless a served model shares it (the router closes that)."""
        if self.local is not None and not self.local.shared:
            await self.local.provider.aclose()
        self.close()


def _replace_summary(plan: Plan, c: Cluster, text: str, source: str, counter: tokens.Counter) -> None:
    """`text` (by `source`) as `c`'s summary if the plan still fits its target with it; else the current one stays."""
    n = counter.tokens("- " + text) + 1
    if plan.tokens_after() - c.tokens + n > plan.target:
        log.info("%s summary of %d tokens does not fit the window; keeping the extractive one", source, n)
        return
    c.summary, c.tokens, c.source = text, n, source


def apply(req: ChatRequest, plan: Plan) -> ChatRequest:
    """The compressed request: kept messages in order, summaries appended to the system prompt."""
    messages = [m for u in plan.kept for m in req.messages[u.start:u.end]]
    system = list(req.system)
    if plan.clusters:
        lines = [SUMMARY_HEADER] + [f"- {c.summary}" for c in sorted(plan.clusters, key=lambda c: c.units[0].start)]
        system.append(Text("\n".join(lines)))
    return dataclasses.replace(req, messages=messages, system=system)


def outcome_of(plan: Plan) -> Outcome:
    summarized = sum(c.n_messages for c in plan.clusters)
    dropped = sum(u.end - u.start for u in plan.dropped)
    action: Literal["compressed", "truncated"] = "truncated" if plan.truncated else "compressed"
    sources: dict[str, int] = {}
    for c in plan.clusters:
        sources[c.source] = sources.get(c.source, 0) + 1
    return Outcome(action, plan.tokens_before, plan.tokens_after(), summarized, dropped, summarizers=sources)


async def for_request(request: Any, req: ChatRequest, cfg: ModelConfig,
                      turn: Any = None) -> tuple[ChatRequest, Outcome]:
    """chat.py's hook: the app's compressor (app.state.compressor) applied to `req`, if there is one.

    `turn` (a sessions.turns.Turn) lends the session's mode, stored embeddings and summaries.
    """
    compressor: Compressor | None = getattr(request.app.state, "compressor", None)
    if compressor is None:
        return req, Outcome("none", 0, 0)
    memory = SessionMemory.of(turn) if turn is not None and turn.in_session else None
    return await compressor.maybe_compress(req, cfg, memory)


# ---- session memory: embeddings stored with messages, summaries per session -------------------


@dataclass(slots=True)
class SessionMemory:
    """What a session lends compression: its mode, and its stored message embeddings and summaries."""

    turn: Any  # sessions.turns.Turn: history (with ids) + inputs are req.messages' first messages
    mode: CompressionMode | None

    @classmethod
    def of(cls, turn: Any) -> SessionMemory:
        return cls(turn, session_mode(turn.metadata()))

    async def load(self) -> tuple[dict[str, bytes], dict[str, str]]:
        return await self.turn.sessions.store.compression_memory(self.turn.session_id)

    async def save_summaries(self, new: dict[str, str]) -> None:
        try:
            await self.turn.sessions.store.save_summaries(self.turn.session_id, new)
        except Exception:  # a summary not kept is computed again next turn; the turn goes on
            log.exception("could not store summaries of session %s", self.turn.session_id)


def message_texts(m: Message) -> list[str]:
    """Every text the planner may embed for one message: its chunks, then its sentences."""
    text = tokens.message_text(m)
    return list(dict.fromkeys(chunks(text) + split_sentences(text)))


def pack_vectors(vectors: Sequence[np.ndarray | None]) -> bytes:
    """float16 rows, one per `message_texts` entry; NaN rows for texts never embedded."""
    import numpy as np

    from flashstack.gateway.embed import DIM

    out = np.full((len(vectors), DIM), np.nan, np.float16)
    for i, v in enumerate(vectors):
        if v is not None:
            out[i] = v
    return out.tobytes()


def unpack_vectors(blob: bytes) -> np.ndarray:
    import numpy as np

    from flashstack.gateway.embed import DIM

    return np.frombuffer(blob, np.float16).reshape(-1, DIM).astype(np.float32)


def seed_vectors(embedder: Embedder, messages: Sequence[Message], ids: Sequence[str],
                 stored: dict[str, bytes]) -> int:
    """Put the stored embeddings of the history's messages into the embedder's cache; returns how many."""
    import numpy as np

    pairs = []
    for m, mid in zip(messages, ids):
        blob = stored.get(mid)
        if blob is None:
            continue
        texts, rows = message_texts(m), unpack_vectors(blob)
        if len(rows) != len(texts):  # stored by a build that split texts differently: recompute
            continue
        pairs += [(t, r) for t, r in zip(texts, rows) if not np.isnan(r[0])]
    embedder.seed(pairs)
    return len(pairs)


def new_vectors(embedder: Embedder, messages: Sequence[Message], ids: Sequence[str], n_history: int,
                n_session: int, stored: dict[str, bytes], budget: Budget | None = None) -> dict[int, bytes]:
    """Embeddings to store, by message position: the new inputs' (embedded now if the plan did not),
    and any history message whose known embeddings grew since they were stored."""
    import numpy as np

    new_chunks = [c for m in messages[n_history:n_session] for c in chunks(tokens.message_text(m))]
    if new_chunks:
        embedder.embed(new_chunks, budget)  # the next turn reads them from the store instead
    out = {}
    for i, m in enumerate(messages[:n_session]):
        known = embedder.known(message_texts(m))
        n_known = sum(v is not None for v in known)
        blob = stored.get(ids[i]) if i < len(ids) else None
        n_stored = 0 if blob is None else int((~np.isnan(unpack_vectors(blob)[:, 0])).sum())
        if n_known > n_stored:
            out[i] = pack_vectors(known)
    return out

"""The blocking part of compression: counting, embedding, ranking, clustering, extracting.

It runs on the compressor's thread. The most relevant old units stay verbatim, the rest are
clustered and each cluster gets an extractive summary (its most central sentences); a conversation
whose kept part alone does not fit is a 400 `context_length_exceeded`.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from flashstack.gateway import tokens
from flashstack.gateway.compress.budget import Budget, BudgetExceeded
from flashstack.gateway.compress.clustering import Cluster, clusters_of
from flashstack.gateway.compress.outcome import context_length_exceeded
from flashstack.gateway.compress.plan import SUMMARY_HEADER, Plan
from flashstack.gateway.compress.units import Unit, chunks, query_index, split_sentences, unit_spans
from flashstack.gateway.config import CompressionConfig, CompressionMode
from flashstack.gateway.core import ChatRequest, Message

if TYPE_CHECKING:
    import numpy as np  # imported where used: 16 MB a gateway that never compresses need not hold

    from flashstack.gateway.compress.embed import Embedder

VERBATIM_SHARE = 0.6  # of the free budget, for the most relevant old units; the rest for summaries
MIN_SUMMARY_TOKENS = 24  # a cluster summary shorter than this says nothing: the cluster is dropped
MAX_SENTENCES = 200  # per cluster, for extractive summaries
SOURCE_UNITS = 3  # extractive summaries draw on this many most central + most relevant units
MAX_COUNTS = 100_000  # cached token counts


class Planner:
    """Chooses what stays verbatim, what is summarized and what is dropped.

    Without an embedder (not loaded yet) it measures and truncates only.
    """

    def __init__(
        self,
        cfg: CompressionConfig,
        embedder: Embedder | None = None,
        counts: OrderedDict[tuple[str, str | bytes], int] | None = None,
    ) -> None:
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
            if len(self._counts) > MAX_COUNTS:
                self._counts.popitem(last=False)
        return n

    def units(self, counter: tokens.Counter, messages: Sequence[Message]) -> list[Unit]:
        out = []
        for start, end in unit_spans(messages):
            texts = [tokens.message_text(m) for m in messages[start:end]]
            n = sum(
                self.count(counter, t)
                + tokens.PER_MESSAGE
                + tokens.PER_IMAGE * tokens.image_count(m)
                for t, m in zip(texts, messages[start:end])
            )
            out.append(Unit(start, end, "\n".join(texts), n, message_texts=tuple(texts)))
        return out

    def fixed_tokens(self, counter: tokens.Counter, req: ChatRequest) -> int:
        return self.count(counter, tokens.fixed_text(req)) + tokens.PER_REQUEST

    def measure(self, counter: tokens.Counter, req: ChatRequest) -> tuple[int, list[Unit], int]:
        """(fixed tokens, units, total prompt tokens) of a request."""
        fixed = self.fixed_tokens(counter, req)
        units = self.units(counter, req.messages)
        return fixed, units, fixed + sum(u.tokens for u in units)

    def plan(
        self,
        counter: tokens.Counter,
        req: ChatRequest,
        target: int,
        mode: CompressionMode,
        pinned: frozenset[int] = frozenset(),
        summaries: dict[str, str] | None = None,
        summarizer: str = "extractive",
        budget: Budget | None = None,
    ) -> Plan:
        """Choose what stays verbatim, what is summarized and what is dropped to fit `target`.

        `summaries`: a session's stored summaries by cluster key; one of `summarizer` is reused if
        it fits. `budget`: what compressing may cost; past it BudgetExceeded is raised (the caller
        truncates).
        """
        fixed, units, total = self.measure(counter, req)
        last = len(req.messages) - self.cfg.keep_last_turns
        q = query_index(req.messages)
        protected = [
            u.end > last or u.start <= q < u.end or any(u.start <= i < u.end for i in pinned)
            for u in units
        ]
        kept = [u for u, p in zip(units, protected) if p]
        free = target - fixed - sum(u.tokens for u in kept)
        if free < 0:
            raise context_length_exceeded(
                f"this conversation needs {total} prompt tokens; even after compression its system "
                f"prompt, tools, pinned and last {self.cfg.keep_last_turns} messages take "
                f"{target - free} tokens, more than the {target} this model has room for with the "
                "output reserved. Shorten them, lower max_tokens, or choose a model with a larger "
                "context window"
            )
        old = [u for u, p in zip(units, protected) if not p]
        if mode == "truncate":
            return truncate(target, total, fixed, kept, old, free)
        return self._compress(
            counter, req, target, total, fixed, kept, old, free, q, summaries, summarizer, budget
        )

    def _compress(
        self,
        counter: tokens.Counter,
        req: ChatRequest,
        target: int,
        total: int,
        fixed: int,
        kept: list[Unit],
        old: list[Unit],
        free: int,
        q: int,
        summaries: dict[str, str] | None,
        summarizer: str,
        budget: Budget | None,
    ) -> Plan:
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
        clusters, dropped = self._extract(
            counter,
            clusters_of(rest, self.cfg.dbscan_eps),
            qvec,
            free - used - header,
            summaries,
            summarizer,
            budget,
        )
        return Plan(
            target,
            total,
            fixed,
            sorted(kept + verbatim, key=lambda u: u.start),
            clusters,
            sorted(dropped, key=lambda u: u.start),
            header_tokens=header,
        )

    def _rank(self, units: list[Unit], qvec: np.ndarray, budget: Budget | None = None) -> None:
        """Each unit's relevance to the question (its best chunk's) and its mean vector."""
        import numpy as np

        assert self.embedder is not None
        pieces = [[c for t in (u.message_texts or (u.text,)) for c in chunks(t)] for u in units]
        flat = [c for cs in pieces for c in cs]
        if not flat:
            return
        vecs = self.embedder.embed(flat, budget)
        starts = np.cumsum([0] + [len(cs) for cs in pieces[:-1]])
        relevance = np.maximum.reduceat(vecs @ qvec, starts)
        means = np.add.reduceat(vecs, starts, axis=0)
        means /= np.maximum(np.linalg.norm(means, axis=1, keepdims=True), 1e-9)
        for u, r, v in zip(units, relevance.tolist(), means):
            u.relevance, u.vector = r, v

    def _extract(
        self,
        counter: tokens.Counter,
        clusters: list[Cluster],
        qvec: np.ndarray,
        free: int,
        summaries: dict[str, str] | None = None,
        summarizer: str = "extractive",
        budget: Budget | None = None,
    ) -> tuple[list[Cluster], list[Unit]]:
        """Summaries (stored, else extractive), most relevant cluster first, while they fit in
        `free` tokens."""
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

    def extractive_summary(
        self,
        counter: tokens.Counter,
        c: Cluster,
        qvec: np.ndarray,
        cap: int,
        budget: Budget | None = None,
    ) -> str:
        """The cluster's most central sentences (and those nearest the question), in their order,
        ≤ cap tokens."""
        import numpy as np

        assert self.embedder is not None
        centroid = np.stack([u.vector for u in c.units]).mean(0)
        centroid /= max(float(np.linalg.norm(centroid)), 1e-9)
        # Sentences come from the most central and the most relevant units only: embedding every
        # sentence of a large cluster would double the cold cost for sentences that never win.
        central = sorted(c.units, key=lambda u: (-float(u.vector @ centroid), u.start))
        central = central[:SOURCE_UNITS]
        relevant = sorted(c.units, key=lambda u: (-u.relevance, u.start))[:SOURCE_UNITS]
        sources = sorted({u.start: u for u in central + relevant}.values(), key=lambda u: u.start)
        sentences = list(dict.fromkeys(s for u in sources for s in split_sentences(u.text)))
        sentences = sentences[:MAX_SENTENCES]
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
        return clip(counter, sentences[int(np.argmax(score))], cap - 3)


def truncate(
    target: int, total: int, fixed: int, kept: list[Unit], old: list[Unit], free: int
) -> Plan:
    """The newest old units that fit in `free` tokens stay; every older one is dropped."""
    keep, dropped = [], []
    for u in reversed(old):  # newest first
        if u.tokens <= free and not dropped:
            keep.append(u)
            free -= u.tokens
        else:
            dropped.append(u)
    kept = sorted(kept + keep, key=lambda u: u.start)
    return Plan(
        target, total, fixed, kept, [], sorted(dropped, key=lambda u: u.start), truncated=True
    )


def count_key(text: str) -> str | bytes:
    """A token-count cache key: short texts themselves (a str caches its own hash), long ones a
    digest, so 100,000 cached counts never hold 100,000 request bodies."""
    return text if len(text) <= 512 else hashlib.blake2b(text.encode(), digest_size=16).digest()


def clip(counter: tokens.Counter, text: str, cap: int) -> str:
    """`text` cut at a word to at most `cap` tokens, marked with an ellipsis."""
    words = text.split()
    while words and counter.tokens(" ".join(words) + " …") > cap:
        words = words[: max(0, min(len(words) - 1, int(len(words) * 0.8)))]
    return " ".join(words) + " …" if words else ""

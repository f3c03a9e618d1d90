"""Cluster summaries written by a model instead of the extractive ones.

`llm`: a routed model, asked through the router. `local`: a model on the in-process engine
(local_summarizer.py), all clusters at once, within the request's compression budget. A model
summary replaces the extractive one only where it comes in time and the plan still fits with it;
written summaries are cached by cluster key.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

from flashstack.gateway import tokens
from flashstack.gateway.compress.budget import Budget
from flashstack.gateway.compress.clustering import Cluster
from flashstack.gateway.compress.local_summarizer import SUMMARIZE_PROMPT, LocalSummarizer
from flashstack.gateway.compress.outcome import SummarizerFallback
from flashstack.gateway.compress.plan import Plan
from flashstack.gateway.compress.planner import clip
from flashstack.gateway.config import CompressionConfig
from flashstack.gateway.core import ChatRequest, GatewayError, Message, Text

if TYPE_CHECKING:
    from flashstack.gateway.routing import Router

log = logging.getLogger(__name__)

CACHE_SIZE = 10_000  # model summaries kept by cluster key


class ModelSummaries:
    """Writes a plan's cluster summaries with the configured model, cached by cluster key."""

    def __init__(
        self, cfg: CompressionConfig, router: Router | None, local: LocalSummarizer | None
    ) -> None:
        self.cfg = cfg
        self.router = router
        self.local = local
        self._cache: OrderedDict[str, str] = OrderedDict()

    def name(self, req: ChatRequest) -> str:
        """What writes a summary, part of its cache key: `extractive`, `llm:<model>` or
        `local:<model>`."""
        if self.cfg.summarizer == "llm" and self.router is not None:
            return "llm:" + (self.cfg.summarizer_model or req.model)
        if self.local is not None:
            return self.local.name
        return "extractive"

    async def write(
        self, plan: Plan, req: ChatRequest, counter: tokens.Counter, budget: Budget
    ) -> SummarizerFallback | None:
        """Model summaries into `plan`'s clusters; why some stayed extractive, if they did."""
        if not plan.clusters:
            return None
        if self.cfg.summarizer == "llm" and self.router is not None:
            await self._llm_summaries(plan, req, counter)
        elif self.local is not None:
            return await self._local_summaries(self.local, plan, counter, budget)
        return None

    async def _llm_summaries(self, plan: Plan, req: ChatRequest, counter: tokens.Counter) -> None:
        model = self.cfg.summarizer_model or req.model
        fresh = [c for c in plan.clusters if not c.cached]  # a stored summary is not asked again
        results = await asyncio.gather(*(self._llm_summary(c, model, counter) for c in fresh))
        for c, text in zip(fresh, results):
            if text is not None:  # else the extractive summary stays
                replace_summary(plan, c, text, "llm:" + model, counter)

    async def _llm_summary(self, c: Cluster, model: str, counter: tokens.Counter) -> str | None:
        key = c.key("llm:" + model)
        if key in self._cache:
            return self._remember(key)
        assert self.router is not None
        prompt = SUMMARIZE_PROMPT.format(
            n=self.cfg.summary_sentences, text=self._summarizer_input(c, model, counter)
        )
        request = ChatRequest(
            model=model,
            messages=[Message("user", [Text(prompt)])],
            max_tokens=max(32, c.tokens),
            temperature=0.0,
        )
        try:
            summary = (await self.router.complete(request)).text().strip()
        except GatewayError as e:
            log.warning(
                "LLM summarizer %s failed (%s); using the extractive summary", model, e.message
            )
            return None
        return self._remember(key, summary) if summary else None

    def _summarizer_input(self, c: Cluster, model: str, counter: tokens.Counter) -> str:
        """The cluster's text, cut to leave room for the summarizer's own prompt and answer."""
        assert self.router is not None
        window = tokens.context_window(self.router.config_of(model)) or 8_192
        room = int(window * self.cfg.threshold) - 256 - max(32, c.tokens)
        return cluster_text(c, room, counter)

    async def _local_summaries(
        self, local: LocalSummarizer, plan: Plan, counter: tokens.Counter, budget: Budget
    ) -> SummarizerFallback | None:
        """Model-written summaries for the clusters, all at once (the engine batches them), until
        `budget`'s deadline; the extractive ones stay where they do not come in time, or do not
        fit."""
        fresh = [c for c in plan.clusters if not c.cached]
        for c in [c for c in fresh if c.key(local.name) in self._cache]:
            replace_summary(plan, c, self._remember(c.key(local.name)), local.name, counter)
            fresh.remove(c)
        if not fresh:
            return None
        if local.state != "ready":
            local.start_loading()
            return "unavailable" if local.state == "failed" else "warming-up"
        tasks = {
            asyncio.ensure_future(
                local.summarize(
                    cluster_text(c, self.cfg.summary_input_tokens, counter),
                    self._summary_room(plan, c),
                )
            ): c
            for c in fresh
        }
        try:
            done, pending = await asyncio.wait(
                tasks, timeout=max(0.0, budget.deadline - time.monotonic())
            )
        finally:  # past the deadline, or the request itself cancelled (client gone)
            for t in tasks:
                t.cancel()  # the engine aborts a generation still running and frees its KV blocks
        fallback: SummarizerFallback | None = "budget" if pending else None
        for t, c in tasks.items():  # most relevant cluster first: it has first claim on the room
            if t not in done:
                continue
            if t.exception() is not None:
                log.warning(
                    "local summarizer %s failed (%s); using the extractive summary",
                    local.name,
                    t.exception(),
                )
                fallback = fallback or "error"
            elif text := t.result():
                self._remember(c.key(local.name), text)
                replace_summary(plan, c, text, local.name, counter)
        if pending:
            log.info(
                "%d of %d local summaries not done within the compression budget; extractive "
                "ones kept",
                len(pending),
                len(tasks),
            )
        return fallback

    def _summary_room(self, plan: Plan, c: Cluster) -> int:
        """Tokens a model summary of `c` may generate: its configured bound, within the plan's
        free room."""
        room = plan.target - plan.tokens_after() + c.tokens
        return max(8, min(self.cfg.summary_max_tokens, room))

    def _remember(self, key: str, text: str | None = None) -> str:
        """A model summary by cluster key: stored (with `text`) or looked up, in an LRU."""
        if text is None:
            self._cache.move_to_end(key)
            return self._cache[key]
        self._cache[key] = text
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return text


def cluster_text(c: Cluster, room: int, counter: tokens.Counter) -> str:
    """The cluster's units in order, the most relevant ones if not all fit in `room` tokens (the
    most relevant one clipped if none does)."""
    parts, used = [], 0
    for u in sorted(c.units, key=lambda u: -u.relevance):
        if used + u.tokens > room:
            continue
        parts.append((u.start, u.text))
        used += u.tokens
    if not parts:
        best = max(c.units, key=lambda u: u.relevance)
        return clip(counter, best.text, max(1, room))
    return "\n\n".join(t for _, t in sorted(parts))


def replace_summary(
    plan: Plan, c: Cluster, text: str, source: str, counter: tokens.Counter
) -> None:
    """`text` (by `source`) as `c`'s summary if the plan still fits its target with it; else the
    current one stays."""
    n = counter.tokens("- " + text) + 1
    if plan.tokens_after() - c.tokens + n > plan.target:
        log.info(
            "%s summary of %d tokens does not fit the window; keeping the extractive one", source, n
        )
        return
    c.summary, c.tokens, c.source = text, n, source

"""The compressor: checks every chat request against its model's window, compresses it when it must.

It holds the models (the embedding model, a local summarizer), loads them off the request path,
runs the planner on a thread of its own and records what it did.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flashstack.gateway import tokens
from flashstack.gateway.compress.budget import Budget, BudgetExceeded
from flashstack.gateway.compress.local_summarizer import LoadState, LocalSummarizer
from flashstack.gateway.compress.memory import SessionMemory, new_vectors, seed_vectors
from flashstack.gateway.compress.metrics import CompressionMetrics
from flashstack.gateway.compress.options import Options, request_options
from flashstack.gateway.compress.outcome import Fallback, Outcome, context_length_exceeded
from flashstack.gateway.compress.plan import apply, outcome_of
from flashstack.gateway.compress.planner import Planner
from flashstack.gateway.compress.summaries import ModelSummaries
from flashstack.gateway.config import CompressionConfig, CompressionMode, ModelConfig
from flashstack.gateway.core import ChatRequest, ErrorKind, GatewayError, invalid_request

if TYPE_CHECKING:
    from flashstack.gateway.compress.embed import Embedder
    from flashstack.gateway.routing import Router

log = logging.getLogger(__name__)


class Compressor:
    """Checks every chat request against its model's window and compresses it when it must.

    The embedding model never loads on a request's path: `start_loading` loads it in a thread of
    its own (at start-up with `preload`, else when a request first needs it), and until it is
    loaded a request over the window is truncated, said in x-flashstack-compression-fallback.
    A local summarizer loads the same way; until then summaries are extractive, said in
    x-flashstack-summarizer-fallback.
    """

    def __init__(
        self,
        cfg: CompressionConfig,
        state_dir: Path,
        router: Router | None = None,
        embedder: Embedder | None = None,
    ) -> None:
        self.cfg = cfg
        self.cache_dir = cfg.cache_dir or Path(state_dir) / "models"
        self.router = router
        self.metrics = CompressionMetrics()
        self._planner = Planner(cfg, embedder)
        self._loader: threading.Thread | None = None
        self._loader_lock = threading.Lock()
        self._loaded = threading.Event()  # set once the load finished, loaded or not
        # One thread for measuring, planning and embedding: two on a 2-core box only contend.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flashstack-compress")
        self.local = LocalSummarizer(cfg, router) if cfg.summarizer == "local" else None
        self.summaries = ModelSummaries(cfg, router, self.local)

    # ---- the models --------------------------------------------------------------------------

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
        """Load the embedding model in a background thread, and a local summarizer (in an event
        loop only: else the first request that needs it starts it), once; nothing waits for them."""
        with self._loader_lock:
            if self._loader is None and self._planner.embedder is None:
                self._loader = threading.Thread(
                    target=self._load, name="flashstack-embed-load", daemon=True
                )
                self._loader.start()
        if self.local is not None:
            self.local.start_loading()

    def _load(self) -> None:
        try:
            self._planner = self._planner.with_embedder(self._load_embedder())
        except Exception:  # a missing package or a failed build: truncation still serves requests
            log.exception(
                "the embedding model could not be loaded; requests over their model's "
                "window are truncated instead of compressed"
            )
        finally:
            self._loaded.set()

    def _load_embedder(self) -> Embedder:
        from flashstack.gateway.compress.embed import Embedder

        return Embedder(
            self.cache_dir, threads=self.cfg.embed_threads, cache_size=self.cfg.embed_cache_size
        )

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """Block until the models are loaded (True) or one failed to load / timed out (False); for
        tools and tests, off the event loop. A local summarizer is waited for once its load has
        started."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._wait_embedder(timeout):
            return False
        if self.local is None or self.local.state == "idle":
            return True
        return self.local.wait_loaded(
            None if deadline is None else max(0.0, deadline - time.monotonic())
        )

    def _wait_embedder(self, timeout: float | None = None) -> bool:
        if self._planner.embedder is None:
            self.start_loading()
            self._loaded.wait(timeout)
        return self._planner.embedder is not None

    async def planner(self) -> Planner:
        """The planner with its models loaded, waiting for them (offline tools; requests never
        wait)."""
        if not await asyncio.to_thread(self._wait_embedder):
            raise RuntimeError(
                "the embedding model could not be loaded; see the log of "
                "flashstack.gateway.compress"
            )
        if self.local is not None and not await self.local.loaded():
            raise RuntimeError(
                "the local summarizer could not be loaded; see the log of "
                "flashstack.gateway.compress"
            )
        return self._planner

    async def embed_texts(self, texts: list[str]) -> tuple[Any, list[int]]:
        """Unit vectors and word-piece counts for `texts` (POST /v1/embeddings, model minilm), on
        the compression thread, once the model is loaded. A text over the model's 256 word pieces
        is refused (a 400 naming it), never embedded cut short."""
        from flashstack.gateway.compress.embed import MAX_TOKENS

        if not await asyncio.to_thread(self._wait_embedder):
            raise GatewayError(
                ErrorKind.OVERLOADED, "the embedding model could not be loaded; see the gateway log"
            )
        embedder = self._planner.embedder
        assert embedder is not None
        counts = await self._run(embedder.token_counts, texts)
        for i, n in enumerate(counts):
            if n > MAX_TOKENS:
                raise invalid_request(
                    f"input[{i}] is {n} word pieces; minilm reads at most "
                    f"{MAX_TOKENS}: split the text",
                    "input",
                )
        return await self._run(embedder.embed, texts), counts

    # ---- one request -------------------------------------------------------------------------

    def mode_for(
        self,
        req: ChatRequest,
        cfg: ModelConfig,
        options: Options,
        memory: SessionMemory | None = None,
    ) -> CompressionMode:
        """The request's mode, else its session's, else its model's, else the default."""
        return (
            options.mode
            or (memory.mode if memory else None)
            or self.cfg.model_modes.get(cfg.name)
            or self.cfg.mode
        )

    async def prepare_context(self, req: ChatRequest, turn: Any) -> tuple[ChatRequest, Outcome]:
        """`req` fitted to its model's window: itself, a compressed copy, or a 400
        context_length_exceeded. `turn` (a sessions.turns.Turn) lends its session's mode, stored
        embeddings and summaries."""
        assert self.router is not None, (
            "the request path's compressor routes: Services builds it so"
        )
        memory = SessionMemory.of(turn) if turn.in_session else None
        return await self.maybe_compress(req, self.router.config_of(req.model), memory)

    async def maybe_compress(
        self, req: ChatRequest, cfg: ModelConfig, memory: SessionMemory | None = None
    ) -> tuple[ChatRequest, Outcome]:
        """`req` itself when it fits (or compression is off), else a compressed copy; never a
        silent cut."""
        options = request_options(req)
        mode = self.mode_for(req, cfg, options, memory)
        window = tokens.context_window(cfg)
        if mode == "off" or window is None or not req.messages:
            return req, Outcome("none", 0, 0)
        reserve = tokens.output_reserve(req, cfg, window)
        limit = math.floor(self.cfg.threshold * window)
        if reserve >= limit:  # refused on its fields alone: before any tokenizer, thread or model
            raise context_length_exceeded(
                f"max_tokens ({reserve}) leaves no room for the prompt in this model's "
                f"{window}-token window (compression threshold {self.cfg.threshold}); "
                "lower max_tokens"
            )
        if tokens.request_upper_bound(cfg, req) + reserve <= limit:
            return req, Outcome("none", 0, 0)  # cannot be over: no tokenizer, no thread hop
        budget = self._budget()  # from arrival: waiting for the compression thread counts
        counter = await self._run(tokens.counter_for, cfg)  # a tokenizer's first load takes a while
        _, _, total = await self._run(self._planner.measure, counter, req)
        if total + reserve <= limit:
            return req, Outcome("none", total, total)
        try:
            new, outcome = await self.compress(
                req, cfg, limit - reserve, mode, options.pinned, memory, budget
            )
        except GatewayError as e:
            if e.code == "context_length_exceeded":
                self.metrics.refused.labels(cfg.name).inc()
            raise
        self.metrics.record(cfg.name, outcome)
        return new, outcome

    async def compress(
        self,
        req: ChatRequest,
        cfg: ModelConfig,
        target: int,
        mode: CompressionMode = "auto",
        pinned: frozenset[int] = frozenset(),
        memory: SessionMemory | None = None,
        budget: Budget | None = None,
    ) -> tuple[ChatRequest, Outcome]:
        """A copy of `req` whose prompt fits `target` tokens (the trigger already fired).

        Truncated instead when the embedding model is not loaded, or compressing would overspend
        `budget`.
        """
        planner = self._planner
        counter = await self._run(tokens.counter_for, cfg)
        fallback: Fallback | None = None
        if mode == "auto" and planner.embedder is None:
            self.start_loading()
            fallback = "unavailable" if self.state == "failed" else "warming-up"
        elif mode == "auto":
            try:
                return await self._compress(
                    planner, counter, req, target, pinned, memory, budget or self._budget()
                )
            except BudgetExceeded as e:
                log.info(
                    "compression of a %s request over its budget (%s); truncating it", cfg.name, e
                )
                fallback = "budget"
        plan = await self._run(planner.plan, counter, req, target, "truncate", pinned)
        outcome = outcome_of(plan)
        outcome.fallback = fallback
        return apply(req, plan), outcome

    async def _compress(
        self,
        planner: Planner,
        counter: tokens.Counter,
        req: ChatRequest,
        target: int,
        pinned: frozenset[int],
        memory: SessionMemory | None,
        budget: Budget,
    ) -> tuple[ChatRequest, Outcome]:
        assert planner.embedder is not None
        summarizer = self.summaries.name(req)
        stored_vectors: dict[str, bytes] = {}
        if memory is None:
            plan = await self._run(
                planner.plan, counter, req, target, "auto", pinned, None, summarizer, budget
            )
        else:
            stored_vectors, stored_summaries = await memory.load()
            await self._run(
                seed_vectors,
                planner.embedder,
                req.messages,
                memory.turn.history_ids,
                stored_vectors,
            )
            plan = await self._run(
                planner.plan,
                counter,
                req,
                target,
                "auto",
                pinned,
                stored_summaries,
                summarizer,
                budget,
            )
        summarizer_fallback = await self.summaries.write(plan, req, counter, budget)
        if memory is not None:
            await memory.save_summaries(
                {
                    c.key(c.source): c.summary
                    for c in plan.clusters
                    if not c.cached and c.source == summarizer
                }
            )
            n_history = len(memory.turn.history)
            try:
                memory.turn.vectors.update(
                    await self._run(
                        new_vectors,
                        planner.embedder,
                        req.messages,
                        memory.turn.history_ids,
                        n_history,
                        n_history + len(memory.turn.inputs),
                        stored_vectors,
                        budget,
                    )
                )
            except BudgetExceeded:
                pass  # the plan stands; a later turn computes (and stores) the inputs' embeddings
        outcome = outcome_of(plan)
        outcome.summarizer_fallback = summarizer_fallback
        return apply(req, plan), outcome

    def _budget(self) -> Budget:
        return Budget.of(self.cfg.max_embed_tokens, self.cfg.max_plan_seconds)

    async def _run(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` on the compression thread: the event loop never waits on a tokenizer or the
        model."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def render_metrics(self) -> bytes:
        return self.metrics.render()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._planner.embedder is not None:
            self._planner.embedder.close()

    async def aclose(self) -> None:
        """`close`, and the local summarizer's engine unless a served model shares it (the router
        closes that)."""
        if self.local is not None and not self.local.shared:
            await self.local.provider.aclose()
        self.close()

"""The request log: every chat request, with its route, tokens and cost; the operator's
view of traffic.

The newest `spend.log_size` requests are kept in memory for the console; with `spend.store_requests`
each is also a row of `fs_requests`, written in batches off the request path (a row reaches the
database within `spend.flush_interval`), which is what spend reports and budget ledgers add up.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import orjson

from flashstack.gateway import telemetry
from flashstack.gateway.config import Config
from flashstack.gateway.core import ChatRequest, GatewayError, Usage
from flashstack.gateway.routing import RouteTrace
from flashstack.gateway.spend import PriceTable, SpendStore

log = logging.getLogger("flashstack.requests")
PRUNE_EVERY = 3600.0  # seconds between deletions of rows past spend.retention_days


@dataclass(slots=True)
class RequestRecord:
    """One request (chat, embeddings, legacy completion) as the log keeps it; filled in as it
    goes, ended once."""

    trace: RouteTrace
    wire: str
    path: str
    stream: bool = False
    id: str = field(default_factory=lambda: "rq_" + uuid.uuid4().hex[:20])
    created: float = field(default_factory=time.time)
    t0: float = field(default_factory=time.perf_counter)
    key_id: str | None = None
    model: str | None = None
    session_id: str | None = None
    status: int = 0
    error: str | None = None
    cost_usd: float = 0.0
    latency_ms: float = 0.0
    dropped: list[str] = field(default_factory=list)
    # the request's budget hold (auth.Reservation.budget): its settled cost wins
    charged: Any = None
    ended: bool = False

    def request(
        self, req: ChatRequest, session_id: str | None = None, operation: str = "chat"
    ) -> None:
        self.model, self.stream, self.session_id = req.model, req.stream, session_id
        if self.trace.span is not None:
            self.trace.span.update_name(f"{operation} {req.model}")  # type: ignore[attr-defined]
            attrs = {**telemetry.request_attributes(req), "gen_ai.operation.name": operation}
            self.trace.span.set_attributes(attrs)  # type: ignore[attr-defined]

    @property
    def usage(self) -> Usage:
        return self.trace.usage or Usage()

    def summary(self) -> dict[str, Any]:
        """The record as the console lists it."""
        u, t = self.usage, self.trace
        return {
            "id": self.id,
            "request_id": t.request_id,
            "created": self.created,
            "key_id": self.key_id,
            "model": self.model,
            "deployment": t.served_by,
            "status": self.status,
            "stream": self.stream,
            "attempts": len(t.attempts),
            "input_tokens": u.input_tokens,
            "output_tokens": u.output_tokens,
            "cache_read_tokens": u.cache_read_input_tokens,
            "cache_write_tokens": u.cache_creation_input_tokens,
            "cost_usd": self.cost_usd,
            "latency_ms": round(self.latency_ms, 2),
        }

    def detail(self) -> dict[str, Any]:
        """What opening a request in the console shows beside its summary."""
        return {
            "wire": self.wire,
            "path": self.path,
            "session_id": self.session_id,
            "error": self.error,
            "ttft_ms": None if self.trace.ttft_ms is None else round(self.trace.ttft_ms, 2),
            "dropped": self.dropped,
            "route": [
                {"deployment": a.deployment, "result": a.result, "ms": round(a.ms, 2)}
                for a in self.trace.attempts
            ],
        }

    def row(self) -> dict[str, Any]:
        s = self.summary()
        return {
            "id": self.id,
            "request_id": s["request_id"][:128],
            "created_at": int(self.created * 1000),
            "key_id": self.key_id,
            "model": self.model,
            "deployment": s["deployment"],
            "status": self.status,
            "stream": int(self.stream),
            "input_tokens": s["input_tokens"],
            "output_tokens": s["output_tokens"],
            "cache_read_tokens": s["cache_read_tokens"],
            "cache_write_tokens": s["cache_write_tokens"],
            "cost_usd": self.cost_usd,
            "latency_ms": self.latency_ms,
            "detail": orjson.dumps(self.detail()).decode(),
        }


class RequestLog:
    """Records requests: a ring in memory, batched rows in the database, and the request's span."""

    def __init__(
        self,
        prices: PriceTable,
        store: SpendStore | None,
        size: int = 1000,
        flush_interval: float = 0.5,
        tracing: telemetry.Tracing | None = None,
        retention_days: int = 400,
    ) -> None:
        self.prices = prices
        self.store = store
        self.flush_interval = flush_interval
        self.retention = retention_days * 86400.0
        self._pruned = 0.0  # monotonic time of the last deletion of rows past the retention
        self.tracing = tracing
        self.ring: deque[RequestRecord] = deque(maxlen=size)
        self._pending: list[dict[str, Any]] = []
        self._writer: asyncio.Task[None] | None = None
        self._writing = asyncio.Lock()  # a flush returns once every row ended before it is written

    @classmethod
    def from_config(
        cls, config: Config, store: SpendStore, tracing: telemetry.Tracing | None
    ) -> RequestLog:
        return cls(
            PriceTable(config.models, config.spend.prices),
            store if config.spend.store_requests else None,
            config.spend.log_size,
            config.spend.flush_interval,
            tracing,
            config.spend.retention_days,
        )

    def begin(
        self, trace: RouteTrace, wire: str, method: str, path: str, headers: Any
    ) -> RequestRecord:
        if self.tracing is not None:
            trace.tracing = self.tracing
            trace.span = self.tracing.request_span(headers, method, path)
        return RequestRecord(trace, wire, path)

    async def end(
        self,
        rec: RequestRecord,
        status: int,
        error: GatewayError | None = None,
        dropped: str | None = None,
    ) -> None:
        """Price and keep `rec` (once); a stream ends when its last event went out."""
        if rec.ended:
            return
        rec.ended = True
        rec.status = status
        rec.latency_ms = (time.perf_counter() - rec.t0) * 1000
        rec.error = error.message if error is not None else rec.error or rec.trace.error
        rec.dropped = dropped.split(",") if dropped else []
        charged = rec.charged
        if charged is not None and charged.settled:
            rec.cost_usd = charged.charged
        elif rec.trace.usage is not None:
            rec.cost_usd = self.prices.of_deployment(rec.trace.served_by, rec.model).cost(
                rec.trace.usage
            )
        telemetry.end_request(rec.trace.span, status, self._span_attributes(rec))
        self.ring.append(rec)
        if self.store is not None:
            self._pending.append(rec.row())
            if self._writer is None:
                self._writer = asyncio.create_task(self._write_loop())

    def _span_attributes(self, rec: RequestRecord) -> dict[str, Any]:
        if rec.trace.span is None:
            return {}
        attrs: dict[str, Any] = {
            "flashstack.request_id": rec.trace.request_id,
            "flashstack.key_id": rec.key_id,
            "flashstack.deployment": rec.trace.served_by,
            "flashstack.attempts": len(rec.trace.attempts),
            "flashstack.cost_usd": rec.cost_usd,
        }
        if rec.trace.usage is not None:
            attrs.update(telemetry.usage_attributes(rec.trace.usage))
        return attrs

    async def _write_loop(self) -> None:
        while True:
            await asyncio.sleep(self.flush_interval)
            await self.flush()
            if time.monotonic() - self._pruned > PRUNE_EVERY:
                await self.prune()

    async def prune(self) -> int:
        """Delete rows older than `spend.retention_days` (each replica does; the
        second finds none)."""
        self._pruned = time.monotonic()
        if self.store is None:
            return 0
        try:
            return await self.store.delete_before(time.time() - self.retention)
        except Exception:
            log.exception("could not delete request rows past their retention")
            return 0

    async def flush(self) -> None:
        """Write the rows not yet written (a failed write is logged, and its rows dropped)."""
        async with self._writing:
            rows, self._pending = self._pending, []
            if not rows or self.store is None:
                return
            try:
                await self.store.insert(rows)
            except Exception:
                log.exception("could not store %d request rows", len(rows))

    def recent(
        self,
        limit: int = 100,
        key_id: str | None = None,
        model: str | None = None,
        status: str | None = None,
        text: str | None = None,
    ) -> list[dict[str, Any]]:
        """The newest requests first, filtered: status "ok" (< 400), "error", or a number."""
        out: list[dict[str, Any]] = []
        for rec in reversed(self.ring):
            if key_id and rec.key_id != key_id or model and rec.model != model:
                continue
            if status == "ok" and rec.status >= 400 or status == "error" and rec.status < 400:
                continue
            if status and status.isdigit() and rec.status != int(status):
                continue
            if text and text not in rec.trace.request_id and text not in rec.id:
                continue
            out.append(rec.summary())
            if len(out) >= limit:
                break
        return out

    def get(self, record_id: str) -> dict[str, Any] | None:
        for rec in self.ring:
            if rec.id == record_id or rec.trace.request_id == record_id:
                return {**rec.summary(), **rec.detail()}
        return None

    async def aclose(self) -> None:
        if self._writer is not None:
            self._writer.cancel()
            self._writer = None
        await self.flush()
        if self.tracing is not None:
            self.tracing.shutdown()

"""Circuit breakers per deployment: which failures count, how long a cooldown lasts, and what to do
when the shared store is unreachable (keep routing on this process's own state until it is back)."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from flashstack.gateway.config import RouterConfig
from flashstack.gateway.core import GatewayError
from flashstack.gateway.routing.state import MemoryState, Snapshot, StateStore, TripPolicy

log = logging.getLogger("flashstack.router")
T = TypeVar("T")

# After a shared-store failure, use local state this long before trying the store again, so an
# unreachable Redis costs one timeout per interval instead of one per request.
STORE_RETRY_INTERVAL = 5.0


def counts_against_upstream(err: GatewayError) -> bool:
    """429, 408, 5xx, timeouts and connection errors; never a 4xx the caller caused."""
    return err.status in (408, 429) or err.status >= 500


class Breakers:
    """The breaker policy over a StateStore (in-process or Redis), with a local stand-in."""

    def __init__(self, store: StateStore, cfg: RouterConfig) -> None:
        self.store = store
        self.local = store if isinstance(store, MemoryState) else MemoryState()
        self.cfg = cfg
        self.policy = TripPolicy(
            cfg.breaker_failures,
            cfg.breaker_failure_rate,
            cfg.breaker_window,
            cfg.breaker_min_requests,
        )
        self.store_down_until = 0.0

    def cooldown(self, err: GatewayError) -> float:
        """Seconds an opened breaker stays open: the configured cooldown, longer if the upstream
        asked for longer with retry-after (capped by breaker_max_cooldown)."""
        return min(
            max(self.cfg.breaker_cooldown, err.retry_after or 0.0), self.cfg.breaker_max_cooldown
        )

    async def snapshot(self, ids: list[str]) -> list[Snapshot]:
        return await self._run(lambda s: s.snapshot(ids))

    async def failure(self, dep: str, err: GatewayError) -> bool:
        """Record a failure that counts; True when it opened the breaker."""
        return await self._run(lambda s: s.record_failure(dep, self.policy, self.cooldown(err)))

    async def success(self, dep: str) -> bool:
        """Record a success; True when it closed a half-open breaker."""
        return await self._run(lambda s: s.record_success(dep, self.policy))

    async def try_probe(self, dep: str, ttl: float) -> bool:
        return await self._run(lambda s: s.try_probe(dep, ttl))

    async def probe_passed(self, dep: str) -> bool:
        """A passing active health probe ends an open breaker's cooldown; True when one was open.
        Half-open, not closed: a model list answering does not prove chat does, so the next request
        is the trial that closes it (or re-opens it at once)."""
        return await self._run(lambda s: s.end_cooldown(dep))

    async def add_in_flight(self, dep: str, delta: int) -> None:
        await self._run(lambda s: s.add_in_flight(dep, delta))

    async def aclose(self) -> None:
        await self.store.aclose()

    async def _run(self, op: Callable[[StateStore], Awaitable[T]]) -> T:
        if self.store is self.local or time.monotonic() < self.store_down_until:
            return await op(self.local)
        try:
            return await op(self.store)
        except Exception as e:  # noqa: BLE001 - any store failure: route on local state meanwhile
            log.warning(
                "router state store failed (%s: %s); using this process's own breaker state "
                "for %g s",
                type(e).__name__,
                e,
                STORE_RETRY_INTERVAL,
            )
            self.store_down_until = time.monotonic() + STORE_RETRY_INTERVAL
            return await op(self.local)

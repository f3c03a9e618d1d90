"""Active health checks: one background probe loop per deployment, each probe bounded in time.

Probes run beside the traffic and only write the deployment's last result, so a slow or hanging
upstream can never hold a request up; the balancer prefers deployments whose last probe passed.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from contextlib import suppress
from typing import Any

from flashstack.gateway.providers.base import Health


async def probe(provider: Any, timeout: float) -> Health:
    """The provider's health, or a failed Health once `timeout` seconds pass."""
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            return await provider.health()
    except TimeoutError:
        return Health(
            False, (time.perf_counter() - t0) * 1000, f"health probe timed out after {timeout:g} s"
        )
    except Exception as e:  # noqa: BLE001 - a probe that crashes is a failed probe
        return Health(False, detail=f"health probe failed: {type(e).__name__}: {e}")


class HealthChecker:
    """Runs `probe` for every deployment every `interval` seconds and hands results to `report`."""

    def __init__(
        self, interval: float, timeout: float, report: Callable[[Any, Health], Awaitable[None]]
    ) -> None:
        self.interval, self.timeout, self.report = interval, timeout, report
        self.tasks: list[asyncio.Task[None]] = []

    def start(self, deployments: Iterable[Any]) -> None:
        if self.interval <= 0 or self.tasks:
            return
        self.tasks = [
            asyncio.create_task(self._loop(d), name=f"health:{d.id}") for d in deployments
        ]

    async def _loop(self, dep: Any) -> None:
        # Jittered start, so replicas and deployments do not probe in lockstep.
        await asyncio.sleep(random.uniform(0, min(self.interval, 1.0)))
        while True:
            await self.report(dep, await probe(dep.provider, self.timeout))
            await asyncio.sleep(self.interval * random.uniform(0.9, 1.1))

    async def aclose(self) -> None:
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with suppress(asyncio.CancelledError):
                await task
        self.tasks = []

"""Which deployment serves a request, and what happens when it fails before the first byte."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from dataclasses import dataclass

from flashstack.config import ModelConfig
from flashstack.gateway.core import ChatRequest, ChatResponse, ErrorKind, Event, GatewayError
from flashstack.gateway.providers import Provider, build_provider


@dataclass(slots=True)
class Deployment:
    cfg: ModelConfig
    provider: Provider
    in_flight: int = 0


class Router:
    """Model name → deployments; tries the next deployment on a retryable failure."""

    def __init__(self, models: list[ModelConfig], providers: dict[int, Provider] | None = None) -> None:
        self.groups: dict[str, list[Deployment]] = {}
        for i, cfg in enumerate(models):
            provider = (providers or {}).get(i) or build_provider(cfg)
            self.groups.setdefault(cfg.name, []).append(Deployment(cfg, provider))

    def model_names(self) -> list[str]:
        return list(self.groups)

    def config_of(self, name: str) -> ModelConfig:
        return self.deployments(name)[0].cfg

    def deployments(self, name: str) -> list[Deployment]:
        group = self.groups.get(name)
        if not group:
            known = ", ".join(self.groups) or "none configured"
            raise GatewayError(
                ErrorKind.NOT_FOUND,
                f"model {name!r} does not exist; available models: {known}",
                param="model",
                code="model_not_found",
            )
        return group

    def _order(self, name: str) -> list[Deployment]:
        group = self.deployments(name)
        if len(group) == 1:
            return group
        # Weighted random order: the first pick gets the traffic, the rest are fallbacks.
        remaining, order = list(group), []
        while remaining:
            pick = random.choices(remaining, [d.cfg.weight for d in remaining])[0]
            remaining.remove(pick)
            order.append(pick)
        return order

    async def open_stream(self, request: ChatRequest) -> AsyncIterator[Event]:
        """A stream whose first event has arrived; failures before it fall through the group."""
        last: GatewayError | None = None
        for dep in self._order(request.model):
            events = dep.provider.stream(request)
            try:
                first = await anext(events)
            except StopAsyncIteration:
                last = GatewayError(ErrorKind.UPSTREAM, f"{dep.provider.name} sent an empty stream")
                continue
            except GatewayError as e:
                await events.aclose()
                if not e.retryable:
                    raise
                last = e
                continue
            return _prepend(first, events, dep)
        assert last is not None
        raise last

    async def complete(self, request: ChatRequest) -> ChatResponse:
        last: GatewayError | None = None
        for dep in self._order(request.model):
            dep.in_flight += 1
            try:
                return await dep.provider.complete(request)
            except GatewayError as e:
                if not e.retryable:
                    raise
                last = e
            finally:
                dep.in_flight -= 1
        assert last is not None
        raise last

    async def readiness(self) -> dict[str, list[dict[str, object]]]:
        report: dict[str, list[dict[str, object]]] = {}
        for name, group in self.groups.items():
            for dep in group:
                h = await dep.provider.health()
                report.setdefault(name, []).append(
                    {"provider": dep.provider.name, "ok": h.ok, "latency_ms": h.latency_ms, "detail": h.detail}
                )
        return report

    async def aclose(self) -> None:
        for group in self.groups.values():
            for dep in group:
                await dep.provider.aclose()


async def _prepend(first: Event, rest: AsyncIterator[Event], dep: Deployment) -> AsyncIterator[Event]:
    dep.in_flight += 1
    try:
        yield first
        async for ev in rest:
            yield ev
    finally:
        dep.in_flight -= 1
        await rest.aclose()

"""Which deployment serves a request: balancing, retries, fallbacks and circuit breakers.

A request for model M is tried on M's deployments (1 + `num_retries` attempts, a different healthy
deployment first, backoff with jitter before a deployment is tried again), then on M's fallbacks in
order (at most `max_fallbacks` hops). A stream may move to another deployment only until its first
token: after that the client has bytes, and a failure becomes an error event in its format.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import TypeVar

import orjson

from flashstack.gateway import telemetry
from flashstack.gateway.config import ConfigError, ModelConfig, RouterConfig
from flashstack.gateway.core import (
    ChatRequest,
    ChatResponse,
    Error,
    ErrorKind,
    Event,
    Finish,
    GatewayError,
    Start,
    Text,
    Usage,
)
from flashstack.gateway.providers import Provider, build_provider
from flashstack.gateway.providers.base import Health
from flashstack.gateway.redact import Redactor, excerpt, secrets_of
from flashstack.gateway.routing import balancer
from flashstack.gateway.routing.breaker import Breakers, counts_against_upstream
from flashstack.gateway.routing.health import HealthChecker, probe
from flashstack.gateway.routing.metrics import RouterMetrics
from flashstack.gateway.routing.state import BreakerState, Snapshot, build_state
from flashstack.gateway.routing.trace import Attempt, RouteTrace

log = logging.getLogger("flashstack.router")
T = TypeVar("T")
_NOTHING = object()  # a stream's end before its first item

# Upstream error codes and phrases that mean "the prompt is too long" / "refused by a
# content filter".
_CONTEXT_WINDOW_HINTS = (
    "context_length_exceeded",
    "context window",
    "context length",
    "prompt is too long",
    "maximum context",
    "too many tokens",
)
_CONTENT_POLICY_HINTS = (
    "content_policy",
    "content_filter",
    "content management policy",
    "safety system",
)
# Room for the gateway's own words around an upstream excerpt (upstream_limits.error_excerpt_chars).
_ERROR_WORDS_CHARS = 512


@dataclass(slots=True)
class Deployment:
    """One configured upstream of a model, with what this replica knows about it."""

    id: str
    cfg: ModelConfig
    provider: Provider
    in_flight: int = 0  # this replica
    latency: float | None = None  # EWMA of TTFT (streams) or response time, seconds
    health: Health | None = None  # last active probe

    @property
    def weight(self) -> float:
        return self.cfg.weight


@dataclass(slots=True)
class _View:
    """A deployment as the balancer sees it for one pick."""

    dep: Deployment
    weight: float
    in_flight: int
    latency: float | None


class Router:
    """Model name → deployments, with retries, fallbacks, breakers, health checks and balancing."""

    def __init__(
        self,
        models: list[ModelConfig],
        cfg: RouterConfig | None = None,
        providers: dict[int, Provider] | None = None,
        secrets: list[str | None] | None = None,
    ) -> None:
        self.cfg = cfg or RouterConfig()
        # Every configured credential (and `secrets`, e.g. the master key), masked in
        # every error and log.
        self.redact = Redactor(secrets_of(models, *(secrets or [])))
        self._max_error = self.cfg.upstream_limits.error_excerpt_chars + _ERROR_WORDS_CHARS
        self.groups: dict[str, list[Deployment]] = {}
        for i, m in enumerate(models):
            group = self.groups.setdefault(m.name, [])
            dep_id = m.id or f"{m.name}#{len(group)}"
            # providers name errors by deployment id
            m = m if m.id else m.model_copy(update={"id": dep_id})
            provider = (providers or {}).get(i) or build_provider(
                m, self.cfg.upstream_limits, self.redact
            )
            group.append(Deployment(dep_id, m, provider))
        self._check_fallbacks(models)
        self.metrics = RouterMetrics()
        self.breakers = Breakers(build_state(self.cfg.redis_url, self.cfg.redis_prefix), self.cfg)
        self.checker = HealthChecker(
            self.cfg.health_check_interval, self.cfg.health_check_timeout, self._on_active_probe
        )

    def _check_fallbacks(self, models: list[ModelConfig]) -> None:
        """Every fallback must name a configured model: a typo would otherwise
        surface mid-outage."""
        named = [("router.default_fallbacks", f) for f in self.cfg.default_fallbacks]
        for m in models:
            for field_name in ("fallbacks", "context_window_fallbacks", "content_policy_fallbacks"):
                named += [(f"{field_name} of model {m.name!r}", f) for f in getattr(m, field_name)]
        for where, name in named:
            if name not in self.groups:
                raise ConfigError(
                    f"{where} lists {name!r}, which is not a configured model name; "
                    f"configured: {', '.join(self.groups) or 'none'}"
                )

    # ---- the public surface the gateway uses -------------------------------------------------

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

    def all_deployments(self) -> list[Deployment]:
        return [d for group in self.groups.values() for d in group]

    def start(self) -> None:
        """Start the active health probes (needs a running event loop; idempotent)."""
        self.checker.start(self.all_deployments())

    async def open_stream(
        self, request: ChatRequest, trace: RouteTrace | None = None
    ) -> AsyncIterator[Event]:
        """A stream whose first token has arrived; failures before it move to another deployment."""
        return await self._route(request, trace or RouteTrace(), self._open_on)

    async def complete(self, request: ChatRequest, trace: RouteTrace | None = None) -> ChatResponse:
        """The whole response, from the first deployment (or fallback) that gives one."""
        return await self._route(request, trace or RouteTrace(), self._complete_on)

    async def call(
        self,
        request: ChatRequest,
        trace: RouteTrace,
        operation: str,
        serves: Callable[[Deployment], bool],
        send: Callable[[Deployment], Awaitable[T]],
    ) -> T:
        """`send` to a deployment of `request.model` (or of a fallback) that `serves` the
        `operation` (embeddings, legacy completions), with a chat request's retries, breakers and
        attempt spans; `send` sets `trace.usage` when the reply tells it."""

        async def attempt(dep: Deployment, req: ChatRequest, tr: RouteTrace) -> T:
            return await self._call_on(dep, req, tr, lambda d: send(d), operation)

        return await self._route(request, trace, attempt, serves)

    async def open_call(
        self,
        request: ChatRequest,
        trace: RouteTrace,
        operation: str,
        serves: Callable[[Deployment], bool],
        open_: Callable[[Deployment], AsyncIterator[T]],
    ) -> AsyncIterator[T]:
        """`call` for a stream of `open_`'s items: a failure before the first item moves to another
        deployment, and the attempt (its span, its in-flight count) lasts until the last."""

        async def attempt(dep: Deployment, req: ChatRequest, tr: RouteTrace) -> AsyncIterator[T]:
            return await self._open_call_on(dep, req, tr, open_, operation)

        return await self._route(request, trace, attempt, serves)

    async def readiness(self) -> dict[str, list[dict[str, object]]]:
        """Per model, per deployment: breaker state, in-flight count, last health probe."""
        deps = self.all_deployments()
        # Without background probes, each readiness call probes (bounded); with them,
        # only the unprobed.
        active = self.cfg.health_check_interval > 0
        unprobed = [d for d in deps if d.health is None] if active else deps
        results = await asyncio.gather(
            *(probe(d.provider, self.cfg.health_check_timeout) for d in unprobed)
        )
        for d, h in zip(unprobed, results):
            self._on_probe(d, h)
        snaps = await self._snapshot(deps)
        report: dict[str, list[dict[str, object]]] = {}
        for d, s in zip(deps, snaps):
            h = d.health or Health(False, detail="not probed")
            # No upstream address here: an api_base may carry credentials, and the id
            # names the deployment.
            report.setdefault(d.cfg.name, []).append(
                {
                    "deployment": d.id,
                    "provider": f"{d.cfg.provider}:{d.cfg.model}",
                    "ok": h.ok and s.state is not BreakerState.OPEN,
                    "breaker": s.state.name.lower(),
                    "cooldown_s": round(s.open_for, 3),
                    "in_flight": s.in_flight,
                    "latency_ms": h.latency_ms,
                    "detail": h.detail,
                }
            )
        return report

    async def render_metrics(self) -> bytes:
        """Prometheus text, with breaker states read fresh (they may be shared by
        other replicas)."""
        await self._snapshot(self.all_deployments())
        return self.metrics.render()

    async def aclose(self) -> None:
        await self.checker.aclose()
        for d in self.all_deployments():
            await d.provider.aclose()
        await self.breakers.aclose()

    # ---- routing -----------------------------------------------------------------------------

    async def _route(
        self,
        request: ChatRequest,
        trace: RouteTrace,
        attempt: Callable[[Deployment, ChatRequest, RouteTrace], Awaitable[T]],
        serves: Callable[[Deployment], bool] | None = None,
    ) -> T:
        self.start()
        t0 = time.perf_counter()
        model, chain, hops = request.model, self._fallbacks(request.model), 0
        visited = {model}
        while True:
            try:
                result = await self._try_group(model, request, trace, attempt, serves)
            except GatewayError as e:
                reason = _fallback_reason(e)
                if reason is None:
                    self._finish(request, trace, t0, f"error_{e.status}")
                    raise
                if reason != "error":  # a special chain replaces the ordinary one for what is left
                    chain = self._special_fallbacks(model, reason)
                nxt = next(
                    (m for m in chain if m not in visited and self._serving(m, serves)), None
                )
                if nxt is None or hops >= self.cfg.max_fallbacks:
                    self._finish(request, trace, t0, f"error_{e.status}")
                    raise
                hops += 1
                visited.add(nxt)
                self.metrics.fallbacks.labels(model, nxt, reason).inc()
                _log(
                    "fallback",
                    trace,
                    from_model=model,
                    to_model=nxt,
                    reason=reason,
                    error=e.message,
                )
                model = nxt
                continue
            self._finish(request, trace, t0, "ok")
            return result

    def _finish(self, request: ChatRequest, trace: RouteTrace, t0: float, outcome: str) -> None:
        self.metrics.requests.labels(request.model, outcome).inc()
        if outcome == "ok":
            self.metrics.latency.labels(request.model, str(request.stream).lower()).observe(
                time.perf_counter() - t0
            )
        _log(
            "routed",
            trace,
            model=request.model,
            outcome=outcome,
            deployment=trace.served_by,
            attempts=len(trace.attempts),
            ms=round((time.perf_counter() - t0) * 1000, 2),
        )

    def _serving(self, name: str, serves: Callable[[Deployment], bool] | None) -> list[Deployment]:
        """The deployments of `name` that can take the request (all of them for a chat)."""
        return [d for d in self.groups.get(name, []) if serves is None or serves(d)]

    async def _try_group(
        self,
        name: str,
        request: ChatRequest,
        trace: RouteTrace,
        attempt: Callable[[Deployment, ChatRequest, RouteTrace], Awaitable[T]],
        serves: Callable[[Deployment], bool] | None = None,
    ) -> T:
        self.deployments(name)  # 404 for an unknown model
        group = self._serving(name, serves)
        self._check_window(name, group, request)
        failed: dict[str, int] = {}  # deployment id → failures on this request
        skip: set[str] = set()  # told to come back later than we are willing to wait
        last: GatewayError | None = None
        for n in range(1 + self.cfg.num_retries):
            dep = await self._pick(name, group, failed, skip, last)
            if dep is None:
                break
            if n:
                self.metrics.retries.labels(name).inc()
            if dep.id in failed:
                await asyncio.sleep(self._backoff(failed[dep.id], last))
            try:
                return await attempt(dep, request, trace)
            except GatewayError as e:
                if not counts_against_upstream(e):
                    raise
                last = e
                failed[dep.id] = failed.get(dep.id, 0) + 1
                if e.retry_after and e.retry_after > self.cfg.max_retry_after:
                    skip.add(dep.id)
        if last is None:
            last = await self._all_open_error(name, group)
        raise last

    async def _pick(
        self,
        name: str,
        group: list[Deployment],
        failed: dict[str, int],
        skip: set[str],
        last: GatewayError | None,
    ) -> Deployment | None:
        """A deployment for the next attempt, or None when every one is open or ruled out."""
        for _ in range(2):  # a second pass after waiting out a short cooldown
            snaps = await self._snapshot(group)
            pool = _candidates(group, snaps, failed, skip)
            while pool:
                i = balancer.choose(
                    [_View(d, d.weight, s.in_flight, d.latency) for d, s in pool], self.cfg.strategy
                )
                dep, snap = pool.pop(i)
                if snap.state is BreakerState.CLOSED or await self.breakers.try_probe(
                    dep.id, self._probe_ttl(dep)
                ):
                    return dep
            wait = min(
                (
                    s.open_for
                    for d, s in zip(group, snaps)
                    if s.state is BreakerState.OPEN and d.id not in skip
                ),
                default=None,
            )
            if last is None or wait is None or wait > self.cfg.max_retry_after:
                return None
            await asyncio.sleep(wait + 0.01)
        return None

    async def first_choice(self, name: str) -> Deployment:
        """The deployment a request for `name` tries first (404 for an unknown name). Of several
        the balancer could pick, the first in config order, so that the answer is the same
        every time; with every breaker open, the first configured."""
        group = self.deployments(name)
        pool = _candidates(group, await self._snapshot(group), {}, set())
        # As the balancer: a weight-0 standby only when nothing weighted is left, and a closed
        # breaker before a half-open one (its one trial may be taken); stable, so config order.
        pool.sort(key=lambda ds: (ds[0].weight <= 0, ds[1].state is not BreakerState.CLOSED))
        return pool[0][0] if pool else group[0]

    def _backoff(self, failures: int, last: GatewayError | None) -> float:
        """Exponential backoff with jitter; the upstream's retry-after, when it sent
        one, is a floor."""
        cap = min(self.cfg.retry_backoff_max, self.cfg.retry_backoff * 2 ** (failures - 1))
        delay = random.uniform(cap / 2, cap)
        if last is not None and last.retry_after:
            # > max_retry_after never gets here: skipped instead
            delay = max(delay, last.retry_after)
        return delay

    def _probe_ttl(self, dep: Deployment) -> float:
        return min(dep.cfg.timeout, max(self._ttft_timeout(dep), 5.0))

    def _ttft_timeout(self, dep: Deployment) -> float:
        return dep.cfg.ttft_timeout or self.cfg.ttft_timeout

    async def _all_open_error(self, name: str, group: list[Deployment]) -> GatewayError:
        snaps = await self._snapshot(group)
        wait = min((s.open_for for s in snaps if s.state is BreakerState.OPEN), default=0.0)
        return GatewayError(
            ErrorKind.OVERLOADED,
            f"every deployment of model {name!r} is cooling down after failures (circuit open); "
            f"retry in {max(wait, 1):.0f} s or configure fallbacks",
            status=503,
            code="circuit_open",
            retry_after=max(wait, 1.0),
        )

    def _fallbacks(self, name: str) -> list[str]:
        own = [m for d in self.groups.get(name, []) for m in d.cfg.fallbacks]
        return list(dict.fromkeys(own or self.cfg.default_fallbacks))

    def _special_fallbacks(self, name: str, reason: str) -> list[str]:
        group = self.groups.get(name, [])
        if reason == "context_window":
            return list(dict.fromkeys(m for d in group for m in d.cfg.context_window_fallbacks))
        return list(dict.fromkeys(m for d in group for m in d.cfg.content_policy_fallbacks))

    def _check_window(self, name: str, group: list[Deployment], request: ChatRequest) -> None:
        """Skip a model whose context window the prompt clearly exceeds, when it has
        somewhere to go."""
        window = group[0].cfg.context_window
        if (
            window
            and self._special_fallbacks(name, "context_window")
            and _estimate_tokens(request) > window
        ):
            raise GatewayError(
                ErrorKind.INVALID_REQUEST,
                f"the prompt is longer than the context window of {name!r} ({window} tokens)",
                code="context_length_exceeded",
            )

    # ---- one attempt on one deployment -------------------------------------------------------

    async def _complete_on(
        self, dep: Deployment, request: ChatRequest, trace: RouteTrace
    ) -> ChatResponse:
        return await self._call_on(dep, request, trace, lambda d: d.provider.complete(request))

    async def _call_on(
        self,
        dep: Deployment,
        request: ChatRequest,
        trace: RouteTrace,
        send: Callable[[Deployment], Awaitable[T]],
        operation: str = "chat",
    ) -> T:
        """One attempt whose reply comes whole: a chat response, or an operation's (its
        usage in `trace`)."""
        t0 = time.perf_counter()
        span = _attempt_span(dep, request, trace, operation)
        await self._enter(dep)
        try:
            with telemetry.sending(span, trace.tracing):
                resp = await send(dep)
        except BaseException as e:
            failure = await self._attempt_failed(dep, e, trace, t0, span)
            if isinstance(failure, GatewayError):
                raise failure from None
            raise
        finally:
            await self._leave(dep)
        if isinstance(resp, ChatResponse):
            trace.usage = resp.usage
            telemetry.end_attempt(span, None, resp.usage, resp.model, resp.stop_reason)
        else:
            telemetry.end_attempt(span, None, trace.usage)
        await self._served(dep, trace, t0, time.perf_counter() - t0)
        return resp

    async def _open_on(
        self, dep: Deployment, request: ChatRequest, trace: RouteTrace
    ) -> AsyncIterator[Event]:
        t0 = time.perf_counter()
        span = _attempt_span(dep, request, trace)
        await self._enter(dep)
        events = dep.provider.stream(request)
        head: list[Event] = []
        try:
            # the upstream request goes out at the first event
            with telemetry.sending(span, trace.tracing):
                head = await self._first_token(dep, events)
        except BaseException as e:
            await self._closed(dep, events, shielded=False)
            failure = await self._attempt_failed(dep, e, trace, t0, span)
            if isinstance(failure, GatewayError):
                raise failure from None
            raise
        ttft = time.perf_counter() - t0
        trace.ttft_ms = ttft * 1000
        self.metrics.ttft.labels(dep.id).observe(ttft)
        await self._served(dep, trace, t0, ttft)
        return self._relay(dep, head, events, trace, span)

    async def _open_call_on(
        self,
        dep: Deployment,
        request: ChatRequest,
        trace: RouteTrace,
        open_: Callable[[Deployment], AsyncIterator[T]],
        operation: str,
    ) -> AsyncIterator[T]:
        t0 = time.perf_counter()
        span = _attempt_span(dep, request, trace, operation)
        await self._enter(dep)
        items = open_(dep)
        try:
            with telemetry.sending(span, trace.tracing):
                first = await anext(items, _NOTHING)
            if first is _NOTHING:
                raise GatewayError(
                    ErrorKind.UPSTREAM, f"deployment {dep.id} ended the stream before any data"
                )
        except BaseException as e:
            await self._closed(dep, items, shielded=False)
            failure = await self._attempt_failed(dep, e, trace, t0, span)
            if isinstance(failure, GatewayError):
                raise failure from None
            raise
        await self._served(dep, trace, t0, time.perf_counter() - t0)
        return self._relay_items(dep, first, items, trace, span)  # type: ignore[arg-type]

    async def _relay_items(
        self, dep: Deployment, first: T, items: AsyncIterator[T], trace: RouteTrace, span: object
    ) -> AsyncIterator[T]:
        """An operation's stream after its first item; a failure now is passive health evidence."""
        failure: BaseException | None = None
        try:
            yield first
            async for item in items:
                yield item
        except GatewayError as e:
            failure = await self._broke_off(dep, e, trace)
            raise failure from None
        except BaseException as e:  # the client went away (cancel / aclose)
            failure = e
            raise
        finally:
            await self._closed(dep, items)
            telemetry.end_attempt(span, failure, trace.usage)

    async def _first_token(self, dep: Deployment, events: AsyncIterator[Event]) -> list[Event]:
        """Events up to and including the first that carries content, within the TTFT timeout."""
        head: list[Event] = []
        timeout = self._ttft_timeout(dep)
        try:
            async with asyncio.timeout(timeout):
                async for ev in events:
                    if isinstance(ev, Error):
                        raise ev.error
                    head.append(ev)
                    if not isinstance(ev, Start):
                        return head
        except TimeoutError:
            raise GatewayError(
                ErrorKind.TIMEOUT,
                f"deployment {dep.id} sent no token within {timeout:g} s (ttft_timeout)",
                code="ttft_timeout",
            ) from None
        raise GatewayError(
            ErrorKind.UPSTREAM, f"deployment {dep.id} ended the stream before any token"
        )

    async def _relay(
        self,
        dep: Deployment,
        head: list[Event],
        events: AsyncIterator[Event],
        trace: RouteTrace,
        span: object = None,
    ) -> AsyncIterator[Event]:
        """The stream after its first token; a failure now is passive health
        evidence, not a retry."""
        usage = _StreamUsage(trace)
        finished = any(isinstance(ev, Finish) for ev in head)
        failure: BaseException | None = None
        try:
            for ev in head:
                usage.feed(ev)
                yield ev
            async for ev in events:
                if isinstance(ev, Error):
                    ev = Error(await self._broke_off(dep, ev.error, trace))
                    failure = ev.error
                finished = finished or isinstance(ev, Finish)
                usage.feed(ev)
                yield ev
            if not finished:  # a truncated upstream: never pass half an answer off as complete
                raise GatewayError(
                    ErrorKind.UPSTREAM, f"deployment {dep.id} ended the stream before it finished"
                )
        except GatewayError as e:
            failure = await self._broke_off(dep, e, trace)
            raise failure from None
        except BaseException as e:  # the client went away (cancel / aclose)
            failure = e
            raise
        finally:
            await self._closed(dep, events)
            if failure is not None:
                trace.error = (
                    failure.message if isinstance(failure, GatewayError) else "the client went away"
                )
            telemetry.end_attempt(span, failure, trace.usage, usage.model, usage.stop_reason)

    async def _attempt_failed(
        self, dep: Deployment, e: BaseException, trace: RouteTrace, t0: float, span: object
    ) -> BaseException:
        """Record an attempt that failed before its reply (or first item); what to raise."""
        if isinstance(e, GatewayError):
            e = self._sanitized(e)
            await self._failed(dep, e, trace, t0)
        telemetry.end_attempt(span, e)
        return e

    async def _broke_off(self, dep: Deployment, e: GatewayError, trace: RouteTrace) -> GatewayError:
        """A stream's failure after its first item: passive health evidence, not a retry."""
        e = self._sanitized(e)
        if counts_against_upstream(e):
            await self._midstream_failure(dep, e, trace)
        return e

    async def _closed(
        self, dep: Deployment, items: AsyncIterator[object], shielded: bool = True
    ) -> None:
        """Close a stream's upstream iterator and leave the deployment (shielded: even
        if cancelled)."""
        with suppress(Exception):
            await items.aclose()  # type: ignore[attr-defined]
        await (asyncio.shield(self._leave(dep)) if shielded else self._leave(dep))

    async def _midstream_failure(self, dep: Deployment, e: GatewayError, trace: RouteTrace) -> None:
        self.metrics.attempts.labels(dep.id, "midstream_error").inc()
        _log("midstream_error", trace, deployment=dep.id, status=e.status, error=e.message)
        if await self.breakers.failure(dep.id, e):
            self._opened(dep, e, trace)

    async def _enter(self, dep: Deployment) -> None:
        dep.in_flight += 1
        self.metrics.in_flight.labels(dep.id).set(dep.in_flight)
        await self.breakers.add_in_flight(dep.id, 1)

    async def _leave(self, dep: Deployment) -> None:
        dep.in_flight -= 1
        self.metrics.in_flight.labels(dep.id).set(dep.in_flight)
        await self.breakers.add_in_flight(dep.id, -1)

    async def _served(self, dep: Deployment, trace: RouteTrace, t0: float, latency: float) -> None:
        trace.attempts.append(Attempt(dep.id, "ok", (time.perf_counter() - t0) * 1000))
        trace.served_by = dep.id
        self.metrics.attempts.labels(dep.id, "ok").inc()
        dep.latency = latency if dep.latency is None else 0.8 * dep.latency + 0.2 * latency
        if await self.breakers.success(dep.id):
            self.metrics.breaker.labels(dep.id).set(BreakerState.CLOSED)
            _log("breaker_closed", trace, deployment=dep.id)

    async def _failed(self, dep: Deployment, e: GatewayError, trace: RouteTrace, t0: float) -> None:
        result = e.code if e.code == "ttft_timeout" else str(e.status)
        trace.attempts.append(Attempt(dep.id, result, (time.perf_counter() - t0) * 1000))
        self.metrics.attempts.labels(dep.id, result).inc()
        _log(
            "attempt_failed",
            trace,
            deployment=dep.id,
            status=e.status,
            error=e.message,
            retry_after=e.retry_after,
        )
        if counts_against_upstream(e) and await self.breakers.failure(dep.id, e):
            self._opened(dep, e, trace)

    def _opened(self, dep: Deployment, e: GatewayError, trace: RouteTrace) -> None:
        self.metrics.breaker.labels(dep.id).set(BreakerState.OPEN)
        self.metrics.breaker_opened.labels(dep.id).inc()
        _log(
            "breaker_opened",
            trace,
            deployment=dep.id,
            cooldown_s=self.breakers.cooldown(e),
            error=e.message,
        )

    # ---- state -------------------------------------------------------------------------------

    async def _snapshot(self, deps: list[Deployment]) -> list[Snapshot]:
        snaps = await self.breakers.snapshot([d.id for d in deps])
        for d, s in zip(deps, snaps):
            self.metrics.breaker.labels(d.id).set(s.state)
        return snaps

    def _sanitized(self, e: GatewayError) -> GatewayError:
        """`e` with every configured secret masked and its text bounded, whoever worded it.

        Providers word upstream failures themselves (providers/upstream.py); this is the one place
        every error passes before a client or a log sees it, whichever provider raised it.
        """
        message = excerpt(self.redact(e.message), self._max_error)
        if message == e.message:
            return e
        return GatewayError(
            e.kind, message, status=e.status, param=e.param, code=e.code, retry_after=e.retry_after
        )

    def _on_probe(self, dep: Deployment, health: Health) -> None:
        health.detail = excerpt(self.redact(health.detail), self._max_error)
        dep.health = health
        self.metrics.health.labels(dep.id).set(1 if health.ok else 0)

    async def _on_active_probe(self, dep: Deployment, health: Health) -> None:
        """A background probe's result; one that passes ends an open breaker's cooldown (a restarted
        upstream gets traffic back within a probe interval). A readiness call's probe
        only reports."""
        self._on_probe(dep, health)
        if health.ok and await self.breakers.probe_passed(dep.id):
            self.metrics.breaker.labels(dep.id).set(BreakerState.HALF_OPEN)
            _log("breaker_half_open", RouteTrace(), deployment=dep.id, reason="health probe passed")


def _candidates(
    group: list[Deployment], snaps: list[Snapshot], failed: dict[str, int], skip: set[str]
) -> list[tuple[Deployment, Snapshot]]:
    """What the balancer picks from, in config order: no open breaker, nothing ruled out, one not
    yet failed on this request first, one whose last active probe passed first."""
    usable = [
        (d, s)
        for d, s in zip(group, snaps)
        if s.state is not BreakerState.OPEN and d.id not in skip
    ]
    pool = [(d, s) for d, s in usable if d.id not in failed] or usable
    return [(d, s) for d, s in pool if d.health is None or d.health.ok] or pool


def _attempt_span(
    dep: Deployment, request: ChatRequest, trace: RouteTrace, operation: str = "chat"
) -> object:
    """The attempt's span under the request's, when the request is traced."""
    if trace.tracing is None or trace.span is None:
        return None
    return trace.tracing.attempt_span(
        trace.span, dep.id, dep.cfg, request, len(trace.attempts) + 1, operation
    )


class _StreamUsage:
    """What a stream's events say about it: the model that answered, why it stopped, and its usage
    (the Finish's totals, with the input count from the Start where the Finish lacks it)."""

    def __init__(self, trace: RouteTrace) -> None:
        self.trace, self.model, self.stop_reason = trace, None, None
        self.start = Usage()

    def feed(self, ev: Event) -> None:
        if isinstance(ev, Start):
            self.model, self.start = ev.model, ev.usage
        elif isinstance(ev, Finish):
            u = ev.usage
            if not u.input_tokens and self.start.input_tokens:
                u = Usage(
                    self.start.input_tokens,
                    u.output_tokens,
                    u.cache_read_input_tokens,
                    u.cache_creation_input_tokens,
                    u.reasoning_tokens,
                )
            self.trace.usage, self.stop_reason = u, str(ev.stop_reason)


def _fallback_reason(e: GatewayError) -> str | None:
    """Why a failed group may hand over to a fallback: "error", "context_window",
    "content_policy"."""
    text = f"{e.code or ''} {e.message}".lower()
    if e.status in (400, 413) and any(h in text for h in _CONTEXT_WINDOW_HINTS):
        return "context_window"
    if e.status == 400 and any(h in text for h in _CONTENT_POLICY_HINTS):
        return "content_policy"
    return "error" if counts_against_upstream(e) else None


def _estimate_tokens(request: ChatRequest) -> int:
    """A cheap upper-ish estimate (4 characters a token) to spot prompts far over a window."""
    chars = sum(len(t.text) for t in request.system)
    chars += sum(len(p.text) for m in request.messages for p in m.parts if isinstance(p, Text))
    return chars // 4


def _log(event: str, trace: RouteTrace, **fields: object) -> None:
    """One JSON line per routing event, carrying the request id."""
    if log.isEnabledFor(logging.INFO):
        log.info(orjson.dumps({"event": event, "request_id": trace.request_id, **fields}).decode())

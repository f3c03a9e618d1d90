"""The gateway's long-lived parts, built once at start-up and handed to every route.

Routes take a `Services` instead of looking their parts up on the app: what a handler uses is in
its signature, typed.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import FastAPI

from flashstack.gateway.auth import Auth
from flashstack.gateway.compress import Compressor
from flashstack.gateway.config import Config
from flashstack.gateway.requestlog import RequestLog
from flashstack.gateway.routing import Router
from flashstack.gateway.sessions.turns import Sessions, open_sessions
from flashstack.gateway.spend import SpendStore
from flashstack.gateway.telemetry import Tracing

if TYPE_CHECKING:
    from flashstack.gateway.tls import ServerTLS

log = logging.getLogger("flashstack.gateway")


@dataclass(slots=True)
class Services:
    """Routing, compression, sessions and keys, the request log, the server's TLS if any."""

    router: Router
    compressor: Compressor
    sessions: Sessions
    auth: Auth
    requests: RequestLog
    tls: ServerTLS | None = None  # readiness reports its certificate

    @classmethod
    async def start(
        cls,
        config: Config,
        router: Router | None = None,
        tracing: Tracing | None = None,
        tls: ServerTLS | None = None,
    ) -> Services:
        """Every part for `config`, started (`router`, `tracing`: given instead of built)."""
        router = router or Router(config.models, config.router, secrets=[config.auth.master_key])
        router.start()  # background health probes
        # Context compression. Its embedding model loads in a thread of its own, now with `preload`
        # (readiness is 503 until then), else once a request first needs it; no request waits.
        compressor = Compressor(config.compression, config.state_dir, router)
        if config.compression.preload:
            compressor.start_loading()
        # Sessions, API keys and rate limits: the database is migrated before the first request.
        sessions = await open_sessions(config)
        # The request log (a cost row per request, in the same database) and, when on, traces.
        requests = RequestLog.from_config(
            config,
            SpendStore(sessions.store.db),
            tracing or Tracing.from_config(config.telemetry, os.environ),
        )
        for name in requests.prices.unpriced:
            log.warning(
                "model %r has no price (spend.prices): its requests count as costing $0", name
            )
        return cls(router, compressor, sessions, sessions.auth, requests, tls)

    async def aclose(self) -> None:
        """Stop every part, the request log first (it flushes into the sessions' database)."""
        await self.requests.aclose()
        await self.sessions.aclose()
        await self.compressor.aclose()
        await self.router.aclose()


class ServicesApp(FastAPI):
    """A FastAPI app whose lifespan builds its `Services` before the first request."""

    services: Services

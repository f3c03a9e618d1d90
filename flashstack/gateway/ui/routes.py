"""The console's routes: its page and assets, sign-in, and the JSON each page shows.

Only the master key signs in: a normal key sees nothing here (it has the API for its own sessions
and `GET /v1/keys/{id}/spend`). Every /ui/api route but sign-in needs the console cookie, and every
change the CSRF token too (ui/session.py).
"""

from __future__ import annotations

import hmac
import statistics
import time
from datetime import timedelta
from importlib import resources
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from flashstack.gateway import chat
from flashstack.gateway.auth import UPDATABLE, KeyStore, check_key_fields
from flashstack.gateway.config import Config
from flashstack.gateway.core import ErrorKind, GatewayError, invalid_request
from flashstack.gateway.requestlog import RequestLog
from flashstack.gateway.routing import Router
from flashstack.gateway.services import ServicesApp
from flashstack.gateway.sessions.db import messages, sessions
from flashstack.gateway.sessions.store import message_json, session_json
from flashstack.gateway.spend import SpendStore, periods
from flashstack.gateway.ui.session import COOKIE, CSRF_HEADER, ConsoleSession, Signer

ASSETS = {"app.js": "text/javascript", "style.css": "text/css", "index.html": "text/html"}
# The page runs only its own script and style: an injected <script> or inline handler does nothing.
_PAGE_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; "
    "form-action 'self'",
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}


def _asset(name: str) -> bytes:
    return resources.files("flashstack.gateway.ui").joinpath("assets", name).read_bytes()


class Console:
    """What the console's routes share: the sign-in signer, and the gateway's services."""

    def __init__(self, config: Config) -> None:
        self.config = config
        master = config.auth.master_key
        self.signer = (
            Signer(master, config.ui.session_ttl) if master and config.ui.enabled else None
        )

    def session(self, request: Request, change: bool = False) -> ConsoleSession:
        """The signed-in console session (401), and for a change its CSRF token and origin (403)."""
        if self.signer is None:
            raise _off(self.config)
        session = self.signer.verify(request.cookies.get(COOKIE))
        if session is None:
            raise GatewayError(
                ErrorKind.AUTHENTICATION,
                "not signed in to the console: sign in with the master key",
            )
        if change:
            origin = request.headers.get("origin")
            if (
                origin is not None
                and origin != f"{request.url.scheme}://{request.headers.get('host', '')}"
            ):
                raise GatewayError(
                    ErrorKind.PERMISSION, f"cross-origin console request from {origin!r} refused"
                )
            if not Signer.csrf_ok(session, request.headers.get(CSRF_HEADER)):
                raise GatewayError(
                    ErrorKind.PERMISSION, f"missing or wrong {CSRF_HEADER}: reload the console"
                )
        return session

    def secure(self, request: Request) -> bool:
        on = self.config.ui.secure_cookie
        return request.url.scheme == "https" if on is None else on


def _off(config: Config) -> GatewayError:
    why = (
        "ui.enabled is false"
        if not config.ui.enabled
        else "auth is off: set auth.master_key (FLASHSTACK_AUTH__MASTER_KEY) to sign in to the "
        "console"
    )
    return GatewayError(ErrorKind.PERMISSION, f"the console is off: {why}", code="console_off")


def add_console_routes(app: ServicesApp, config: Config) -> None:
    """Mount /ui (the page) and /ui/api (its JSON) on `app`."""
    console = Console(config)

    @app.get("/ui")
    @app.get("/ui/")
    async def page() -> Response:
        return Response(
            _asset("index.html"), media_type="text/html; charset=utf-8", headers=_PAGE_HEADERS
        )

    @app.get("/ui/assets/{name}")
    async def asset(name: str) -> Response:
        if name not in ASSETS or name == "index.html":
            raise GatewayError(
                ErrorKind.NOT_FOUND, f"/ui/assets/{name} does not exist", code="not_found"
            )
        return Response(_asset(name), media_type=ASSETS[name], headers=_PAGE_HEADERS)

    @app.get("/ui/api/session")
    async def whoami(request: Request) -> Response:
        if console.signer is None:
            return chat.json_response(
                {"signed_in": False, "enabled": False, "reason": _off(config).message}
            )
        session = console.signer.verify(request.cookies.get(COOKIE))
        if session is None:
            return chat.json_response({"signed_in": False, "enabled": True})
        return chat.json_response(
            {
                "signed_in": True,
                "enabled": True,
                "csrf": session.csrf,
                "expires_at": session.expires,
            }
        )

    @app.post("/ui/api/login")
    async def login(request: Request) -> Response:
        if console.signer is None:
            raise _off(config)
        body = await chat.read_json(request, 4096)
        key = body.get("key") if isinstance(body, dict) else None
        if not isinstance(key, str) or not key:
            raise invalid_request('send {"key": "<the master key>"}', "key")
        if not hmac.compare_digest(key.encode(), config.auth.master_key.encode()):  # type: ignore[union-attr]
            if await app.services.auth.keys.find(key) is not None:
                raise GatewayError(
                    ErrorKind.PERMISSION,
                    "the console is the master key's; an API key sees "
                    "its own spend at GET /v1/keys/{id}/spend",
                )
            raise GatewayError(ErrorKind.AUTHENTICATION, "wrong master key", code="invalid_api_key")
        cookie, session = console.signer.issue()
        response = chat.json_response(
            {"signed_in": True, "csrf": session.csrf, "expires_at": session.expires}
        )
        response.set_cookie(
            COOKIE,
            cookie,
            max_age=int(config.ui.session_ttl),
            path="/ui",
            httponly=True,
            samesite="strict",
            secure=console.secure(request),
        )
        return response

    @app.post("/ui/api/logout")
    async def logout(request: Request) -> Response:
        console.session(request, change=True)
        response = chat.json_response({"signed_in": False})
        response.delete_cookie(
            COOKIE, path="/ui", httponly=True, samesite="strict", secure=console.secure(request)
        )
        return response

    @app.get("/ui/api/deployments")
    async def deployments(request: Request) -> Response:
        console.session(request)
        router: Router = app.services.router
        report = await router.readiness()
        stats = deployment_stats(app.services.requests.ring)
        for deps in report.values():
            for d in deps:
                d.update(stats.get(str(d["deployment"]), {}))
        return chat.json_response({"models": report, "window": len(app.services.requests.ring)})

    @app.get("/ui/api/requests")
    async def request_log(request: Request) -> Response:
        console.session(request)
        q = request.query_params
        log: RequestLog = app.services.requests
        raw = q.get("limit") or "100"
        limit = min(max(int(raw), 1), 1000) if raw.isdigit() else 100
        data = log.recent(
            limit,
            q.get("key") or None,
            q.get("model") or None,
            q.get("status") or None,
            q.get("q") or None,
        )
        return chat.json_response({"data": data})

    @app.get("/ui/api/requests/{record_id}")
    async def one_request(record_id: str, request: Request) -> Response:
        console.session(request)
        found = app.services.requests.get(record_id)
        if found is None:
            raise GatewayError(
                ErrorKind.NOT_FOUND,
                f"request {record_id!r} is not in this replica's log",
                code="not_found",
            )
        return chat.json_response(found)

    @app.get("/ui/api/sessions")
    async def session_list(request: Request) -> Response:
        console.session(request)
        db = app.services.sessions.store.db
        q = (
            sessions.select()
            .order_by(sessions.c.created_at.desc(), sessions.c.id.desc())
            .limit(100)
        )
        async with db.read() as conn:
            rows = (await conn.execute(q)).mappings().all()
        return chat.json_response(
            {"data": [{**session_json(r), "owner": r["owner"]} for r in rows]}
        )

    @app.get("/ui/api/sessions/{session_id}")
    async def session_messages(session_id: str, request: Request) -> Response:
        console.session(request)
        db = app.services.sessions.store.db
        async with db.read() as conn:
            row = (
                (await conn.execute(sessions.select().where(sessions.c.id == session_id)))
                .mappings()
                .first()
            )
            if row is None:
                raise GatewayError(
                    ErrorKind.NOT_FOUND, f"session {session_id!r} does not exist", code="not_found"
                )
            msgs = (
                (
                    await conn.execute(
                        messages.select()
                        .where(messages.c.session_id == session_id)
                        .order_by(messages.c.seq)
                        .limit(500)
                    )
                )
                .mappings()
                .all()
            )
        return chat.json_response(
            {
                **session_json(row),
                "owner": row["owner"],
                "messages": [message_json(m) for m in msgs],
            }
        )

    @app.get("/ui/api/keys")
    async def key_list(request: Request) -> Response:
        console.session(request)
        keys: KeyStore = app.services.auth.keys
        await app.services.requests.flush()
        spent = await SpendStore(keys.db).by_key(periods()["month"].start)
        data = [{**k, "spent_month_usd": spent.get(k["id"], 0.0)} for k in await keys.list()]
        return chat.json_response({"data": data})

    @app.post("/ui/api/keys")
    async def key_create(request: Request) -> Response:
        console.session(request, change=True)
        body = await chat.read_json(request, 64 * 1024)
        if not isinstance(body, dict):
            raise invalid_request(
                "send a JSON object: {name, models?, rpm?, tpm?, budget_day_usd?, "
                "budget_month_usd?}"
            )
        unknown = set(body) - {
            "name",
            "models",
            "rpm",
            "tpm",
            "budget_day_usd",
            "budget_month_usd",
            "expires_in",
        }
        if unknown:
            raise invalid_request(
                f"unknown fields: {', '.join(sorted(unknown))}", sorted(unknown)[0]
            )
        expires_in = body.get("expires_in")
        check_key_fields(
            body.get("name"), body.get("models"), body.get("rpm"), body.get("tpm"), None
        )
        if expires_in is not None and (not isinstance(expires_in, int | float) or expires_in <= 0):
            raise invalid_request("expires_in must be a positive number of seconds", "expires_in")
        keys: KeyStore = app.services.auth.keys
        created = await keys.create(
            body["name"],
            body.get("models"),
            body.get("rpm"),
            body.get("tpm"),
            time.time() + expires_in if expires_in else None,
            body.get("budget_day_usd"),
            body.get("budget_month_usd"),
        )
        return chat.json_response(created)

    @app.post("/ui/api/keys/{key_id}")
    async def key_update(key_id: str, request: Request) -> Response:
        console.session(request, change=True)
        body = await chat.read_json(request, 64 * 1024)
        if not isinstance(body, dict):
            raise invalid_request(f"send a JSON object with any of: {', '.join(UPDATABLE)}")
        return chat.json_response(await app.services.auth.keys.update(key_id, body))

    @app.delete("/ui/api/keys/{key_id}")
    async def key_revoke(key_id: str, request: Request) -> Response:
        console.session(request, change=True)
        return chat.json_response(await app.services.auth.keys.revoke(key_id))

    @app.get("/ui/api/spend")
    async def spend_over_time(request: Request) -> Response:
        console.session(request)
        days = request.query_params.get("days", "31")
        n = min(int(days), 366) if days.isdigit() and int(days) > 0 else 31
        await app.services.requests.flush()
        store = SpendStore(app.services.auth.keys.db)
        since = periods()["day"].start - timedelta(days=n - 1)
        return chat.json_response(
            {"days": n, "since": since.strftime("%Y-%m-%d"), "data": await store.daily(None, since)}
        )


def deployment_stats(records: Any) -> dict[str, dict[str, Any]]:
    """Per deployment, over the attempts in the request log: count, error rate, and p50/p99 of the
    response time (whole replies) and of the time to first token (streams)."""
    by_dep: dict[str, dict[str, list[float]]] = {}
    for rec in records:
        for a in rec.trace.attempts:
            s = by_dep.setdefault(a.deployment, {"ok": [], "failed": [], "latency": [], "ttft": []})
            if a.result == "ok":
                s["ok"].append(a.ms)
                s["ttft" if rec.stream else "latency"].append(a.ms)
            else:
                s["failed"].append(a.ms)
    out: dict[str, dict[str, Any]] = {}
    for dep, s in by_dep.items():
        n = len(s["ok"]) + len(s["failed"])
        out[dep] = {
            "attempts": n,
            "error_rate": round(len(s["failed"]) / n, 4) if n else 0.0,
            "latency_p50_ms": _pct(s["latency"], 50),
            "latency_p99_ms": _pct(s["latency"], 99),
            "ttft_p50_ms": _pct(s["ttft"], 50),
            "ttft_p99_ms": _pct(s["ttft"], 99),
        }
    return out


def _pct(values: list[float], p: int) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return round(values[0], 2)
    return round(statistics.quantiles(values, n=100, method="inclusive")[p - 1], 2)

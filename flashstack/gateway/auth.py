"""API keys and rate limits: who is calling, what they may call, and how often.

Off unless `auth.master_key` is set. Keys are shown once and stored as SHA-256 hashes: they are 256
random bits, so a fast hash is enough (a slow KDF protects guessable passwords, not these).
Limits are sliding 60-second windows, kept in this process or, with `auth.redis_url`, in Redis
by one Lua script per admission, so N replicas together admit exactly the limit.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import math
import secrets
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from flashstack.config import AuthConfig
from flashstack.gateway.core import ErrorKind, GatewayError, Usage, invalid_request
from flashstack.gateway.sessions.db import Database, api_keys

WINDOW = 60.0  # seconds: limits are per minute
KEY_PREFIX = "fsk_"
MASTER = "master"  # the owner name of what the master key creates


@dataclass(frozen=True, slots=True)
class Caller:
    """An authenticated caller; `owner` scopes sessions, `key_id` scopes limits."""

    owner: str
    key_id: str | None = None
    admin: bool = False
    models: tuple[str, ...] | None = None  # None: every model
    rpm: int | None = None
    tpm: int | None = None


ANONYMOUS = Caller(owner="")  # auth off: one shared owner, no limits


# ---- limiters -------------------------------------------------------------------------------


class Limiter(Protocol):
    async def admit(self, key_id: str, rpm: int | None, tpm: int | None) -> float | None:
        """Count one request if allowed; otherwise the seconds until it would be."""

    async def charge(self, key_id: str, tokens: int) -> None:
        """Add the tokens a finished request used to the key's window."""

    async def aclose(self) -> None: ...


class LocalLimiter:
    """Sliding windows in this process (a single gateway, or per-replica limits)."""

    def __init__(self, window: float = WINDOW) -> None:
        self.window = window
        self._requests: dict[str, deque[float]] = {}
        self._tokens: dict[str, deque[tuple[float, int]]] = {}

    async def admit(self, key_id: str, rpm: int | None, tpm: int | None) -> float | None:
        now = time.monotonic()
        start = now - self.window
        requests = _trimmed(self._requests.setdefault(key_id, deque()), start)
        tokens = _trimmed(self._tokens.setdefault(key_id, deque()), start)
        if rpm is not None and len(requests) >= rpm:
            return requests[0] + self.window - now
        if tpm is not None:
            wait = _token_wait(list(tokens), tpm, now, self.window)
            if wait is not None:
                return wait
        requests.append(now)
        return None

    async def charge(self, key_id: str, tokens: int) -> None:
        if tokens > 0:
            self._tokens.setdefault(key_id, deque()).append((time.monotonic(), tokens))

    async def aclose(self) -> None:
        pass


def _trimmed(window: deque[Any], start: float) -> deque[Any]:
    """Drop entries at or before `start`; entries are times or (time, tokens) pairs."""
    while window and _time_of(window[0]) <= start:
        window.popleft()
    return window


def _time_of(entry: float | tuple[float, int]) -> float:
    return entry[0] if isinstance(entry, tuple) else entry


def _token_wait(entries: list[tuple[float, int]], tpm: int, now: float, window: float) -> float | None:
    """None while the window holds fewer than `tpm` tokens, else seconds until enough expire."""
    used = sum(n for _, n in entries)
    if used < tpm:
        return None
    for at, n in entries:  # oldest first: the first to leave the window
        used -= n
        if used < tpm:
            return max(at + window - now, 0.001)
    return window


# KEYS: requests zset, tokens zset. ARGV: rpm (0 = none), tpm (0 = none), window ms, member.
# Redis' own clock, so replicas with skewed clocks still share one window.
_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rpm, tpm, window = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - window)
if rpm > 0 and redis.call('ZCARD', KEYS[1]) >= rpm then
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return tostring(tonumber(oldest[2]) + window - now)
end
if tpm > 0 then
  local entries = redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')
  local used = 0
  for i = 1, #entries, 2 do used = used + tonumber(string.match(entries[i], ':(%d+)$')) end
  if used >= tpm then
    for i = 1, #entries, 2 do
      used = used - tonumber(string.match(entries[i], ':(%d+)$'))
      if used < tpm then return tostring(tonumber(entries[i + 1]) + window - now) end
    end
  end
end
redis.call('ZADD', KEYS[1], now, ARGV[4])
redis.call('PEXPIRE', KEYS[1], window)
return false
"""

_CHARGE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
return 1
"""


class RedisLimiter:
    """Sliding windows in Redis, checked and counted atomically by one script per request."""

    def __init__(self, url: str, prefix: str, window: float = WINDOW) -> None:
        import redis.asyncio as redis

        self.redis = redis.from_url(url)
        self.prefix = prefix
        self.window_ms = int(window * 1000)
        self._admit = self.redis.register_script(_ADMIT)
        self._charge = self.redis.register_script(_CHARGE)

    def _keys(self, key_id: str) -> list[str]:
        return [f"{self.prefix}{key_id}:req", f"{self.prefix}{key_id}:tok"]

    async def admit(self, key_id: str, rpm: int | None, tpm: int | None) -> float | None:
        args = [rpm or 0, tpm or 0, self.window_ms, uuid.uuid4().hex]
        wait = await self._admit(keys=self._keys(key_id), args=args)
        return None if wait is None else max(float(wait) / 1000, 0.001)

    async def charge(self, key_id: str, tokens: int) -> None:
        if tokens > 0:
            member = f"{uuid.uuid4().hex}:{tokens}"
            await self._charge(keys=self._keys(key_id)[1:], args=[member, self.window_ms])

    async def aclose(self) -> None:
        await self.redis.aclose()


# ---- keys -----------------------------------------------------------------------------------


def hash_key(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def key_json(row: Any) -> dict[str, Any]:
    """A key as listed: never its secret, only the first characters to recognise it by."""
    return {
        "id": row["id"],
        "object": "api_key",
        "name": row["name"],
        "prefix": row["prefix"],
        "models": orjson.loads(row["models"]) if row["models"] else None,
        "rpm": row["rpm"],
        "tpm": row["tpm"],
        "expires_at": _int_or_none(row["expires_at"]),
        "created_at": int(row["created_at"]),
        "revoked_at": _int_or_none(row["revoked_at"]),
    }


def _int_or_none(v: float | None) -> int | None:
    return None if v is None else int(v)


class KeyStore:
    """API keys in the database (used by the gateway and by `flashstack keys`)."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def create(
        self,
        name: str,
        models: list[str] | None = None,
        rpm: int | None = None,
        tpm: int | None = None,
        expires_at: float | None = None,
    ) -> dict[str, Any]:
        """A new key; the returned `key` field is the only time the secret is ever shown."""
        check_key_fields(name, models, rpm, tpm, expires_at)
        secret = KEY_PREFIX + secrets.token_urlsafe(32)
        row = {
            "id": "key_" + uuid.uuid4().hex[:16], "name": name, "key_hash": hash_key(secret),
            "prefix": secret[:10], "models": orjson.dumps(models).decode() if models is not None else None,
            "rpm": rpm, "tpm": tpm, "expires_at": expires_at, "created_at": time.time(), "revoked_at": None,
        }
        async with self.db.write() as conn:
            await conn.execute(api_keys.insert().values(**row))
        return {**key_json(row), "key": secret}

    async def list(self) -> list[dict[str, Any]]:
        async with self.db.read() as conn:
            rows = (await conn.execute(api_keys.select().order_by(api_keys.c.created_at))).mappings().all()
        return [key_json(r) for r in rows]

    async def revoke(self, key_id: str) -> dict[str, Any]:
        async with self.db.write() as conn:
            await conn.execute(
                api_keys.update().where(api_keys.c.id == key_id, api_keys.c.revoked_at.is_(None))
                .values(revoked_at=time.time())
            )
            row = (await conn.execute(api_keys.select().where(api_keys.c.id == key_id))).mappings().first()
        if row is None:
            raise GatewayError(ErrorKind.NOT_FOUND, f"API key {key_id!r} does not exist", param="key_id")
        return key_json(row)

    async def get(self, key_id: str) -> Any:
        async with self.db.read() as conn:
            return (await conn.execute(api_keys.select().where(api_keys.c.id == key_id))).mappings().first()

    async def find(self, secret: str) -> Any:
        async with self.db.read() as conn:
            return (await conn.execute(
                api_keys.select().where(api_keys.c.key_hash == hash_key(secret))
            )).mappings().first()


def check_key_fields(
    name: Any, models: Any, rpm: Any, tpm: Any, expires_at: Any
) -> None:
    if not isinstance(name, str) or not 1 <= len(name) <= 200:
        raise invalid_request("name must be a string of 1 to 200 characters", "name")
    if models is not None and not (isinstance(models, list) and all(isinstance(m, str) for m in models)):
        raise invalid_request("models must be a list of model names (or null for every model)", "models")
    for field, v in (("rpm", rpm), ("tpm", tpm)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise invalid_request(f"{field} must be a positive integer (or null for no limit)", field)
    if expires_at is not None and (isinstance(expires_at, bool) or not isinstance(expires_at, int | float)):
        raise invalid_request("expires_at must be a unix time in seconds", "expires_at")


# ---- the gate -------------------------------------------------------------------------------


class Auth:
    """Authenticates requests and enforces each key's models and limits."""

    def __init__(self, config: AuthConfig, keys: KeyStore, limiter: Limiter) -> None:
        self.master_key = config.master_key
        self.client_cert_keys = dict(config.client_cert_keys)
        self.keys = keys
        self.limiter = limiter

    @classmethod
    def from_config(cls, config: AuthConfig, db: Database) -> Auth:
        limiter: Limiter = (
            RedisLimiter(config.redis_url, config.redis_prefix) if config.redis_url else LocalLimiter()
        )
        return cls(config, KeyStore(db), limiter)

    @property
    def enabled(self) -> bool:
        return bool(self.master_key)

    async def authenticate(self, headers: Any, identity: Any = None) -> Caller:
        """The caller behind `Authorization: Bearer …` or `x-api-key`, or else behind the verified
        mTLS client certificate `identity` when `auth.client_cert_keys` maps one of its names to a
        key (401 if none is valid)."""
        if not self.enabled:
            return ANONYMOUS
        secret = bearer(headers)
        if not secret:
            key_id = self._key_for_certificate(identity)
            if key_id is None:
                raise _unauthenticated("no API key: send Authorization: Bearer <key> or x-api-key: <key>")
            row = await self.keys.get(key_id)
            if row is None:
                raise _unauthenticated(f"client certificate maps to API key {key_id!r}, which does not exist")
            return _caller_of(row)
        if hmac.compare_digest(secret.encode(), self.master_key.encode()):  # type: ignore[union-attr]
            return Caller(owner=MASTER, admin=True)
        row = await self.keys.find(secret)
        if row is None:
            raise _unauthenticated("invalid API key; create one with `flashstack keys create`")
        return _caller_of(row)

    def _key_for_certificate(self, identity: Any) -> str | None:
        """The key id the first matching `client_cert_keys` glob gives one of the certificate's names."""
        if identity is None:
            return None
        for pattern, key_id in self.client_cert_keys.items():
            if any(fnmatch.fnmatchcase(name, pattern) for name in identity.names):
                return key_id
        return None

    async def admit(self, caller: Caller, model: str) -> None:
        """403 if the key may not use `model`, 429 (with retry-after) if it is over a limit."""
        if caller.models is not None and model not in caller.models:
            raise GatewayError(
                ErrorKind.PERMISSION,
                f"API key {caller.key_id} may not use model {model!r}; allowed: {', '.join(caller.models) or 'none'}",
                param="model",
            )
        if caller.key_id is None or (caller.rpm is None and caller.tpm is None):
            return
        wait = await self.limiter.admit(caller.key_id, caller.rpm, caller.tpm)
        if wait is not None:
            raise GatewayError(
                ErrorKind.RATE_LIMIT,
                f"API key {caller.key_id} is over its limit ({_limits(caller)}); retry in {math.ceil(wait)} s",
                retry_after=math.ceil(wait),
            )

    async def charge(self, caller: Caller, usage: Usage) -> None:
        if caller.key_id is not None and caller.tpm is not None:
            await self.limiter.charge(caller.key_id, usage.input_tokens + usage.output_tokens)

    def require_admin(self, caller: Caller) -> None:
        if not self.enabled:
            raise GatewayError(
                ErrorKind.PERMISSION,
                "key management is off: set auth.master_key (FLASHSTACK_AUTH__MASTER_KEY) to enable it",
            )
        if not caller.admin:
            raise GatewayError(ErrorKind.PERMISSION, "only the master key may manage API keys")

    async def aclose(self) -> None:
        await self.limiter.aclose()


def _caller_of(row: Any) -> Caller:
    """The caller a stored key stands for (401 if it was revoked or has expired)."""
    if row["revoked_at"] is not None:
        raise _unauthenticated(f"API key {row['id']} was revoked; ask an admin for a new one")
    if row["expires_at"] is not None and row["expires_at"] <= time.time():
        raise _unauthenticated(f"API key {row['id']} has expired; ask an admin for a new one")
    models = tuple(orjson.loads(row["models"])) if row["models"] else None
    return Caller(owner=row["id"], key_id=row["id"], models=models, rpm=row["rpm"], tpm=row["tpm"])


def bearer(headers: Any) -> str | None:
    value = headers.get("authorization")
    if value and value[:7].lower() == "bearer ":
        return value[7:].strip()
    return headers.get("x-api-key")


def _unauthenticated(message: str) -> GatewayError:
    return GatewayError(ErrorKind.AUTHENTICATION, message, code="invalid_api_key")


def _limits(caller: Caller) -> str:
    parts = [f"{caller.rpm} requests/min" if caller.rpm else "", f"{caller.tpm} tokens/min" if caller.tpm else ""]
    return ", ".join(p for p in parts if p)


# ---- `flashstack keys` ----------------------------------------------------------------------


async def keys_command(config: Any, args: Any) -> list[str]:
    """Run one `flashstack keys` action on the configured database; returns JSON lines to print."""
    from flashstack.gateway.sessions.db import Database

    db = await Database.from_config(config).open()
    keys = KeyStore(db)
    try:
        if args.action == "create":
            models = [m.strip() for m in args.models.split(",") if m.strip()] if args.models else None
            expires = time.time() + parse_duration(args.expires_in) if args.expires_in else None
            return [orjson.dumps(await keys.create(args.name, models, args.rpm, args.tpm, expires)).decode()]
        if args.action == "list":
            return [orjson.dumps(k).decode() for k in await keys.list()]
        return [orjson.dumps(await keys.revoke(args.key_id)).decode()]
    except GatewayError as e:
        from flashstack.config import ConfigError

        raise ConfigError(e.message) from None
    finally:
        await db.close()


def parse_duration(text: str) -> float:
    """Seconds in "3600", "90m", "12h" or "30d"."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    number, unit = (text[:-1], text[-1]) if text[-1:] in units else (text, "s")
    try:
        seconds = float(number) * units[unit]
    except ValueError:
        raise invalid_request(f"--expires-in {text!r}: use seconds or a number with s, m, h or d") from None
    if seconds <= 0:
        raise invalid_request(f"--expires-in {text!r} must be positive")
    return seconds

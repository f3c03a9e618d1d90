"""API keys and rate limits: who is calling, what they may call, and how often.

Off unless `auth.master_key` is set. Keys are shown once and stored as SHA-256 hashes: they are 256
random bits, so a fast hash is enough (a slow KDF protects guessable passwords, not these).
Limits are sliding 60-second windows, kept in this process or, with `auth.redis_url`, in Redis
by one Lua script per admission, so N replicas together admit exactly the limit. Tokens are held
at admission (an estimate from the request) and settled with the real usage when it ends.
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
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from flashstack.gateway import tokens
from flashstack.gateway.config import AuthConfig
from flashstack.gateway.core import ChatRequest, ErrorKind, GatewayError, Usage, invalid_request
from flashstack.gateway.sessions.db import Database, api_keys
from flashstack.gateway.spend import NANO, Budget, BudgetHold, Budgets

WINDOW = 60.0  # seconds: limits are per minute
# A hold outlives any request (a replica that died mid-request leaves its holds; they expire then).
HOLD_TTL = 900.0
# The retry-after when only requests in flight stand in the way: their end is unknown, and soon.
HOLD_RETRY = 1.0
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
    budget: Budget | None = None  # USD per UTC day / month (spend.py)


ANONYMOUS = Caller(owner="")  # auth off: one shared owner, no limits


# ---- limiters -------------------------------------------------------------------------------
#
# A key's tokens-per-minute budget is spent twice over: by what finished requests used in the last
# minute (the window), and by what requests still in flight may yet use (their holds). A request is
# admitted only if its own hold fits beside both, so N concurrent requests can never together
# promise more than the budget; when it ends, its hold is replaced by what it really used.


@dataclass(frozen=True, slots=True)
class Hold:
    """Tokens a request in flight holds against its key's tpm, until it settles."""

    id: str
    tokens: int

    @property
    def member(self) -> str:
        return f"{self.id}:{self.tokens}"


class Limiter(Protocol):
    async def admit(
        self, key_id: str, rpm: int | None, tpm: int | None, hold: Hold | None = None
    ) -> float | None:
        """Count one request and take `hold` if the key's limits allow both; otherwise the seconds
        until they would (nothing is counted then)."""

    async def settle(self, key_id: str, hold: Hold, used: int) -> None:
        """Release `hold` and count the `used` tokens in the key's window from now."""

    async def aclose(self) -> None: ...


class LocalLimiter:
    """Sliding windows and holds in this process (a single gateway, or per-replica limits).

    Each key keeps running totals beside its entries, so an admission costs O(1) amortized however
    busy the key: entries are added once and trimmed once.
    """

    def __init__(self, window: float = WINDOW, hold_ttl: float = HOLD_TTL) -> None:
        self.window = window
        self.hold_ttl = hold_ttl
        self._keys: dict[str, _KeyWindow] = {}

    async def admit(
        self, key_id: str, rpm: int | None, tpm: int | None, hold: Hold | None = None
    ) -> float | None:
        # No await in here: the check and the count are one step for every other task of this loop.
        now = time.monotonic()
        w = self._keys.setdefault(key_id, _KeyWindow())
        w.trim(now - self.window, now)
        if rpm is not None and len(w.requests) >= rpm:
            return w.requests[0] + self.window - now
        need = hold.tokens if hold is not None else 0
        if tpm is not None:
            wait = token_wait(w.tokens, w.used, w.held, need, tpm, now, self.window)
            if wait is not None:
                return wait
        w.requests.append(now)
        if hold is not None and need > 0:
            w.holds[hold.id] = (now + self.hold_ttl, need)
            w.held += need
        return None

    async def settle(self, key_id: str, hold: Hold, used: int) -> None:
        w = self._keys.setdefault(key_id, _KeyWindow())
        _, held = w.holds.pop(hold.id, (0.0, 0))
        w.held -= held
        if used > 0:
            w.tokens.append((time.monotonic(), used))
            w.used += used

    def state(self, key_id: str) -> tuple[int, int]:
        """(tokens held by requests in flight, tokens used in the window) of a key."""
        w = self._keys.get(key_id, _KeyWindow())
        now = time.monotonic()
        w.trim(now - self.window, now)
        return w.held, w.used

    async def aclose(self) -> None:
        pass


@dataclass(slots=True)
class _KeyWindow:
    requests: deque[float] = field(default_factory=deque)  # admission times
    tokens: deque[tuple[float, int]] = field(default_factory=deque)  # (settle time, tokens used)
    used: int = 0  # the sum of `tokens`
    holds: dict[str, tuple[float, int]] = field(default_factory=dict)  # hold id → (expires, tokens)
    held: int = 0  # the sum of `holds`

    def trim(self, start: float, now: float) -> None:
        """Drop what left the window at `start`, and holds past their expiry (a
        leak's safety net)."""
        while self.requests and self.requests[0] <= start:
            self.requests.popleft()
        while self.tokens and self.tokens[0][0] <= start:
            self.used -= self.tokens.popleft()[1]
        if self.holds and min(until for until, _ in self.holds.values()) <= now:
            for hold_id in [h for h, (until, _) in self.holds.items() if until <= now]:
                self.held -= self.holds.pop(hold_id)[1]


def token_wait(
    entries: Iterable[tuple[float, int]],
    used: int,
    held: int,
    need: int,
    tpm: int,
    now: float,
    window: float,
) -> float | None:
    """None if `need` more tokens fit within `tpm` beside the `used` tokens of the window's
    `entries` (oldest first) and the `held` ones, else the seconds until enough entries leave the
    window (HOLD_RETRY when only requests in flight, whose end no clock can tell, stand in the way).
    The Lua script below is the same rule."""
    over = used + held + need - tpm
    if over <= 0:
        return None
    if held + need > tpm:
        return HOLD_RETRY
    for at, n in entries:  # oldest first: the first to leave the window
        over -= n
        if over <= 0:
            return max(at + window - now, 0.001)
    return window


# Per key, under one hash tag: `req` (zset, admission times), `tok` (zset, settle times; member
# id:tokens), `hold` (zset, expiry times; member id:tokens) and `sum` (hash: `tok` and `hold`, the
# running totals, so an admission never sums the window). All four share one expiry; a set that
# vanished (evicted) zeroes its total, a total that vanished is recounted once.
_LUA_HELPERS = """
local function tokens_of(m) return tonumber(string.match(m, ':(%d+)$')) end
local function total(zkey, field)
  if redis.call('EXISTS', zkey) == 0 then redis.call('HSET', KEYS[4], field, 0) return 0 end
  local v = redis.call('HGET', KEYS[4], field)
  if v then return tonumber(v) end
  local n = 0
  for _, m in ipairs(redis.call('ZRANGE', zkey, 0, -1)) do n = n + tokens_of(m) end
  redis.call('HSET', KEYS[4], field, n)
  return n
end
local function drain(zkey, field, upto, n)
  local gone = redis.call('ZRANGEBYSCORE', zkey, '-inf', upto)
  for _, m in ipairs(gone) do n = n - tokens_of(m) end
  if #gone > 0 then
    redis.call('ZREMRANGEBYSCORE', zkey, '-inf', upto)
    redis.call('HSET', KEYS[4], field, n)
  end
  return n
end
local function touch(ttl)
  for i = 1, 4 do redis.call('PEXPIRE', KEYS[i], ttl) end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: req, tok, hold, sum. ARGV: rpm (0 = none), tpm (0 = none), window ms, request member, hold
# member ('' = none), hold tokens, hold ttl ms, HOLD_RETRY ms, key ttl ms. Redis' own clock, so
# replicas with skewed clocks still share one window; one script, so the check and the count are one
# step.
_ADMIT = (
    _LUA_HELPERS
    + """
local rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2])
local window, need = tonumber(ARGV[3]), tonumber(ARGV[6])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
if rpm > 0 and redis.call('ZCARD', KEYS[1]) >= rpm then
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return tostring(tonumber(oldest[2]) + window - now)
end
local held = drain(KEYS[3], 'hold', now, total(KEYS[3], 'hold'))
if tpm > 0 then
  local used = drain(KEYS[2], 'tok', now - window, total(KEYS[2], 'tok'))
  local over = used + held + need - tpm
  if over > 0 then
    if held + need > tpm then return ARGV[8] end
    local start = 0
    while true do  -- oldest first, a page at a time: most refusals need only the first few
      local page = redis.call('ZRANGE', KEYS[2], start, start + 63, 'WITHSCORES')
      if #page == 0 then return tostring(window) end
      for i = 1, #page, 2 do
        over = over - tokens_of(page[i])
        if over <= 0 then return tostring(tonumber(page[i + 1]) + window - now) end
      end
      start = start + 64
    end
  end
end
redis.call('ZADD', KEYS[1], now, ARGV[4])
if ARGV[5] ~= '' and need > 0 then
  redis.call('ZADD', KEYS[3], now + tonumber(ARGV[7]), ARGV[5])
  redis.call('HSET', KEYS[4], 'hold', held + need)
end
touch(tonumber(ARGV[9]))
return false
"""
)

# KEYS: req, tok, hold, sum. ARGV: hold member, used member ('' = none), key ttl ms.
_SETTLE = (
    _LUA_HELPERS
    + """
local held = total(KEYS[3], 'hold')
if redis.call('ZREM', KEYS[3], ARGV[1]) == 1 then
  redis.call('HSET', KEYS[4], 'hold', held - tokens_of(ARGV[1]))
end
if ARGV[2] ~= '' then
  local used = total(KEYS[2], 'tok')
  redis.call('ZADD', KEYS[2], now, ARGV[2])
  redis.call('HSET', KEYS[4], 'tok', used + tokens_of(ARGV[2]))
end
touch(tonumber(ARGV[3]))
return 1
"""
)


class RedisLimiter:
    """Sliding windows and holds in Redis, checked and counted atomically by one
    script per request."""

    def __init__(
        self, url: str, prefix: str, window: float = WINDOW, hold_ttl: float = HOLD_TTL
    ) -> None:
        import redis.asyncio as redis

        self.redis = redis.from_url(url)
        self.prefix = prefix
        self.window_ms = int(window * 1000)
        self.hold_ttl_ms = int(hold_ttl * 1000)
        self.key_ttl_ms = max(self.window_ms, self.hold_ttl_ms)
        self._admit = self.redis.register_script(_ADMIT)
        self._settle = self.redis.register_script(_SETTLE)

    def _keys(self, key_id: str) -> list[str]:
        base = f"{self.prefix}{{{key_id}}}"  # hash tag: one key's sets share a cluster slot
        return [f"{base}:req", f"{base}:tok", f"{base}:hold", f"{base}:sum"]

    async def admit(
        self, key_id: str, rpm: int | None, tpm: int | None, hold: Hold | None = None
    ) -> float | None:
        member, need = (hold.member, hold.tokens) if hold is not None else ("", 0)
        args = [
            rpm or 0,
            tpm or 0,
            self.window_ms,
            uuid.uuid4().hex,
            member,
            need,
            self.hold_ttl_ms,
            int(HOLD_RETRY * 1000),
            self.key_ttl_ms,
        ]
        wait = await self._admit(keys=self._keys(key_id), args=args)
        return None if wait is None else max(float(wait) / 1000, 0.001)

    async def settle(self, key_id: str, hold: Hold, used: int) -> None:
        used_member = f"{uuid.uuid4().hex}:{used}" if used > 0 else ""
        await self._settle(
            keys=self._keys(key_id), args=[hold.member, used_member, self.key_ttl_ms]
        )

    async def aclose(self) -> None:
        await self.redis.aclose()


# ---- what a request may cost ----------------------------------------------------------------


def request_tokens(req: ChatRequest, output_reserve: int) -> tuple[int, int]:
    """(prompt, prompt + output): the tokens `req` is expected to cost, estimated from its bytes
    (no tokenizer is loaded on this path) and its max_tokens, or `output_reserve` without one."""
    n_bytes = len(tokens.fixed_text(req).encode()) + sum(
        len(tokens.message_text(m).encode()) for m in req.messages
    )
    images = sum(tokens.image_count(m) for m in req.messages)
    prompt = (
        math.ceil(n_bytes / tokens.BYTES_PER_TOKEN)
        + tokens.PER_IMAGE * images
        + tokens.PER_MESSAGE * len(req.messages)
        + tokens.PER_REQUEST
    )
    return prompt, prompt + (req.max_tokens or output_reserve)


@dataclass(eq=False)
class Reservation:
    """One admitted request's holds on its key's tpm and budgets; each settles exactly once, however
    the request ends."""

    limiter: Limiter | None = None
    key_id: str = ""
    hold: Hold | None = None
    prompt_tokens: int = 0
    settled: bool = False
    budget: BudgetHold | None = None
    served_by: str | None = None  # the deployment that served it (what its cost is priced by)

    @property
    def metered(self) -> bool:
        """True when the request's end must be reported here (it holds tokens or money)."""
        return self.hold is not None or self.budget is not None

    async def settle(self, used: int) -> None:
        """Replace the hold by the tokens the request really used (0 when it failed
        before any output)."""
        if self.settled or self.hold is None or self.limiter is None:
            return
        self.settled = True
        await self.limiter.settle(self.key_id, self.hold, max(used, 0))

    async def finish(self, usage: Usage, output_bytes: int) -> None:
        """Settle a request that ended with its usage; an upstream that reported none is charged
        the estimate of what it produced, not nothing."""
        used = usage.input_tokens + usage.output_tokens
        await self.settle(
            used or self.prompt_tokens + math.ceil(output_bytes / tokens.BYTES_PER_TOKEN)
        )
        if self.budget is not None:
            await self.budget.settle(self._cost(usage, output_bytes))

    def _cost(self, usage: Usage, output_bytes: int) -> float:
        """USD of the request: its usage at the serving deployment's price, or, without usage, the
        estimate of what it produced."""
        b = self.budget
        price = b.budgets.prices.of_deployment(self.served_by, b.model)  # type: ignore[union-attr]
        reported = usage.input_tokens + usage.output_tokens + usage.cache_read_input_tokens
        if reported + usage.cache_creation_input_tokens:
            return price.cost(usage)
        return price.cost(
            Usage(self.prompt_tokens, math.ceil(output_bytes / tokens.BYTES_PER_TOKEN))
        )

    async def abandon(self, output_bytes: int) -> None:
        """Settle a request that ended without its usage: nothing if no output had gone out yet;
        after output began (a stream the client cancelled, or the upstream cut off), the whole hold,
        or what was produced if that is more — the upstream bills what it generated, seen or not."""
        if self.budget is not None:  # after output began: the most it could have cost
            await self.budget.settle(self.budget.need / NANO if output_bytes > 0 else 0.0)
        if self.hold is None:
            return
        produced = self.prompt_tokens + math.ceil(output_bytes / tokens.BYTES_PER_TOKEN)
        await self.settle(max(self.hold.tokens, produced) if output_bytes > 0 else 0)


UNLIMITED = Reservation()  # no tpm and no budget: nothing to hold or settle


def budget_bounds(req: ChatRequest, output_reserve: int) -> tuple[int, int]:
    """(prompt, output) tokens no upstream can exceed for `req`: every token is at least one byte of
    its text (images and framing counted as for tpm); the output is max_tokens, or `output_reserve`
    without one (then a bound only by convention: such a request may cost more than it held)."""
    n_bytes = len(tokens.fixed_text(req).encode()) + sum(
        len(tokens.message_text(m).encode()) for m in req.messages
    )
    images = sum(tokens.image_count(m) for m in req.messages)
    prompt = (
        n_bytes
        + tokens.PER_IMAGE * images
        + tokens.PER_MESSAGE * len(req.messages)
        + tokens.PER_REQUEST
    )
    return prompt, req.max_tokens or output_reserve


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
        "budget_day_usd": row.get("budget_day_usd"),
        "budget_month_usd": row.get("budget_month_usd"),
    }


# What POST /v1/keys/{id} may change (a key's id, secret and creation time never change).
UPDATABLE = ("name", "models", "rpm", "tpm", "expires_at", "budget_day_usd", "budget_month_usd")


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
        budget_day_usd: float | None = None,
        budget_month_usd: float | None = None,
    ) -> dict[str, Any]:
        """A new key; the returned `key` field is the only time the secret is ever shown."""
        check_key_fields(name, models, rpm, tpm, expires_at)
        check_budgets(budget_day_usd, budget_month_usd)
        secret = KEY_PREFIX + secrets.token_urlsafe(32)
        row = {
            "id": "key_" + uuid.uuid4().hex[:16],
            "name": name,
            "key_hash": hash_key(secret),
            "prefix": secret[:10],
            "models": orjson.dumps(models).decode() if models is not None else None,
            "rpm": rpm,
            "tpm": tpm,
            "expires_at": expires_at,
            "created_at": time.time(),
            "revoked_at": None,
            "budget_day_usd": budget_day_usd,
            "budget_month_usd": budget_month_usd,
        }
        async with self.db.write() as conn:
            await conn.execute(api_keys.insert().values(**row))
        return {**key_json(row), "key": secret}

    async def list(self) -> list[dict[str, Any]]:
        async with self.db.read() as conn:
            rows = (
                (await conn.execute(api_keys.select().order_by(api_keys.c.created_at)))
                .mappings()
                .all()
            )
        return [key_json(r) for r in rows]

    async def revoke(self, key_id: str) -> dict[str, Any]:
        async with self.db.write() as conn:
            await conn.execute(
                api_keys.update()
                .where(api_keys.c.id == key_id, api_keys.c.revoked_at.is_(None))
                .values(revoked_at=time.time())
            )
            row = (
                (await conn.execute(api_keys.select().where(api_keys.c.id == key_id)))
                .mappings()
                .first()
            )
        if row is None:
            raise GatewayError(
                ErrorKind.NOT_FOUND, f"API key {key_id!r} does not exist", param="key_id"
            )
        return key_json(row)

    async def update(self, key_id: str, changes: dict[str, Any]) -> dict[str, Any]:
        """Change a key's name, models, limits, expiry or budgets (a field set to null: no limit);
        its secret and what it spent stay. 404 for an unknown key, 400 for a revoked one."""
        unknown = sorted(set(changes) - set(UPDATABLE))
        if unknown:
            raise invalid_request(
                f"{unknown[0]} cannot be changed; send any of {', '.join(UPDATABLE)}", unknown[0]
            )
        if not changes:
            raise invalid_request(f"nothing to change: send any of {', '.join(UPDATABLE)}")
        row = await self.get(key_id)
        if row is None:
            raise GatewayError(
                ErrorKind.NOT_FOUND, f"API key {key_id!r} does not exist", param="key_id"
            )
        if row["revoked_at"] is not None:
            raise invalid_request(
                f"API key {key_id} was revoked and cannot be changed; create a new one", "key_id"
            )
        check_key_fields(
            changes.get("name", row["name"]),
            changes.get("models"),
            changes.get("rpm"),
            changes.get("tpm"),
            changes.get("expires_at"),
        )
        check_budgets(changes.get("budget_day_usd"), changes.get("budget_month_usd"))
        values = dict(changes)
        if "models" in values:
            values["models"] = (
                None if values["models"] is None else orjson.dumps(values["models"]).decode()
            )
        async with self.db.write() as conn:
            await conn.execute(api_keys.update().where(api_keys.c.id == key_id).values(**values))
            row = (
                (await conn.execute(api_keys.select().where(api_keys.c.id == key_id)))
                .mappings()
                .first()
            )
        return key_json(row)

    async def get(self, key_id: str) -> Any:
        async with self.db.read() as conn:
            return (
                (await conn.execute(api_keys.select().where(api_keys.c.id == key_id)))
                .mappings()
                .first()
            )

    async def find(self, secret: str) -> Any:
        async with self.db.read() as conn:
            return (
                (
                    await conn.execute(
                        api_keys.select().where(api_keys.c.key_hash == hash_key(secret))
                    )
                )
                .mappings()
                .first()
            )


def check_key_fields(name: Any, models: Any, rpm: Any, tpm: Any, expires_at: Any) -> None:
    if not isinstance(name, str) or not 1 <= len(name) <= 200:
        raise invalid_request("name must be a string of 1 to 200 characters", "name")
    if models is not None and not (
        isinstance(models, list) and all(isinstance(m, str) for m in models)
    ):
        raise invalid_request(
            "models must be a list of model names (or null for every model)", "models"
        )
    for name, v in (("rpm", rpm), ("tpm", tpm)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise invalid_request(f"{name} must be a positive integer (or null for no limit)", name)
    if expires_at is not None and (
        isinstance(expires_at, bool) or not isinstance(expires_at, int | float)
    ):
        raise invalid_request("expires_at must be a unix time in seconds", "expires_at")


def check_budgets(day: Any, month: Any) -> None:
    for field_name, v in (("budget_day_usd", day), ("budget_month_usd", month)):
        if v is not None and (
            isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < 1e9
        ):
            raise invalid_request(
                f"{field_name} must be a positive number of US dollars (or null for none)",
                field_name,
            )


# ---- the gate -------------------------------------------------------------------------------


class Auth:
    """Authenticates requests and enforces each key's models and limits."""

    def __init__(
        self, config: AuthConfig, keys: KeyStore, limiter: Limiter, budgets: Budgets | None = None
    ) -> None:
        self.master_key = config.master_key
        self.client_cert_keys = dict(config.client_cert_keys)
        self.keys = keys
        self.limiter = limiter
        self.budgets = budgets  # None: budgets are not enforced (a bare Auth in tests and tools)
        self.output_reserve = config.reserve_output_tokens

    @classmethod
    def from_config(cls, config: AuthConfig, db: Database, budgets: Budgets | None = None) -> Auth:
        limiter: Limiter = (
            RedisLimiter(config.redis_url, config.redis_prefix)
            if config.redis_url
            else LocalLimiter()
        )
        return cls(config, KeyStore(db), limiter, budgets)

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
                raise _unauthenticated(
                    "no API key: send Authorization: Bearer <key> or x-api-key: <key>"
                )
            row = await self.keys.get(key_id)
            if row is None:
                raise _unauthenticated(
                    f"client certificate maps to API key {key_id!r}, which does not exist"
                )
            return _caller_of(row)
        if hmac.compare_digest(secret.encode(), self.master_key.encode()):  # type: ignore[union-attr]
            return Caller(owner=MASTER, admin=True)
        row = await self.keys.find(secret)
        if row is None:
            raise _unauthenticated("invalid API key; create one with `flashstack keys create`")
        return _caller_of(row)

    def _key_for_certificate(self, identity: Any) -> str | None:
        """The key id the first matching `client_cert_keys` glob gives one of the
        certificate's names."""
        if identity is None:
            return None
        for pattern, key_id in self.client_cert_keys.items():
            if any(fnmatch.fnmatchcase(name, pattern) for name in identity.names):
                return key_id
        return None

    def check_model(self, caller: Caller, model: str) -> None:
        """403 if the key may not use `model`."""
        if not may_use(caller, model):
            allowed = ", ".join(caller.models or ()) or "none"
            raise GatewayError(
                ErrorKind.PERMISSION,
                f"API key {caller.key_id} may not use model {model!r}; allowed: {allowed}",
                param="model",
            )

    async def admit(self, caller: Caller, req: ChatRequest) -> Reservation:
        """Count `req` against the key's rpm, hold its estimated tokens against its tpm and the most
        it can cost against its budgets (429 with retry-after if any is spent). A request estimated
        above the whole tpm holds all of it: it waits for an idle minute instead of never
        being admitted."""
        reservation = await self._admit_limits(caller, req)
        if caller.key_id is None or caller.budget is None or self.budgets is None:
            return reservation
        try:
            budget = await self.budgets.reserve(
                caller.key_id, caller.budget, req.model, *budget_bounds(req, self.output_reserve)
            )
        except BaseException:
            await reservation.settle(0)  # refused: the tpm hold goes back
            raise
        if reservation is UNLIMITED:
            reservation = Reservation(
                key_id=caller.key_id, prompt_tokens=request_tokens(req, self.output_reserve)[0]
            )
        reservation.budget = budget
        return reservation

    async def _admit_limits(self, caller: Caller, req: ChatRequest) -> Reservation:
        if caller.key_id is None or (caller.rpm is None and caller.tpm is None):
            return UNLIMITED
        if caller.tpm is None:
            await self._admit(caller, caller.rpm, None, None)
            return UNLIMITED
        prompt, total = request_tokens(req, self.output_reserve)
        hold = Hold(uuid.uuid4().hex, min(total, caller.tpm))
        await self._admit(caller, caller.rpm, caller.tpm, hold)
        return Reservation(self.limiter, caller.key_id, hold, prompt)

    async def count_request(self, caller: Caller) -> None:
        """Count a request that calls no model (creating a session) against the key's rpm (429)."""
        if caller.key_id is not None and caller.rpm is not None:
            await self._admit(caller, caller.rpm, None, None)

    async def _admit(
        self, caller: Caller, rpm: int | None, tpm: int | None, hold: Hold | None
    ) -> None:
        wait = await self.limiter.admit(caller.key_id, rpm, tpm, hold)  # type: ignore[arg-type]
        if wait is not None:
            raise GatewayError(
                ErrorKind.RATE_LIMIT,
                f"API key {caller.key_id} is over its limit ({_limits(caller)}"
                f"{'' if hold is None else f'; this request may use {hold.tokens} tokens'}); "
                f"retry in {math.ceil(wait)} s",
                retry_after=math.ceil(wait),
            )

    def require_admin(self, caller: Caller) -> None:
        if not self.enabled:
            raise GatewayError(
                ErrorKind.PERMISSION,
                "key management is off: set auth.master_key (FLASHSTACK_AUTH__MASTER_KEY) to "
                "enable it",
            )
        if not caller.admin:
            raise GatewayError(ErrorKind.PERMISSION, "only the master key may manage API keys")

    async def aclose(self) -> None:
        await self.limiter.aclose()
        if self.budgets is not None:
            await self.budgets.aclose()


def _caller_of(row: Any) -> Caller:
    """The caller a stored key stands for (401 if it was revoked or has expired)."""
    if row["revoked_at"] is not None:
        raise _unauthenticated(f"API key {row['id']} was revoked; ask an admin for a new one")
    if row["expires_at"] is not None and row["expires_at"] <= time.time():
        raise _unauthenticated(f"API key {row['id']} has expired; ask an admin for a new one")
    models = tuple(orjson.loads(row["models"])) if row["models"] else None
    day, month = row.get("budget_day_usd"), row.get("budget_month_usd")
    budget = Budget(day, month) if day is not None or month is not None else None
    return Caller(
        owner=row["id"],
        key_id=row["id"],
        models=models,
        rpm=row["rpm"],
        tpm=row["tpm"],
        budget=budget,
    )


def may_use(caller: Caller, model: str) -> bool:
    return caller.models is None or model in caller.models


def bearer(headers: Any) -> str | None:
    value = headers.get("authorization")
    if value and value[:7].lower() == "bearer ":
        return value[7:].strip()
    return headers.get("x-api-key")


def _unauthenticated(message: str) -> GatewayError:
    return GatewayError(ErrorKind.AUTHENTICATION, message, code="invalid_api_key")


def _limits(caller: Caller) -> str:
    parts = [
        f"{caller.rpm} requests/min" if caller.rpm else "",
        f"{caller.tpm} tokens/min" if caller.tpm else "",
    ]
    return ", ".join(p for p in parts if p)


# ---- `flashstack keys` ----------------------------------------------------------------------


async def keys_command(config: Any, args: Any) -> list[str]:
    """Run one `flashstack keys` action on the configured database; returns JSON lines to print."""
    from flashstack.gateway.sessions.db import Database

    db = await Database.from_config(config).open()
    keys = KeyStore(db)
    try:
        if args.action == "create":
            models = (
                [m.strip() for m in args.models.split(",") if m.strip()] if args.models else None
            )
            expires = time.time() + parse_duration(args.expires_in) if args.expires_in else None
            created = await keys.create(
                args.name, models, args.rpm, args.tpm, expires, args.budget_day, args.budget_month
            )
            return [orjson.dumps(created).decode()]
        if args.action == "list":
            return [orjson.dumps(k).decode() for k in await keys.list()]
        return [orjson.dumps(await keys.revoke(args.key_id)).decode()]
    except GatewayError as e:
        from flashstack.gateway.config import ConfigError

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
        raise invalid_request(
            f"--expires-in {text!r}: use seconds or a number with s, m, h or d"
        ) from None
    if seconds <= 0:
        raise invalid_request(f"--expires-in {text!r} must be positive")
    return seconds

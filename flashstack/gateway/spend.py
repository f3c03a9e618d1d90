"""Spend: what each request cost, and per-key budgets (USD per UTC day / month) that stop
a runaway client.

A request's cost is its upstream's own usage times the price of the deployment that served it, cache
reads and writes at their own prices. A key with a budget holds an upper bound of the request's cost
at admission (its prompt's bytes as tokens, max_tokens of output, the dearest deployment of the
model) and settles the real cost when it ends, like the tpm holds in auth.py: concurrent requests
can never together promise more than is left. One exception keeps a nearly spent key usable: a
request whose bound is over what is left is admitted when nothing else of the key is in flight, so
at most one request ever goes over. Ledgers count integer nano-dollars (Redis adds them exactly);
with `auth.redis_url` every replica shares one ledger, checked and counted by one Lua script.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

import sqlalchemy as sa

from flashstack.gateway.config import ModelConfig, ModelPrice
from flashstack.gateway.core import ErrorKind, GatewayError, Usage
from flashstack.gateway.sessions.db import Database, requests

NANO = 1_000_000_000  # ledger units per USD
HOLD_TTL = 900.0  # seconds: a replica that died mid-request leaves its holds; they expire then
HOLD_RETRY = 1.0  # retry-after when only requests in flight hold what is left
LOCAL_PROVIDERS = ("local", "ollama")  # cost nothing unless priced in spend.prices


# ---- prices ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Price:
    """USD per million tokens."""

    input: float
    output: float
    cache_write: float
    cache_read: float

    def cost(self, usage: Usage) -> float:
        """USD for `usage` (canonical input tokens exclude the cached ones, as Anthropic counts)."""
        return (
            usage.input_tokens * self.input
            + usage.output_tokens * self.output
            + usage.cache_creation_input_tokens * self.cache_write
            + usage.cache_read_input_tokens * self.cache_read
        ) / 1e6

    def bound(self, prompt_tokens: int, output_tokens: int) -> float:
        """The most `prompt_tokens` in and `output_tokens` out can cost, however the
        prompt is cached."""
        return (
            prompt_tokens * max(self.input, self.cache_write, self.cache_read)
            + output_tokens * self.output
        ) / 1e6

    @classmethod
    def of(cls, p: ModelPrice) -> Price:
        return cls(
            p.input,
            p.output,
            p.input if p.cache_write is None else p.cache_write,
            p.input if p.cache_read is None else p.cache_read,
        )


FREE = Price(0.0, 0.0, 0.0, 0.0)

# List prices (USD per million tokens) of the models discovery.py serves, as published by Anthropic
# and OpenAI. Anthropic's 5-minute cache write is 1.25 x input and a cache read 0.1 x; OpenAI bills
# no cache write and a cached input token at half price.
DEFAULT_PRICES: dict[str, Price] = {
    "claude-opus-4-1": Price(15.0, 75.0, 18.75, 1.50),
    "claude-sonnet-4-5": Price(3.0, 15.0, 3.75, 0.30),
    "claude-haiku-4-5": Price(1.0, 5.0, 1.25, 0.10),
    "gpt-4o": Price(2.50, 10.0, 2.50, 1.25),
    "gpt-4o-mini": Price(0.15, 0.60, 0.15, 0.075),
}
# claude-sonnet-4-5-20250929, gpt-4o-2024-08-06
_DATED = re.compile(r"-(\d{8}|\d{4}-\d{2}-\d{2}|latest)$")


def default_price(upstream_model: str) -> Price | None:
    """The built-in price of an upstream model id, a dated snapshot priced as its family."""
    return DEFAULT_PRICES.get(upstream_model) or DEFAULT_PRICES.get(_DATED.sub("", upstream_model))


class PriceTable:
    """The price of every deployment: `spend.prices` by model name or upstream id, then the built-in
    table; a local model is free unless priced, another model without a price costs 0 and is listed
    in `unpriced` (the gateway warns at start-up)."""

    def __init__(
        self, models: list[ModelConfig], overrides: dict[str, ModelPrice] | None = None
    ) -> None:
        overrides = overrides or {}
        self.by_deployment: dict[str, Price] = {}
        # the dearest deployment of each model name: what holds use
        self.by_model: dict[str, Price] = {}
        self.unpriced: list[str] = []
        counts: dict[str, int] = {}
        for m in models:
            # the router's naming of deployments
            dep_id = m.id or f"{m.name}#{counts.get(m.name, 0)}"
            counts[m.name] = counts.get(m.name, 0) + 1
            price = self._price(m, overrides)
            self.by_deployment[dep_id] = price
            held = self.by_model.get(m.name, FREE)
            self.by_model[m.name] = max(held, price, key=lambda p: (p.output, p.input))

    def _price(self, m: ModelConfig, overrides: dict[str, ModelPrice]) -> Price:
        own = overrides.get(m.name) or overrides.get(m.model)
        if own is not None:
            return Price.of(own)
        if m.provider in LOCAL_PROVIDERS:
            return FREE
        known = default_price(m.model)
        if known is None:
            self.unpriced.append(m.name)
            return FREE
        return known

    def of_deployment(self, dep_id: str | None, model: str | None) -> Price:
        """The price of the deployment that served a request (of its model, if none did)."""
        price = self.by_deployment.get(dep_id) if dep_id else None
        return price or self.by_model.get(model or "", FREE)

    def of_model(self, model: str) -> Price:
        return self.by_model.get(model, FREE)


# ---- budget periods -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Period:
    """One budget period: its ledger name, when it began and when it resets (UTC)."""

    kind: str  # "day" | "month"
    name: str  # 20261201 | 202612
    start: datetime
    resets: datetime

    @property
    def word(self) -> str:
        return "daily" if self.kind == "day" else "monthly"


def periods(now: float | None = None) -> dict[str, Period]:
    t = datetime.fromtimestamp(time.time() if now is None else now, UTC)
    day = t.replace(hour=0, minute=0, second=0, microsecond=0)
    month = day.replace(day=1)
    next_month = (month + timedelta(days=32)).replace(day=1)
    return {
        "day": Period("day", day.strftime("%Y%m%d"), day, day + timedelta(days=1)),
        "month": Period("month", month.strftime("%Y%m"), month, next_month),
    }


def iso(t: datetime) -> str:
    return t.isoformat().replace("+00:00", "Z")


def nano(usd: float) -> int:
    return max(0, math.ceil(usd * NANO - 1e-6))  # ceil: a bound rounds up, never down


# ---- ledgers --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a budget refused: which period, its limit, what was spent and what requests
    in flight hold."""

    period: str
    limit: int
    spent: int
    held: int


SEED = "seed"  # a ledger's answer when a period's counter is missing: load it from the database


class Ledger(Protocol):
    async def reserve(
        self, key_id: str, limits: dict[str, int], names: dict[str, str], hold_id: str, need: int
    ) -> Refusal | list[str] | None:
        """Hold `need` against every period's limit if they allow it: None (held), a Refusal, or the
        periods whose spent counter is missing (seed them, then reserve again)."""

    async def seed(self, key_id: str, kind: str, name: str, spent: int, ttl: float) -> None:
        """Set a missing period counter to `spent` (a counter that exists meanwhile is kept)."""

    async def settle(
        self, key_id: str, names: dict[str, str], hold_id: str, need: int, cost: int
    ) -> None:
        """Release a hold and add `cost` to every counted period."""

    async def aclose(self) -> None: ...


def _admits(limit: int, spent: int, held: int, need: int) -> bool:
    """Within the limit beside what is held; or alone in flight with something left
    (may go over)."""
    return spent + held + need <= limit or (held == 0 and spent < limit)


class LocalLedger:
    """Budgets counted in this process (one gateway; seeded from the database after a restart)."""

    def __init__(self, hold_ttl: float = HOLD_TTL) -> None:
        self.hold_ttl = hold_ttl
        self.spent: dict[tuple[str, str, str], int] = {}  # (key, kind, period name) → nano-USD
        self.holds: dict[str, dict[str, tuple[float, int]]] = {}  # key → hold id → (expires, nano)

    def _held(self, key_id: str) -> int:
        holds = self.holds.get(key_id, {})
        now = time.monotonic()
        for h in [h for h, (until, _) in holds.items() if until <= now]:
            del holds[h]
        return sum(n for _, n in holds.values())

    async def reserve(
        self, key_id: str, limits: dict[str, int], names: dict[str, str], hold_id: str, need: int
    ) -> Refusal | list[str] | None:
        # No await in here: the check and the hold are one step for every other task of this loop.
        missing = [k for k in limits if (key_id, k, names[k]) not in self.spent]
        if missing:
            return missing
        held = self._held(key_id)
        for kind, limit in limits.items():
            spent = self.spent[(key_id, kind, names[kind])]
            if not _admits(limit, spent, held, need):
                return Refusal(kind, limit, spent, held)
        self.holds.setdefault(key_id, {})[hold_id] = (time.monotonic() + self.hold_ttl, need)
        return None

    async def seed(self, key_id: str, kind: str, name: str, spent: int, ttl: float) -> None:
        self.spent.setdefault((key_id, kind, name), spent)

    async def settle(
        self, key_id: str, names: dict[str, str], hold_id: str, need: int, cost: int
    ) -> None:
        self.holds.get(key_id, {}).pop(hold_id, None)
        for kind, name in names.items():
            k = (key_id, kind, name)
            if k in self.spent:
                self.spent[k] += cost

    async def aclose(self) -> None:
        pass


# KEYS: holds (zset: expiry ms, member id:nano), held (string: their sum), spent per period (string
# each, only those with a limit). ARGV: need, hold member, hold ttl ms, then one limit per spent
# key. Redis' own clock, so replicas with skewed clocks expire holds alike.
_RESERVE = """
local function amount(m) return tonumber(string.match(m, ':(%d+)$')) end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local need = tonumber(ARGV[1])
local missing = {}
for i = 3, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then table.insert(missing, i - 2) end
end
if #missing > 0 then return {'seed', unpack(missing)} end
local held = tonumber(redis.call('GET', KEYS[2]) or '0')
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
for _, m in ipairs(gone) do held = held - amount(m) end
if #gone > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now) end
if redis.call('ZCARD', KEYS[1]) == 0 then held = 0 end
for i = 3, #KEYS do
  local limit, spent = tonumber(ARGV[i + 1]), tonumber(redis.call('GET', KEYS[i]))
  if not (spent + held + need <= limit or (held == 0 and spent < limit)) then
    redis.call('SET', KEYS[2], held, 'PX', ARGV[3])
    return {'over', tostring(i - 2), tostring(spent), tostring(held)}
  end
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
redis.call('SET', KEYS[2], held + need, 'PX', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return false
"""

# KEYS: holds, held, spent per period. ARGV: hold member, need, cost.
_SETTLE = """
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then
  local held = tonumber(redis.call('GET', KEYS[2]) or '0') - tonumber(ARGV[2])
  if held < 0 or redis.call('ZCARD', KEYS[1]) == 0 then held = 0 end
  redis.call('SET', KEYS[2], held, 'KEEPTTL')
end
local cost = tonumber(ARGV[3])
for i = 3, #KEYS do
  if cost > 0 and redis.call('EXISTS', KEYS[i]) == 1 then redis.call('INCRBY', KEYS[i], cost) end
end
return 1
"""


class RedisLedger:
    """Budgets in Redis, shared by every replica; one script checks and holds, one settles."""

    def __init__(self, url: str, prefix: str, hold_ttl: float = HOLD_TTL) -> None:
        import redis.asyncio as redis

        self.redis = redis.from_url(url)
        self.prefix = prefix
        self.hold_ttl_ms = int(hold_ttl * 1000)
        self._reserve = self.redis.register_script(_RESERVE)
        self._settle = self.redis.register_script(_SETTLE)

    def _base(self, key_id: str) -> str:
        # hash tag: one key's counters share a cluster slot
        return f"{self.prefix}{{{key_id}}}:budget"

    def _spent(self, key_id: str, kind: str, name: str) -> str:
        return f"{self._base(key_id)}:{kind}:{name}"

    async def reserve(
        self, key_id: str, limits: dict[str, int], names: dict[str, str], hold_id: str, need: int
    ) -> Refusal | list[str] | None:
        kinds = list(limits)
        base = self._base(key_id)
        keys = [f"{base}:holds", f"{base}:held"] + [self._spent(key_id, k, names[k]) for k in kinds]
        args = [need, f"{hold_id}:{need}", self.hold_ttl_ms] + [limits[k] for k in kinds]
        out = await self._reserve(keys=keys, args=args)
        if out is None:
            return None
        tag = out[0].decode() if isinstance(out[0], bytes) else out[0]
        if tag == SEED:
            return [kinds[int(i) - 1] for i in out[1:]]
        kind = kinds[int(out[1]) - 1]
        return Refusal(kind, limits[kind], int(out[2]), int(out[3]))

    async def seed(self, key_id: str, kind: str, name: str, spent: int, ttl: float) -> None:
        await self.redis.set(
            self._spent(key_id, kind, name), spent, nx=True, px=max(1000, int(ttl * 1000))
        )

    async def settle(
        self, key_id: str, names: dict[str, str], hold_id: str, need: int, cost: int
    ) -> None:
        base = self._base(key_id)
        keys = [f"{base}:holds", f"{base}:held"] + [
            self._spent(key_id, k, n) for k, n in names.items()
        ]
        await self._settle(keys=keys, args=[f"{hold_id}:{need}", need, cost])

    async def aclose(self) -> None:
        await self.redis.aclose()


# ---- the database: a row per request, and sums of them ---------------------------------------


class SpendStore:
    """Per-request cost rows in the sessions database, and what they add up to."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def insert(self, rows: list[dict[str, Any]]) -> None:
        if rows:
            async with self.db.write() as conn:
                await conn.execute(requests.insert(), rows)

    async def delete_before(self, unix: float) -> int:
        """Delete the rows created before `unix`; how many went."""
        async with self.db.write() as conn:
            return (
                await conn.execute(
                    requests.delete().where(requests.c.created_at < int(unix * 1000))
                )
            ).rowcount

    async def spent_since(self, key_id: str, since: datetime) -> float:
        """USD a key spent from `since` on."""
        q = sa.select(sa.func.coalesce(sa.func.sum(requests.c.cost_usd), 0.0)).where(
            requests.c.key_id == key_id, requests.c.created_at >= int(since.timestamp() * 1000)
        )
        async with self.db.read() as conn:
            return float((await conn.execute(q)).scalar() or 0.0)

    async def by_key(self, since: datetime) -> dict[str | None, float]:
        """USD per key from `since` on."""
        c = requests.c
        q = (
            sa.select(c.key_id, sa.func.sum(c.cost_usd))
            .where(c.created_at >= int(since.timestamp() * 1000))
            .group_by(c.key_id)
        )
        async with self.db.read() as conn:
            return {k: float(v or 0.0) for k, v in (await conn.execute(q)).all()}

    async def by_model(self, key_id: str | None, since: datetime) -> list[dict[str, Any]]:
        """Requests, tokens and USD per model from `since` on (every key's when
        `key_id` is None)."""
        c = requests.c
        q = (
            sa.select(
                c.model,
                sa.func.count().label("requests"),
                sa.func.sum(c.input_tokens).label("input_tokens"),
                sa.func.sum(c.output_tokens).label("output_tokens"),
                sa.func.sum(c.cache_read_tokens).label("cache_read_tokens"),
                sa.func.sum(c.cache_write_tokens).label("cache_write_tokens"),
                sa.func.sum(c.cost_usd).label("cost_usd"),
            )
            .where(c.created_at >= int(since.timestamp() * 1000))
            .group_by(c.model)
            .order_by(c.model)
        )
        if key_id is not None:
            q = q.where(c.key_id == key_id)
        async with self.db.read() as conn:
            rows = (await conn.execute(q)).mappings().all()
        # str(k): the keys are SQLAlchemy's quoted_name, a str subclass orjson will not take.
        return [
            {
                str(k): (float(v) if k == "cost_usd" else v if k == "model" else int(v or 0))
                for k, v in r.items()
            }
            for r in rows
        ]

    async def daily(self, key_id: str | None, since: datetime) -> list[dict[str, Any]]:
        """USD per UTC day and per (key, model) from `since` on: what the console charts."""
        c = requests.c
        # integer division on both databases
        day = sa.cast(c.created_at / 86_400_000, sa.BigInteger)
        q = (
            sa.select(
                day.label("day"),
                c.key_id,
                c.model,
                sa.func.sum(c.cost_usd).label("cost_usd"),
                sa.func.count().label("requests"),
            )
            .where(c.created_at >= int(since.timestamp() * 1000))
            .group_by(day, c.key_id, c.model)
            .order_by(day)
        )
        if key_id is not None:
            q = q.where(c.key_id == key_id)
        async with self.db.read() as conn:
            rows = (await conn.execute(q)).mappings().all()
        return [
            {
                "date": (datetime(1970, 1, 1, tzinfo=UTC) + timedelta(days=int(r["day"]))).strftime(
                    "%Y-%m-%d"
                ),
                "key_id": r["key_id"],
                "model": r["model"],
                "cost_usd": float(r["cost_usd"] or 0.0),
                "requests": int(r["requests"]),
            }
            for r in rows
        ]


# ---- budgets at admission -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Budget:
    """A key's limits in USD (None: no limit for that period)."""

    day: float | None = None
    month: float | None = None

    def limits(self) -> dict[str, int]:
        return {k: nano(v) for k, v in (("day", self.day), ("month", self.month)) if v is not None}


@dataclass(eq=False)
class BudgetHold:
    """An admitted request's hold on its key's budgets; settles exactly once."""

    budgets: Budgets
    key_id: str
    model: str  # as requested (priced by the deployment that serves it)
    names: dict[str, str]  # period kind → name, as of admission
    id: str
    need: int  # nano-USD held
    settled: bool = False
    charged: float = 0.0  # USD, once settled

    async def settle(self, cost_usd: float) -> None:
        if self.settled:
            return
        self.settled = True
        self.charged = cost_usd
        await self.budgets.ledger.settle(
            self.key_id, self.names, self.id, self.need, nano(cost_usd)
        )


@dataclass
class Budgets:
    """Checks and charges per-key budgets against a ledger seeded from the database's cost rows."""

    ledger: Ledger
    store: SpendStore
    prices: PriceTable
    hold_ttl: float = HOLD_TTL
    _seeded: set[tuple[str, str, str]] = field(default_factory=set)

    async def reserve(
        self, key_id: str, budget: Budget, model: str, prompt_bound: int, output_bound: int
    ) -> BudgetHold:
        """Hold the most the request can cost (429 naming the budget and its reset if
        it is spent)."""
        limits = budget.limits()
        now = periods()
        names = {k: now[k].name for k in limits}
        need = nano(self.prices.of_model(model).bound(prompt_bound, output_bound))
        hold_id = uuid.uuid4().hex
        # a missing counter is seeded once; a third round would be an evicting Redis
        for _ in range(3):
            out = await self.ledger.reserve(key_id, limits, names, hold_id, need)
            if out is None:
                return BudgetHold(self, key_id, model, names, hold_id, need)
            if isinstance(out, Refusal):
                raise over_budget(key_id, out, now[out.period])
            for kind in out:
                p = now[kind]
                spent = await self.store.spent_since(key_id, p.start)
                # Kept a day past its reset, so a request admitted just before it still finds it.
                ttl = (p.resets - datetime.now(UTC)).total_seconds() + 86400
                await self.ledger.seed(key_id, kind, p.name, nano(spent), ttl)
        raise GatewayError(
            ErrorKind.INTERNAL, "the budget ledger lost its counters while checking; retry"
        )

    async def aclose(self) -> None:
        await self.ledger.aclose()


def over_budget(key_id: str, r: Refusal, p: Period) -> GatewayError:
    limit, spent, left = r.limit / NANO, r.spent / NANO, max(0, r.limit - r.spent) / NANO
    if r.spent < r.limit:  # only what requests in flight hold stands in the way
        return GatewayError(
            ErrorKind.RATE_LIMIT,
            f"API key {key_id}: requests in flight hold the rest of its {p.word} budget "
            f"(${left:.4f} of ${limit:.2f} left); retry in {HOLD_RETRY:g} s",
            code="budget_exceeded",
            retry_after=HOLD_RETRY,
        )
    wait = max(1.0, (p.resets - datetime.now(UTC)).total_seconds())
    return GatewayError(
        ErrorKind.RATE_LIMIT,
        f"API key {key_id} is over its {p.word} budget of ${limit:.2f} (spent ${spent:.4f}); "
        f"it resets at {iso(p.resets)}, in {_duration(wait)}",
        code="budget_exceeded",
        retry_after=math.ceil(wait),
    )


def _duration(seconds: float) -> str:
    h, m = divmod(int(seconds) // 60, 60)
    return f"{h} h {m} min" if h else f"{max(m, 1)} min"


def budgets_from_config(config: Any, db: Database) -> Budgets:
    """The ledger `auth.redis_url` names (else this process's), over the configured prices."""
    ledger: Ledger = (
        RedisLedger(config.auth.redis_url, config.auth.redis_prefix)
        if config.auth.redis_url
        else LocalLedger()
    )
    return Budgets(ledger, SpendStore(db), PriceTable(config.models, config.spend.prices))


# ---- GET /v1/keys/{id}/spend ------------------------------------------------------------------


async def key_spend(store: SpendStore, key: Any, days: int = 31) -> dict[str, Any]:
    """A key's budgets (spent, left, reset) this UTC day and month, and its spend per
    model and day."""
    now = periods()
    budgets: dict[str, Any] = {}
    for kind, column in (("day", "budget_day_usd"), ("month", "budget_month_usd")):
        p, limit = now[kind], key.get(column)
        spent = await store.spent_since(key["id"], p.start)
        budgets[kind] = {
            "limit_usd": limit,
            "spent_usd": round(spent, 9),
            "left_usd": None if limit is None else round(max(0.0, limit - spent), 9),
            "resets_at": iso(p.resets),
        }
    since = now["day"].start - timedelta(days=days - 1)
    return {
        "object": "spend",
        "key_id": key["id"],
        "budgets": budgets,
        "by_model": await store.by_model(key["id"], now["month"].start),
        "by_day": await store.daily(key["id"], since),
    }

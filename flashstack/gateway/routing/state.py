"""Where breaker, cooldown and in-flight state lives: this process, or Redis shared
by every replica.

Both stores implement the same few atomic operations with the same semantics; the breaker policy
(`breaker.py`) decides, the store only counts and expires. Per deployment the keys are:

    fails     consecutive failures (reset by a success)
    win:<b>   failures and totals in the current window bucket (for the failure rate)
    open      present while the breaker is open; its TTL is the cooldown
    tripped   present from opening until a success closes the breaker (open gone → half-open)
    probe     the one half-open probe in flight (SET NX with a TTL, so a lost probe frees itself)
    inflight  requests in flight on the deployment, across replicas
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass
from typing import Protocol

# A replica that dies with requests in flight leaves its count behind; it expires after this.
IN_FLIGHT_TTL = 600.0


class BreakerState(enum.IntEnum):
    """Circuit-breaker state; the value is what the Prometheus gauge reports."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


@dataclass(frozen=True, slots=True)
class TripPolicy:
    """When failures open a breaker (from RouterConfig)."""

    failures: int
    failure_rate: float
    window: float
    min_requests: int


@dataclass(slots=True)
class Snapshot:
    state: BreakerState
    in_flight: int
    open_for: float  # seconds of cooldown left (0 unless open)


class StateStore(Protocol):
    """Atomic breaker operations on deployment ids."""

    async def snapshot(self, ids: list[str]) -> list[Snapshot]: ...

    async def record_failure(self, dep: str, policy: TripPolicy, cooldown: float) -> bool:
        """Count a failure; True when this failure opened (or re-opened) the breaker."""
        ...

    async def record_success(self, dep: str, policy: TripPolicy) -> bool:
        """Count a success; True when it closed a half-open breaker."""
        ...

    async def try_probe(self, dep: str, ttl: float) -> bool: ...

    async def end_cooldown(self, dep: str) -> bool:
        """An open breaker becomes half-open now; True when it was open."""
        ...

    async def add_in_flight(self, dep: str, delta: int) -> None: ...

    async def aclose(self) -> None: ...


def _bucket(window: float) -> int:
    return math.floor(time.time() / window)


def _trips(fails: int, win_fail: int, win_total: int, policy: TripPolicy) -> bool:
    by_rate = win_total >= policy.min_requests and win_fail / win_total >= policy.failure_rate
    return fails >= policy.failures or by_rate


class MemoryState:
    """State of this process only (the default)."""

    def __init__(self) -> None:
        self.values: dict[str, int] = {}
        self.expiry: dict[str, float] = {}
        self.swept = time.monotonic()

    def _sweep(self) -> None:
        """Drop expired keys (old window buckets are never read again), at most every 10 s."""
        now = time.monotonic()
        if now - self.swept < 10:
            return
        self.swept = now
        for key in [k for k, until in self.expiry.items() if until <= now]:
            self._delete(key)

    def _get(self, key: str) -> int | None:
        until = self.expiry.get(key)
        if until is not None and until <= time.monotonic():
            self.values.pop(key, None)
            self.expiry.pop(key, None)
        return self.values.get(key)

    def _set(self, key: str, value: int, ttl: float | None = None) -> None:
        self.values[key] = value
        if ttl is None:
            self.expiry.pop(key, None)
        else:
            self.expiry[key] = time.monotonic() + ttl

    def _incr(self, key: str, by: int = 1, ttl: float | None = None) -> int:
        value = (self._get(key) or 0) + by
        self.values[key] = value
        if ttl is not None and key not in self.expiry:
            self.expiry[key] = time.monotonic() + ttl
        return value

    def _delete(self, *keys: str) -> None:
        for key in keys:
            self.values.pop(key, None)
            self.expiry.pop(key, None)

    def _state(self, dep: str) -> BreakerState:
        if self._get(f"{dep}:open") is not None:
            return BreakerState.OPEN
        return (
            BreakerState.HALF_OPEN
            if self._get(f"{dep}:tripped") is not None
            else BreakerState.CLOSED
        )

    async def snapshot(self, ids: list[str]) -> list[Snapshot]:
        out = []
        for dep in ids:
            state = self._state(dep)
            left = (
                self.expiry.get(f"{dep}:open", 0.0) - time.monotonic()
                if state is BreakerState.OPEN
                else 0.0
            )
            out.append(Snapshot(state, max(0, self._get(f"{dep}:inflight") or 0), max(0.0, left)))
        return out

    async def record_failure(self, dep: str, policy: TripPolicy, cooldown: float) -> bool:
        self._sweep()
        win = f"{dep}:win:{_bucket(policy.window)}"
        fails = self._incr(f"{dep}:fails")
        win_fail = self._incr(win + ":fail", ttl=2 * policy.window)
        win_total = self._incr(win + ":total", ttl=2 * policy.window)
        half_open = self._state(dep) is BreakerState.HALF_OPEN
        if not (half_open or _trips(fails, win_fail, win_total, policy)):
            return False
        self._set(f"{dep}:open", 1, cooldown)
        self._set(f"{dep}:tripped", 1)
        self._delete(f"{dep}:probe", f"{dep}:fails")
        return True

    async def record_success(self, dep: str, policy: TripPolicy) -> bool:
        self._sweep()
        self._delete(f"{dep}:fails")
        self._incr(f"{dep}:win:{_bucket(policy.window)}:total", ttl=2 * policy.window)
        if self._state(dep) is not BreakerState.HALF_OPEN:
            return False
        self._delete(f"{dep}:tripped", f"{dep}:probe")
        return True

    async def try_probe(self, dep: str, ttl: float) -> bool:
        if self._get(f"{dep}:probe") is not None:
            return False
        self._set(f"{dep}:probe", 1, ttl)
        return True

    async def end_cooldown(self, dep: str) -> bool:
        was_open = self._get(f"{dep}:open") is not None
        self._delete(f"{dep}:open")
        return was_open

    async def add_in_flight(self, dep: str, delta: int) -> None:
        self._incr(f"{dep}:inflight", delta)

    async def aclose(self) -> None:
        pass


# KEYS: fails, win_fail, win_total, open, tripped, probe
# ARGV: failures, failure_rate, min_requests, window_ms, cooldown_ms
_FAILURE_LUA = """
local fails = redis.call('INCR', KEYS[1])
redis.call('PEXPIRE', KEYS[1], 86400000)
local wf = redis.call('INCR', KEYS[2])
local wt = redis.call('INCR', KEYS[3])
redis.call('PEXPIRE', KEYS[2], 2 * tonumber(ARGV[4]))
redis.call('PEXPIRE', KEYS[3], 2 * tonumber(ARGV[4]))
local half_open = redis.call('EXISTS', KEYS[5]) == 1 and redis.call('EXISTS', KEYS[4]) == 0
local by_rate = wt >= tonumber(ARGV[3]) and wf / wt >= tonumber(ARGV[2])
if half_open or fails >= tonumber(ARGV[1]) or by_rate then
  redis.call('SET', KEYS[4], '1', 'PX', ARGV[5])
  redis.call('SET', KEYS[5], '1')
  redis.call('DEL', KEYS[6], KEYS[1])
  return 1
end
return 0
"""

# KEYS: fails, win_total, open, tripped, probe ; ARGV: window_ms
# Returns 1 when the success closed a half-open breaker.
_SUCCESS_LUA = """
redis.call('DEL', KEYS[1])
redis.call('INCR', KEYS[2])
redis.call('PEXPIRE', KEYS[2], 2 * tonumber(ARGV[1]))
if redis.call('EXISTS', KEYS[4]) == 1 and redis.call('EXISTS', KEYS[3]) == 0 then
  redis.call('DEL', KEYS[4], KEYS[5])
  return 1
end
return 0
"""


class RedisState:
    """State shared by every gateway replica through Redis (redis-py asyncio, Lua for atomicity)."""

    def __init__(self, url: str, prefix: str) -> None:
        from redis import asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        # No client-side retries: the breaker layer falls back to local state on the first error.
        self.redis = aioredis.from_url(
            url, socket_timeout=1.0, socket_connect_timeout=1.0, retry=Retry(NoBackoff(), 0)
        )
        self.prefix = prefix
        self._failure = self.redis.register_script(_FAILURE_LUA)
        self._success = self.redis.register_script(_SUCCESS_LUA)

    def _k(self, dep: str, name: str) -> str:
        # hash tag: one deployment's keys share a cluster slot
        return f"{self.prefix}{{{dep}}}:{name}"

    async def snapshot(self, ids: list[str]) -> list[Snapshot]:
        pipe = self.redis.pipeline(transaction=False)
        for dep in ids:
            pipe.pttl(self._k(dep, "open"))
            pipe.exists(self._k(dep, "tripped"))
            pipe.get(self._k(dep, "inflight"))
        raw = await pipe.execute()
        out = []
        for i in range(len(ids)):
            open_ms, tripped, inflight = raw[3 * i : 3 * i + 3]
            if open_ms is not None and open_ms > 0:
                state = BreakerState.OPEN
            else:
                state = BreakerState.HALF_OPEN if tripped else BreakerState.CLOSED
            left = open_ms / 1000 if state is BreakerState.OPEN else 0.0
            out.append(Snapshot(state, max(0, int(inflight or 0)), left))
        return out

    async def record_failure(self, dep: str, policy: TripPolicy, cooldown: float) -> bool:
        b = _bucket(policy.window)
        keys = [
            self._k(dep, "fails"),
            self._k(dep, f"win:{b}:fail"),
            self._k(dep, f"win:{b}:total"),
            self._k(dep, "open"),
            self._k(dep, "tripped"),
            self._k(dep, "probe"),
        ]
        args = [
            policy.failures,
            policy.failure_rate,
            policy.min_requests,
            int(policy.window * 1000),
            max(1, int(cooldown * 1000)),
        ]
        return bool(await self._failure(keys=keys, args=args))

    async def record_success(self, dep: str, policy: TripPolicy) -> bool:
        keys = [
            self._k(dep, "fails"),
            self._k(dep, f"win:{_bucket(policy.window)}:total"),
            self._k(dep, "open"),
            self._k(dep, "tripped"),
            self._k(dep, "probe"),
        ]
        return bool(await self._success(keys=keys, args=[int(policy.window * 1000)]))

    async def try_probe(self, dep: str, ttl: float) -> bool:
        return bool(
            await self.redis.set(self._k(dep, "probe"), "1", nx=True, px=max(1, int(ttl * 1000)))
        )

    async def end_cooldown(self, dep: str) -> bool:
        return bool(await self.redis.delete(self._k(dep, "open")))  # "tripped" stays: half-open

    async def add_in_flight(self, dep: str, delta: int) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.incrby(self._k(dep, "inflight"), delta)
        pipe.pexpire(self._k(dep, "inflight"), int(IN_FLIGHT_TTL * 1000))
        await pipe.execute()

    async def aclose(self) -> None:
        await self.redis.aclose()


def build_state(redis_url: str | None, prefix: str) -> StateStore:
    """Redis-backed state when `redis_url` is set, else this process's memory."""
    return RedisState(redis_url, prefix) if redis_url else MemoryState()

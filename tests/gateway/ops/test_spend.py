"""Spend: prices, costs from the upstream's usage (cached tokens at cache prices),
budgets per key."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
import uuid

import httpx
import pytest

from flashstack.gateway.config import (
    AuthConfig,
    Config,
    ModelConfig,
    ModelPrice,
    RouterConfig,
    ServerConfig,
    SpendConfig,
)
from flashstack.gateway.core import Usage
from flashstack.gateway.spend import DEFAULT_PRICES, FREE, Price, PriceTable, default_price
from tests.fakes.server import FakeServer
from tests.gateway.ops import metered_upstream
from tests.gateway.sessions.support import (
    MASTER_KEY,
    REDIS_URL,
    ScratchStore,
    auth_headers,
    create_key,
    pg_available,
    redis_available,
    start_gateway,
)

ROUTING = RouterConfig(
    num_retries=0, health_check_interval=0, breaker_failures=10**6, breaker_min_requests=10**6
)
# 1,200 bytes: at least as many tokens as the 1,000 + cached the upstream reports
PROMPT = "x" * 1200
SONNET = DEFAULT_PRICES["claude-sonnet-4-5"]
MINI = DEFAULT_PRICES["gpt-4o-mini"]


def test_prices_of_deployments():
    models = [
        ModelConfig(
            name="sonnet", provider="anthropic", model="claude-sonnet-4-5-20250929", api_key="k"
        ),
        ModelConfig(name="mini", provider="openai", model="gpt-4o-mini-2024-07-18", api_key="k"),
        ModelConfig(name="llama", provider="ollama", model="llama3.2"),
        ModelConfig(name="vllm", provider="openai", model="my-finetune", api_key="k"),
        ModelConfig(name="mine", provider="openai", model="gpt-4o", api_key="k"),
    ]
    table = PriceTable(models, {"mine": ModelPrice(input=1, output=2, cache_read=0.5)})
    # a dated snapshot priced as its family
    assert table.of_deployment("sonnet#0", "sonnet") == SONNET
    assert table.of_deployment("mini#0", "mini") == MINI
    assert table.of_deployment("llama#0", "llama") == FREE  # local: free unless priced
    # cache_write defaults to input
    assert table.of_deployment("mine#0", "mine") == Price(1, 2, 1, 0.5)
    assert table.unpriced == ["vllm"]
    assert default_price("claude-haiku-4-5-latest") == DEFAULT_PRICES["claude-haiku-4-5"]
    usage = Usage(
        input_tokens=1000,
        output_tokens=200,
        cache_read_input_tokens=5000,
        cache_creation_input_tokens=300,
    )
    assert SONNET.cost(usage) == pytest.approx(
        (1000 * 3 + 200 * 15 + 5000 * 0.30 + 300 * 3.75) / 1e6
    )


def _config(
    store: ScratchStore,
    tmp,
    upstream: FakeServer,
    redis_url: str | None = None,
    prefix: str | None = None,
) -> Config:
    return Config(
        server=ServerConfig(),
        router=ROUTING,
        state_dir=tmp,
        store=store.config(),
        models=[
            ModelConfig(
                name="sonnet",
                provider="anthropic",
                model="claude-sonnet-4-5-20250929",
                api_base=upstream.url,
                api_key="sk-up",
            ),
            ModelConfig(
                name="mini",
                provider="openai",
                model="gpt-4o-mini",
                api_base=upstream.url + "/v1",
                api_key="sk-up",
            ),
        ],
        auth=AuthConfig(
            master_key=MASTER_KEY,
            redis_url=redis_url,
            redis_prefix=prefix or f"fs-test-{uuid.uuid4().hex[:8]}:",
        ),
        spend=SpendConfig(flush_interval=0.05),
    )


@pytest.fixture
def upstream():
    server = FakeServer(
        metered_upstream.create_app(input_tokens=1000, cache_read=100, cache_write=50)
    ).start()
    yield server
    server.stop()


def _chat(
    url: str,
    key: str,
    model: str,
    stream: bool = False,
    max_tokens: int = 100,
    anthropic: bool = False,
) -> httpx.Response:
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "stream": stream,
        "messages": [{"role": "user", "content": PROMPT}],
    }
    if anthropic:
        return httpx.post(
            url + "/v1/messages",
            json=body,
            timeout=20,
            headers={"x-api-key": key, "anthropic-version": "2023-06-01"},
        )
    if stream:
        body["stream_options"] = {"include_usage": True}
    return httpx.post(
        url + "/v1/chat/completions", json=body, headers=auth_headers(key), timeout=20
    )


def _spend(url: str, key_id: str, key: str = MASTER_KEY) -> dict:
    r = httpx.get(f"{url}/v1/keys/{key_id}/spend", headers=auth_headers(key), timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def test_costs_are_the_price_table_times_the_usage(store, upstream, tmp_path):
    gw = start_gateway(_config(store, tmp_path, upstream))
    try:
        key = create_key(gw.url, name="meter")
        for stream in (False, True):
            assert _chat(gw.url, key["key"], "sonnet", stream, anthropic=True).status_code == 200
            assert _chat(gw.url, key["key"], "mini", stream).status_code == 200
        session = httpx.post(
            gw.url + "/v1/sessions", json={"model": "sonnet"}, headers=auth_headers(key["key"])
        ).json()
        r = httpx.post(
            f"{gw.url}/v1/sessions/{session['id']}/messages",
            headers=auth_headers(key["key"]),
            json={"content": PROMPT, "max_tokens": 100},
            timeout=20,
        )
        assert r.status_code == 200, r.text  # a session turn is charged like a chat request
        report = _spend(gw.url, key["id"])
        assert _spend(gw.url, key["id"], key["key"]) == report  # a key may read its own spend
        other = create_key(gw.url, name="other")["key"]
        assert (
            httpx.get(
                f"{gw.url}/v1/keys/{key['id']}/spend", headers=auth_headers(other)
            ).status_code
            == 403
        )
    finally:
        gw.stop()
    # Anthropic counts cache reads and writes apart from input; OpenAI's prompt_tokens include the
    # cached ones (and it has no cache writes): each priced as cached.
    sonnet = (
        1000 * SONNET.input
        + 100 * SONNET.output
        + 100 * SONNET.cache_read
        + 50 * SONNET.cache_write
    ) / 1e6
    mini = (1000 * MINI.input + 100 * MINI.output + 100 * MINI.cache_read) / 1e6
    by_model = {m["model"]: m for m in report["by_model"]}
    assert by_model["sonnet"]["cost_usd"] == pytest.approx(3 * sonnet, rel=1e-9)
    assert by_model["mini"]["cost_usd"] == pytest.approx(2 * mini, rel=1e-9)
    assert (
        by_model["sonnet"]["cache_read_tokens"] == 300
        and by_model["sonnet"]["cache_write_tokens"] == 150
    )
    assert by_model["mini"]["input_tokens"] == 2000 and by_model["mini"]["cache_write_tokens"] == 0
    assert report["budgets"]["day"]["spent_usd"] == pytest.approx(3 * sonnet + 2 * mini, rel=1e-6)
    assert report["budgets"]["day"]["limit_usd"] is None
    rows = store.query(
        "SELECT model, stream, cost_usd FROM fs_requests WHERE key_id = ? ORDER BY created_at",
        key["id"],
    )
    assert [(r[0], r[1]) for r in rows] == [
        ("sonnet", 0),
        ("mini", 0),
        ("sonnet", 1),
        ("mini", 1),
        ("sonnet", 0),
    ]


def test_over_budget_is_a_429_naming_the_budget_and_its_reset(upstream, tmp_path):
    store = ScratchStore("sqlite", tmp_path)
    gw = start_gateway(_config(store, tmp_path, upstream))
    try:
        key = create_key(gw.url, name="capped", budget_day_usd=0.001)
        assert key["budget_day_usd"] == 0.001
        # alone in flight: may go over, once
        assert _chat(gw.url, key["key"], "sonnet").status_code == 200
        for anthropic in (False, True):
            r = _chat(gw.url, key["key"], "sonnet", anthropic=anthropic)
            assert r.status_code == 429, r.text
            body = r.json()
            # each wire's own error shape
            assert body.get("type") == ("error" if anthropic else None)
            err = body["error"]
            assert err["type"] == "rate_limit_error" and err.get("code") == (
                None if anthropic else "budget_exceeded"
            )
            assert (
                "over its daily budget of $0.00" in err["message"] and "resets at" in err["message"]
            )
            assert 0 < int(r.headers["retry-after"]) <= 86400
        bad = httpx.post(
            gw.url + "/v1/keys",
            json={"name": "x", "budget_day_usd": -1},
            headers=auth_headers(MASTER_KEY),
        )
        assert bad.status_code == 400 and "budget_day_usd" in bad.text
        assert _chat(gw.url, create_key(gw.url, name="free")["key"], "sonnet").status_code == 200
    finally:
        gw.stop()
    assert store.query("SELECT COUNT(*) FROM fs_requests WHERE status = 429") == [(2,)]


LEDGERS = [
    pytest.param(None, id="local"),
    pytest.param(REDIS_URL, id="redis", marks=pytest.mark.redis),
]


@pytest.mark.parametrize("redis_url", LEDGERS)
def test_a_keys_budget_and_limits_change_at_once(store, upstream, tmp_path, redis_url):
    if redis_url and not redis_available():
        pytest.skip("Redis is not running on 127.0.0.1:6379")
    gw = start_gateway(_config(store, tmp_path, upstream, redis_url))
    try:
        key = create_key(gw.url, name="capped", budget_day_usd=0.001)
        update = f"{gw.url}/v1/keys/{key['id']}"
        assert _chat(gw.url, key["key"], "sonnet").status_code == 200  # alone in flight: over, once
        assert _chat(gw.url, key["key"], "sonnet").status_code == 429
        raised = httpx.post(
            update,
            json={"budget_day_usd": 1.0, "budget_month_usd": 20},
            headers=auth_headers(MASTER_KEY),
        )
        assert raised.status_code == 200, raised.text
        changed = raised.json()
        assert (changed["budget_day_usd"], changed["budget_month_usd"], changed["name"]) == (
            1.0,
            20,
            "capped",
        )
        assert "key" not in changed  # the secret is never shown again
        # the raised budget counts at once
        assert _chat(gw.url, key["key"], "sonnet").status_code == 200
        limited = httpx.post(
            update, json={"budget_day_usd": None, "rpm": 1}, headers=auth_headers(MASTER_KEY)
        )
        assert limited.json()["budget_day_usd"] is None and limited.json()["rpm"] == 1
        assert _chat(gw.url, key["key"], "sonnet").status_code == 200
        assert _chat(gw.url, key["key"], "sonnet").status_code == 429  # the new rpm
        report = _spend(gw.url, key["id"])
        assert (
            report["budgets"]["month"]["limit_usd"] == 20
            and report["budgets"]["day"]["limit_usd"] is None
        )
        # what it spent before the change stays
        assert report["budgets"]["day"]["spent_usd"] > 0.001

        for body, param in [
            ({"budget_day_usd": -1}, "budget_day_usd"),
            ({"rpm": "5"}, "rpm"),
            ({"name": None}, "name"),
            ({"models": "sonnet"}, "models"),
            ({"key_hash": "x"}, "key_hash"),
            ({}, None),
        ]:
            r = httpx.post(update, json=body, headers=auth_headers(MASTER_KEY))
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        anthropic_caller = httpx.post(
            update,
            json={"rpm": 0},
            headers={**auth_headers(MASTER_KEY), "anthropic-version": "2023-06-01"},
        )
        assert anthropic_caller.status_code == 400 and anthropic_caller.json()["type"] == "error"
        assert (
            httpx.post(update, json={"rpm": 5}, headers=auth_headers(key["key"])).status_code == 403
        )
        assert httpx.post(update, json={"rpm": 5}).status_code == 401
        assert (
            httpx.post(
                f"{gw.url}/v1/keys/key_nope", json={"rpm": 5}, headers=auth_headers(MASTER_KEY)
            ).status_code
            == 404
        )
        assert httpx.delete(update, headers=auth_headers(MASTER_KEY)).status_code == 200
        revoked = httpx.post(update, json={"rpm": 5}, headers=auth_headers(MASTER_KEY))
        assert revoked.status_code == 400 and "revoked" in revoked.json()["error"]["message"]
        assert store.query("SELECT rpm FROM fs_api_keys WHERE id = ?", key["id"]) == [(1,)]
    finally:
        gw.stop()


@pytest.mark.postgres
@pytest.mark.redis
def test_two_replicas_racing_the_last_cents_never_put_more_than_one_request_over(tmp_path):
    if not (pg_available() and redis_available()):
        pytest.skip("needs PostgreSQL on 127.0.0.1:5432 and Redis on 127.0.0.1:6379")
    store = ScratchStore("postgres", tmp_path)
    upstream = FakeServer(metered_upstream.create_app(input_tokens=1000, delay=0.02)).start()
    prefix = f"fs-test-{uuid.uuid4().hex[:8]}:"
    replicas = [
        start_gateway(_config(store, tmp_path / str(i), upstream, REDIS_URL, prefix))
        for i in range(2)
    ]
    cost = (1000 * SONNET.input + 100 * SONNET.output) / 1e6  # 0.0045 a request; each holds ~0.006
    budget = 0.02
    try:
        key = create_key(replicas[0].url, name="racer", budget_day_usd=budget)

        def client(i: int) -> tuple[int, str]:
            """Ask until served, or refused for the budget itself (not for what is
            held in flight)."""
            url = replicas[i % 2].url
            while True:
                r = _chat(url, key["key"], "sonnet")
                if r.status_code == 200:
                    return 200, ""
                assert r.status_code == 429, r.text
                message = r.json()["error"]["message"]
                if "over its daily budget" in message:
                    return 429, message
                time.sleep(0.02)

        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            results = list(pool.map(client, range(12)))
        assert time.monotonic() - t0 < 20
        served = sum(1 for status, _ in results if status == 200)
        report = _spend(replicas[1].url, key["id"])
    finally:
        for gw in replicas:
            gw.stop()
        upstream.stop()
        store.drop()
    spent = report["budgets"]["day"]["spent_usd"]
    assert spent == pytest.approx(served * cost, rel=1e-6)  # every served request charged once
    assert spent > budget  # the last cents went: someone went over…
    assert spent - cost < budget  # …but only one request
    assert served == 5  # 4 within the budget (3 held at once at most), the 5th alone


# The ledgers' holds live this long: long enough that a loaded machine's test keeps the ones it
# counts on, short enough to wait out the one that stands for a dead replica's.
HOLD_TTL_S = 1.0


@pytest.fixture(params=["local", pytest.param("redis", marks=pytest.mark.redis)])
async def ledger(request):
    from flashstack.gateway.spend import LocalLedger, RedisLedger

    if request.param == "local":
        yield LocalLedger(hold_ttl=HOLD_TTL_S)
        return
    if not redis_available():
        pytest.skip("Redis is not running on 127.0.0.1:6379")
    prefix = f"fs-test-{uuid.uuid4().hex[:8]}:"
    redis_ledger = RedisLedger(REDIS_URL, prefix, hold_ttl=HOLD_TTL_S)
    yield redis_ledger
    keys = await redis_ledger.redis.keys(prefix + "*")
    if keys:
        await redis_ledger.redis.delete(*keys)
    await redis_ledger.aclose()


async def test_ledger_holds_seeds_and_the_one_request_over(ledger):
    from flashstack.gateway.spend import Refusal

    names, limits = {"day": "20261201"}, {"day": 100}
    assert await ledger.reserve("k", limits, names, "h0", 10) == ["day"]  # unseeded: load it first
    await ledger.seed("k", "day", "20261201", 40, 60)
    await ledger.seed("k", "day", "20261201", 0, 60)  # a counter that exists is kept
    assert await ledger.reserve("k", limits, names, "h1", 50) is None  # 40 + 50 <= 100
    # 40 + 50 + 20 > 100, and h1 in flight
    refused = await ledger.reserve("k", limits, names, "h2", 20)
    assert refused == Refusal("day", 100, 40, 50)
    await ledger.settle("k", names, "h1", 50, 30)  # it cost less than it held
    # 70 spent, nothing held: alone, may go over
    assert await ledger.reserve("k", limits, names, "h3", 80) is None
    assert isinstance(await ledger.reserve("k", limits, names, "h4", 1), Refusal)  # 70 + 80 held
    await asyncio.sleep(HOLD_TTL_S + 0.2)  # a hold whose replica died expires
    assert await ledger.reserve("k", limits, names, "h5", 1) is None
    await ledger.settle("k", names, "h5", 1, 0)
    await ledger.settle("k", names, "h3", 80, 80)  # 150 spent: over, by one request
    assert await ledger.reserve("k", limits, names, "h6", 1) == Refusal("day", 100, 150, 0)


async def test_rows_past_the_retention_are_deleted(tmp_path):
    from flashstack.gateway.requestlog import RequestLog
    from flashstack.gateway.sessions.db import Database
    from flashstack.gateway.spend import SpendStore

    db = await Database(f"sqlite+aiosqlite:///{tmp_path / 'r.db'}").open()
    store = SpendStore(db)
    now_ms = int(time.time() * 1000)
    row = {
        "request_id": "r",
        "key_id": "k",
        "model": "m",
        "deployment": "m#0",
        "status": 200,
        "stream": 0,
        "input_tokens": 1,
        "output_tokens": 1,
        "cache_read_tokens": 0,
        "cache_write_tokens": 0,
        "cost_usd": 1.0,
        "latency_ms": 1.0,
        "detail": "{}",
    }
    await store.insert(
        [
            {**row, "id": "old", "created_at": now_ms - 33 * 86_400_000},
            {**row, "id": "new", "created_at": now_ms - 31 * 86_400_000},
        ]
    )
    log = RequestLog(PriceTable([]), store, retention_days=32)
    assert await log.prune() == 1
    async with db.read() as conn:
        assert [r[0] for r in (await conn.exec_driver_sql("SELECT id FROM fs_requests")).all()] == [
            "new"
        ]
    await db.close()

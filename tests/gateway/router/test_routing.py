"""Fallback chains, load balancing, active health checks, metrics, logs and headers."""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import openai
import pytest

from flashstack.gateway.routing import balancer
from tests.gateway.router.conftest import (
    ask,
    breaker_of,
    deployment,
    gateway,
    new_tag,
    openai_client,
)
from tests.gateway.router.faulty import FaultyUpstream


def test_default_fallbacks_apply_to_models_without_their_own(ups):
    models = [deployment("x", ups["a"]), deployment("y", ups["b"])]
    ups["a"].fail("status", status=500)
    with gateway(models, num_retries=0, default_fallbacks=["y"]) as gw:
        text, headers = ask(openai_client(gw), "x", new_tag())
    assert text.startswith("b:") and headers["x-flashstack-deployment"] == "y#0"


def test_context_window_fallback_skips_a_model_the_prompt_cannot_fit(ups):
    models = [
        deployment(
            "small",
            ups["a"],
            context_window=50,
            context_window_fallbacks=["large"],
            fallbacks=["other"],
        ),
        deployment("large", ups["b"]),
        deployment("other", ups["c"]),
    ]
    with gateway(models) as gw:
        client = openai_client(gw)
        assert ask(client, "small", new_tag())[0].startswith("a:"), "short prompts stay"
        long_prompt = "word " * 400 + f"#{new_tag()}"
        r = client.chat.completions.create(
            model="small", messages=[{"role": "user", "content": long_prompt}]
        )
    assert r.choices[0].message.content.startswith("b:")
    assert len(ups["a"].log) == 1 and ups["c"].log == []


def test_context_window_error_from_upstream_takes_the_context_window_chain(ups):
    models = [
        deployment("small", ups["a"], context_window_fallbacks=["large"], fallbacks=["other"]),
        deployment("large", ups["b"]),
        deployment("other", ups["c"]),
    ]
    ups["a"].fail(
        "status",
        status=400,
        code="context_length_exceeded",
        message="This model's maximum context length is 8192 tokens.",
    )
    with gateway(models) as gw:
        text, headers = ask(openai_client(gw), "small", new_tag())
    assert text.startswith("b:") and len(ups["a"].log) == 1 and ups["c"].log == []


def test_content_policy_error_takes_the_content_policy_chain(ups):
    models = [
        deployment("strict", ups["a"], content_policy_fallbacks=["lenient"]),
        deployment("lenient", ups["b"]),
    ]
    ups["a"].fail(
        "status",
        status=400,
        code="content_policy_violation",
        message="flagged by the safety system",
    )
    with gateway(models) as gw:
        assert ask(openai_client(gw), "strict", new_tag())[0].startswith("b:")


def test_400_without_a_special_chain_is_returned_as_is(ups):
    models = [
        deployment("strict", ups["a"], fallbacks=["lenient"]),
        deployment("lenient", ups["b"]),
    ]
    ups["a"].fail("status", status=400, code="content_policy_violation", message="flagged")
    with gateway(models) as gw, pytest.raises(openai.BadRequestError):
        ask(openai_client(gw), "strict", new_tag())
    assert ups["b"].log == []


def test_fallback_chain_stops_after_five_hops():
    ups = [FaultyUpstream(f"u{i}").start() for i in range(7)]
    try:
        for u in ups:
            u.fail("status", status=503)
        models = [
            deployment(f"m{i}", u, fallbacks=[f"m{j}" for j in range(i + 1, 7)])
            for i, u in enumerate(ups)
        ]
        with gateway(models, num_retries=0) as gw:
            with pytest.raises(openai.InternalServerError) as exc:
                ask(openai_client(gw), "m0", new_tag())
        assert exc.value.response.headers["x-flashstack-attempts"] == "6", (
            "the model and 5 fallbacks"
        )
        assert [len(u.log) for u in ups] == [1, 1, 1, 1, 1, 1, 0]
    finally:
        for u in ups:
            u.stop()


# ---- load balancing ---------------------------------------------------------------------------


@dataclass
class C:
    weight: float = 1.0
    in_flight: int = 0
    latency: float | None = None


def test_balancer_strategies():
    picks = Counter(balancer.choose([C(3), C(1)], "weighted_random") for _ in range(4000))
    assert 0.70 < picks[0] / 4000 < 0.80
    assert balancer.choose([C(in_flight=5), C(in_flight=2), C(in_flight=9)], "least_in_flight") == 1
    assert balancer.choose([C(latency=0.5), C(latency=0.1)], "lowest_latency") == 1
    assert balancer.choose([C(latency=0.1), C(latency=None)], "lowest_latency") == 1, (
        "unmeasured gets tried"
    )


def test_weighted_random_spreads_by_weight(ups):
    models = [deployment("m", ups["a"], weight=3), deployment("m", ups["b"], weight=1)]
    with gateway(models) as gw:
        client = openai_client(gw)
        served = Counter(
            ask(client, "m", new_tag())[1]["x-flashstack-deployment"] for _ in range(80)
        )
    assert served["m#0"] > served["m#1"] > 5, served


def test_least_in_flight_avoids_the_busy_deployment(ups):
    ups["a"].chunks = ups["b"].chunks = 30
    ups["a"].interval = ups["b"].interval = 0.03
    models = [deployment("m", ups["a"]), deployment("m", ups["b"])]
    with gateway(models, strategy="least_in_flight") as gw:
        client = openai_client(gw, timeout=30)
        with ThreadPoolExecutor(8) as pool:
            served = Counter(
                h["x-flashstack-deployment"]
                for _, h in pool.map(lambda _: ask(client, "m", new_tag(), True), range(8))
            )
    assert abs(served["m#0"] - served["m#1"]) <= 2, served


def test_lowest_latency_prefers_the_fast_deployment(ups):
    ups["a"].first_byte_delay = 0.25
    models = [deployment("m", ups["a"]), deployment("m", ups["b"])]
    with gateway(models, strategy="lowest_latency") as gw:
        client = openai_client(gw)
        served = Counter(
            ask(client, "m", new_tag(), True)[1]["x-flashstack-deployment"] for _ in range(12)
        )
    assert served["m#1"] >= 10, served


# ---- health checks ----------------------------------------------------------------------------


def test_active_probes_steer_traffic_away_and_back(ups):
    ups["a"].health = "fail"
    models = [deployment("m", ups["a"], weight=1000), deployment("m", ups["b"], weight=0.001)]
    with gateway(models, health_check_interval=0.1) as gw:
        _wait(lambda: ups["a"].health_probes >= 2)
        assert breaker_of(gw, "m#0")["ok"] is False
        assert all(ask(openai_client(gw), "m", new_tag())[0].startswith("b:") for _ in range(3))
        ups["a"].health = "ok"
        _wait(lambda: breaker_of(gw, "m#0")["ok"])
        assert ask(openai_client(gw), "m", new_tag())[0].startswith("a:")
        metrics = httpx.get(gw.url + "/metrics").text
        assert 'flashstack_health_check_up{deployment="m#0"} 1.0' in metrics


def test_a_hanging_probe_blocks_neither_requests_nor_readiness(ups):
    ups["a"].health = "hang"
    models = [deployment("m", ups["a"]), deployment("n", ups["b"])]
    with gateway(models, health_check_interval=0.1, health_check_timeout=1.0) as gw:
        t0 = time.monotonic()
        assert ask(openai_client(gw), "m", new_tag())[0].startswith("a:")
        assert time.monotonic() - t0 < 0.9, "the request did not wait for the probe"
        t0 = time.monotonic()
        r = httpx.get(gw.url + "/health/readiness", timeout=10)
        assert time.monotonic() - t0 < 2.5
        assert r.status_code == 503 and r.json()["status"] == "degraded"
        m = r.json()["models"]["m"][0]
        assert m["ok"] is False and "timed out" in m["detail"]


def test_a_probe_may_take_as_long_as_health_check_timeout(ups):
    """llama-cpp-python answers its model list only after the generation it is running: busy for
    longer than the gateway's own default of 2 s, it is healthy while
    health_check_timeout allows."""
    ups["a"].health_delay = 2.5
    with gateway(
        [deployment("m", ups["a"])], health_check_interval=0, health_check_timeout=5.0
    ) as gw:
        m = httpx.get(gw.url + "/health/readiness", timeout=10).json()["models"]["m"][0]
    assert m["ok"] and m["latency_ms"] >= 2500, m


# ---- observability ----------------------------------------------------------------------------


def test_metrics_count_requests_fallbacks_and_latency(ups):
    ups["a"].fail("status", status=502)
    models = [deployment("primary", ups["a"], fallbacks=["backup"]), deployment("backup", ups["b"])]
    with gateway(models, num_retries=0) as gw:
        ask(openai_client(gw), "primary", new_tag(), stream=True)
        text = httpx.get(gw.url + "/metrics").text
    assert 'flashstack_requests_total{model="primary",outcome="ok"} 1.0' in text
    assert (
        'flashstack_fallbacks_total{from_model="primary",reason="error",to_model="backup"} 1.0'
        in text
    )
    assert 'flashstack_upstream_attempts_total{deployment="primary#0",result="502"} 1.0' in text
    assert 'flashstack_request_latency_seconds_count{model="primary",stream="true"} 1.0' in text
    assert 'flashstack_upstream_ttft_seconds_count{deployment="backup#0"} 1.0' in text
    assert 'flashstack_in_flight{deployment="backup#0"} 0.0' in text


def test_json_logs_carry_the_request_id(ups, caplog):
    ups["a"].fail("status", status=500)
    models = [deployment("primary", ups["a"], fallbacks=["backup"]), deployment("backup", ups["b"])]
    with (
        caplog.at_level(logging.INFO, logger="flashstack.router"),
        gateway(models, num_retries=0) as gw,
    ):
        raw = openai_client(gw).chat.completions.with_raw_response.create(
            model="primary",
            messages=[{"role": "user", "content": "hi"}],
            extra_headers={"x-request-id": "rq-42"},
        )
    assert raw.headers["x-request-id"] == "rq-42"
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "flashstack.router"]
    mine = [entry for entry in lines if entry.get("request_id") == "rq-42"]
    assert [e["event"] for e in mine] == ["attempt_failed", "fallback", "routed"]
    assert mine[-1]["deployment"] == "backup#0" and mine[-1]["attempts"] == 2


def _wait(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_unreachable_redis_degrades_to_serving_with_a_warning(ups, caplog):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    models = [deployment("m", ups["a"])]
    with (
        caplog.at_level(logging.WARNING, logger="flashstack.router"),
        gateway(models, redis_url=f"redis://127.0.0.1:{dead_port}/0") as gw,
    ):
        for _ in range(3):
            assert ask(openai_client(gw), "m", new_tag())[0].startswith("a:")
    warnings = [r for r in caplog.records if "state store failed" in r.getMessage()]
    assert len(warnings) == 1, "one warning, not one per request"


def test_a_fallback_naming_an_unknown_model_is_a_config_error(ups):
    from flashstack.gateway.config import ConfigError, RouterConfig
    from flashstack.gateway.routing import Router

    with pytest.raises(ConfigError, match="'gtp'.*not a configured model"):
        Router([deployment("gpt", ups["a"], fallbacks=["gtp"])], RouterConfig())
    with pytest.raises(ConfigError, match="default_fallbacks"):
        Router([deployment("gpt", ups["a"])], RouterConfig(default_fallbacks=["nope"]))

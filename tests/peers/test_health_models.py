"""Health probes and model lists against the real servers' own endpoints."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from flashstack.gateway.config import RouterConfig
from flashstack.gateway.providers import build_provider
from tests.peers.conftest import ENGINE_MODEL, LITELLM_MODEL, LLAMACPP_MODEL, peer_models

# Gateway model → what the peer behind it really serves (its own /v1/models).
SERVED = {
    "llamacpp": [LLAMACPP_MODEL],
    "engine": [ENGINE_MODEL],
    "litellm-chat": [LITELLM_MODEL],
    "litellm-messages": [LITELLM_MODEL],
}


@pytest.fixture(scope="module")
def configs(llamacpp, engine_server, litellm, gguf):
    return {
        m.name: m for m in peer_models(llamacpp, engine_server, litellm, gguf) if m.name in SERVED
    }


@pytest.mark.parametrize("name", list(SERVED))
def test_the_provider_lists_what_the_peer_serves_and_its_probe_passes(configs, name):
    async def run():
        provider = build_provider(configs[name], RouterConfig().upstream_limits)
        try:
            return await provider.list_models(), await provider.health()
        finally:
            await provider.aclose()

    models, health = asyncio.run(run())
    assert models == SERVED[name]
    assert health.ok and health.latency_ms is not None and health.latency_ms < 2000, health


def test_readiness_probes_every_real_peer(peer_gateway):
    body = httpx.get(peer_gateway.url + "/health/readiness", timeout=30).json()
    deps = {d["deployment"]: d for group in body["models"].values() for d in group}
    for name in SERVED:
        assert deps[f"{name}#0"]["ok"] and deps[f"{name}#0"]["breaker"] == "closed", deps[
            f"{name}#0"
        ]
        assert deps[f"{name}#0"]["latency_ms"] is not None


def test_the_gateway_lists_its_own_model_names(peer_gateway):
    ids = [m["id"] for m in httpx.get(peer_gateway.url + "/v1/models", timeout=10).json()["data"]]
    # minilm: the gateway's own embedding model (POST /v1/embeddings), listed beside the
    # configured ones.
    assert ids == ["llamacpp", "engine", "litellm-chat", "litellm-messages", "local", "minilm"]

"""Embedded defaults: the models a config-less gateway finds in its environment."""

from __future__ import annotations

import os

import httpx

from flashstack.gateway.config import ModelConfig

ANTHROPIC_MODELS = ("claude-sonnet-4-5", "claude-opus-4-1", "claude-haiku-4-5")
OPENAI_DEFAULT_MODELS = ("gpt-4o", "gpt-4o-mini")
OPENAI_API = "https://api.openai.com/v1"


def discover_models(
    env: dict[str, str] | None = None, probe_timeout: float = 1.0
) -> list[ModelConfig]:
    """Anthropic from ANTHROPIC_API_KEY, OpenAI-compatible from OPENAI_*, Ollama if
    OLLAMA_HOST answers."""
    env = dict(os.environ if env is None else env)
    found: list[ModelConfig] = []
    found += _anthropic(env)
    found += _openai(env, probe_timeout)
    found += _ollama(env, probe_timeout)
    return found


def _anthropic(env: dict[str, str]) -> list[ModelConfig]:
    key = env.get("ANTHROPIC_API_KEY")
    if not key:
        return []
    base = env.get("ANTHROPIC_BASE_URL", "https://api.anthropic.com")
    return [
        ModelConfig(name=m, provider="anthropic", model=m, api_base=base, api_key=key)
        for m in ANTHROPIC_MODELS
    ]


def _openai(env: dict[str, str], timeout: float) -> list[ModelConfig]:
    key, base = env.get("OPENAI_API_KEY"), env.get("OPENAI_BASE_URL")
    if not key and not base:
        return []
    base = (base or OPENAI_API).rstrip("/")
    names = _list_openai_models(base, key, timeout) or list(OPENAI_DEFAULT_MODELS)
    # OpenAI itself serves the Responses API: those requests pass through whole
    responses = base == OPENAI_API
    return [
        ModelConfig(
            name=m, provider="openai", model=m, api_base=base, api_key=key, responses_api=responses
        )
        for m in names
    ]


def _list_openai_models(base: str, key: str | None, timeout: float) -> list[str]:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    try:
        resp = httpx.get(f"{base}/models", headers=headers, timeout=timeout)
        resp.raise_for_status()
        return [m["id"] for m in resp.json().get("data", [])]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return []


def _ollama(env: dict[str, str], timeout: float) -> list[ModelConfig]:
    host = env.get("OLLAMA_HOST")
    if not host:
        return []
    base = host if host.startswith("http") else f"http://{host}"
    try:
        resp = httpx.get(f"{base.rstrip('/')}/api/tags", timeout=timeout)
        resp.raise_for_status()
        names = [m["name"] for m in resp.json().get("models", [])]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return []
    return [ModelConfig(name=n, provider="ollama", model=n, api_base=base) for n in names]

"""Upstream providers; each speaks canonical types only."""

from __future__ import annotations

from flashstack.gateway.config import ModelConfig, UpstreamLimits
from flashstack.gateway.providers.base import Health, Provider
from flashstack.gateway.redact import Redactor


def build_provider(
    cfg: ModelConfig, limits: UpstreamLimits | None = None, redact: Redactor | None = None
) -> Provider:
    """The provider for one configured deployment; `redact` masks every configured secret
    in its errors."""
    if cfg.provider == "anthropic":
        from flashstack.gateway.providers.anthropic import AnthropicProvider

        return AnthropicProvider(cfg, limits, redact)
    if cfg.provider == "openai":
        from flashstack.gateway.providers.openai_compat import OpenAICompatProvider

        return OpenAICompatProvider(cfg, limits, redact)
    if cfg.provider == "ollama":
        from flashstack.gateway.providers.ollama import OllamaProvider

        return OllamaProvider(cfg, limits, redact)
    if cfg.provider == "local":
        from flashstack.gateway.providers.local import LocalProvider

        return LocalProvider(cfg)
    raise ValueError(f"unknown provider {cfg.provider!r}")


__all__ = ["Health", "Provider", "build_provider"]

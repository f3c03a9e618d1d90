"""Upstream providers; each speaks canonical types only."""

from __future__ import annotations

from flashstack.config import ModelConfig
from flashstack.gateway.providers.base import Health, Provider


def build_provider(cfg: ModelConfig) -> Provider:
    """The provider for one configured deployment."""
    if cfg.provider == "anthropic":
        from flashstack.gateway.providers.anthropic import AnthropicProvider

        return AnthropicProvider(cfg)
    if cfg.provider == "openai":
        from flashstack.gateway.providers.openai_compat import OpenAICompatProvider

        return OpenAICompatProvider(cfg)
    if cfg.provider == "ollama":
        from flashstack.gateway.providers.ollama import OllamaProvider

        return OllamaProvider(cfg)
    if cfg.provider == "local":
        from flashstack.gateway.providers.local import LocalProvider

        return LocalProvider(cfg)
    raise ValueError(f"unknown provider {cfg.provider!r}")


__all__ = ["Health", "Provider", "build_provider"]

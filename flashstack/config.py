"""One Config for the whole stack: a YAML file plus FLASHSTACK_* environment variables.

Values of the form ``env:NAME`` are read from the environment when the config is loaded, so
secrets stay out of the file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

ProviderName = Literal["anthropic", "openai", "ollama", "local"]


class ConfigError(ValueError):
    """The configuration cannot be used; the message says which field and how to fix it."""


class ModelConfig(BaseModel):
    """One deployment of a model: what clients call it, and where it really runs."""

    model_config = ConfigDict(extra="forbid")

    name: str
    provider: ProviderName
    model: str
    api_base: str | None = None
    api_key: str | None = None
    description: str | None = None
    timeout: float = 600.0
    connect_timeout: float = 5.0
    supports_images: bool = True
    context_window: int | None = None
    max_output_tokens: int | None = None
    weight: float = 1.0
    # Extra fields the local engine takes (block_size, max_num_seqs, dtype, device, ...).
    engine: dict[str, Any] = Field(default_factory=dict)

    @field_validator("api_base")
    @classmethod
    def _strip_slash(cls, v: str | None) -> str | None:
        return v.rstrip("/") if v else v


class ServerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = 8400
    max_body_bytes: int = 32 * 1024 * 1024
    stream_queue_size: int = 64  # events buffered between upstream reader and client writer
    stream_ping_interval: float = 15.0  # Anthropic `ping` events while upstream is silent


class Config(BaseSettings):
    """Everything flashstack reads at start-up."""

    model_config = SettingsConfigDict(env_prefix="FLASHSTACK_", env_nested_delimiter="__")

    server: ServerConfig = Field(default_factory=ServerConfig)
    models: list[ModelConfig] = Field(default_factory=list)
    state_dir: Path = Path(".flashstack")

    @model_validator(mode="after")
    def _check_models(self) -> "Config":
        for m in self.models:
            if m.provider in ("anthropic", "openai") and not m.api_base:
                m.api_base = {
                    "anthropic": "https://api.anthropic.com",
                    "openai": "https://api.openai.com/v1",
                }[m.provider]
            if m.provider == "ollama" and not m.api_base:
                m.api_base = "http://127.0.0.1:11434"
        return self

    def model_names(self) -> list[str]:
        return list(dict.fromkeys(m.name for m in self.models))


def resolve_env_refs(value: Any) -> Any:
    """Replace every ``env:NAME`` string with the variable's value (missing → ConfigError)."""
    if isinstance(value, dict):
        return {k: resolve_env_refs(v) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve_env_refs(v) for v in value]
    if isinstance(value, str) and value.startswith("env:"):
        name = value[4:]
        if name not in os.environ:
            raise ConfigError(f"config refers to env:{name}, but ${name} is not set; export it or edit the config")
        return os.environ[name]
    return value


def load_config(path: str | Path | None = None, **overrides: Any) -> Config:
    """Load the YAML file at `path` (if any), resolve env: references, apply overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"config file {p} must hold a mapping at the top level")
    data = resolve_env_refs(data)
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return Config(**data)
    except ValueError as e:
        raise ConfigError(f"invalid config: {e}") from e

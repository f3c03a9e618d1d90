"""Credentials never leave the gateway: the redactor, the start-up banner, api_base
credentials at start-up."""

from __future__ import annotations

import pytest

from flashstack import cli
from flashstack.gateway.config import Config, ConfigError, ModelConfig
from flashstack.gateway.core import ErrorKind, GatewayError
from flashstack.gateway.redact import Redactor, redact_url, secrets_of
from flashstack.gateway.routing import Router

AZURE = "https://res.openai.azure.com/openai/deployments/d?api-version=2024-06-01&api-key=azure-secret-31f"
PROXY = "http://alice:s3cret-pw@proxy.internal:8080/v1?sig=sas-sig-77&token=tok-9a8b"


def test_urls_lose_userinfo_and_secret_query_values_but_keep_the_rest():
    assert (
        redact_url(AZURE)
        == "https://res.openai.azure.com/openai/deployments/d?api-version=2024-06-01&api-key=***"
    )
    assert redact_url(PROXY) == "http://***@proxy.internal:8080/v1?sig=***&token=***"
    assert redact_url("http://127.0.0.1:11434") == "http://127.0.0.1:11434"


def test_configured_secrets_token_shapes_and_quoted_urls_are_masked():
    models = [
        ModelConfig(
            name="a", provider="openai", model="m", api_base=PROXY, api_key="plain-key-0042"
        ),
        ModelConfig(name="b", provider="openai", model="m", api_base=AZURE),
    ]
    redact = Redactor(secrets_of(models, "master-key-xyz"))
    text = (
        "Incorrect API key provided: Bearer sk-live-0123456789abcdef. key plain-key-0042, admin "
        "master-key-xyz, basic YWxpY2U6czNjcmV0LXB3, password s3cret-pw, sig sas-sig-77 at "
        + AZURE.replace("https://", "http://")
    )
    out = redact(text)
    for secret in (
        "sk-live-0123456789abcdef",
        "plain-key-0042",
        "master-key-xyz",
        "YWxpY2U6czNjcmV0LXB3",
        "s3cret-pw",
        "sas-sig-77",
        "azure-secret-31f",
        "proxy.internal:8080",
        "res.openai.azure.com",
    ):
        assert secret not in out, (secret, out)
    assert out.startswith("Incorrect API key provided: Bearer ***")


def test_ordinary_words_survive():
    redact = Redactor(["ab"])  # too short to search for: it would garble every text
    text = "Bearer authentication is required; the token limit is 8192; about ab testing"
    assert redact(text) == text


def test_the_router_masks_every_configured_secret_in_errors_it_passes_on():
    models = [
        ModelConfig(
            name="a", provider="openai", model="m", api_base="http://h:1/v1", api_key="key-of-a-123"
        ),
        ModelConfig(
            name="b", provider="anthropic", model="m", api_base="http://h:2", api_key="key-of-b-456"
        ),
    ]
    router = Router(models, secrets=["the-master-key-789"])
    err = router._sanitized(
        GatewayError(ErrorKind.UPSTREAM, "a said key-of-b-456 and the-master-key-789 " + "x" * 5000)
    )
    assert "key-of-b-456" not in err.message and "the-master-key-789" not in err.message
    assert len(err.message) < 1200 and err.status == 502


def test_userinfo_with_an_api_key_is_refused_at_start_naming_the_model_not_the_password():
    m = ModelConfig(name="proxied", provider="openai", model="m", api_base=PROXY, api_key="k")
    with pytest.raises(ConfigError, match="model 'proxied'.*not both") as exc:
        Router([m])
    assert "s3cret-pw" not in str(exc.value)


def test_the_start_up_banner_shows_no_credential():
    config = Config(
        models=[
            ModelConfig(name="proxied", provider="openai", model="m", api_base=PROXY),
            ModelConfig(name="azure", provider="openai", model="m", api_base=AZURE),
        ]
    )
    with cli.console.capture() as captured:
        cli._print_models(config, "127.0.0.1", 8400, from_file=True)
    out = captured.get()
    assert "proxy.internal:8080" in out and "proxied" in out
    for secret in ("alice", "s3cret-pw", "sas-sig-77", "tok-9a8b", "azure-secret-31f"):
        assert secret not in out, secret


def test_httpx_request_logs_lose_the_api_base_query_credentials(caplog):
    import logging

    import flashstack.gateway.providers.http  # noqa: F401 - installs the filter on httpx's logger

    caplog.set_level(logging.INFO, logger="httpx")
    logging.getLogger("httpx").info(
        'HTTP Request: %s %s "%s"', "POST", AZURE + "/chat/completions", "HTTP/1.1 200 OK"
    )
    assert "azure-secret-31f" not in caplog.text and "api-version=2024-06-01" in caplog.text


def test_userinfo_with_an_api_key_is_refused_by_load_config(tmp_path):
    from flashstack.gateway.config import load_config

    path = tmp_path / "flashstack.yaml"
    path.write_text(
        "models:\n  - "
        f"{{name: proxied, provider: openai, model: m, api_key: k, api_base: '{PROXY}'}}\n"
    )
    with pytest.raises(ConfigError, match="model 'proxied'") as exc:
        load_config(path)
    assert "s3cret-pw" not in str(exc.value)
    path.write_text(
        "models:\n  - "
        f"{{name: proxied, provider: anthropic, model: m, api_key: k, api_base: '{PROXY}'}}\n"
    )
    assert load_config(path).models[0].api_key == "k"  # x-api-key and basic auth go together

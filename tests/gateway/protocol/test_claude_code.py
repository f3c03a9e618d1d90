"""Claude Code as a real client: `claude -p` straight at a recording Anthropic fake, then through
the gateway in front of the same fake. Both exit 0, and the fake receives the same request bodies
(apart from per-run ids), anthropic-beta included: nothing Claude Code sends is lost on the way.

Claude Code is installed once with npm (pinned) into ~/.cache/flashstack/claude-code; without npm,
or without the registry on the first run, the test fails (a real client is what it tests).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import orjson
import pytest

from flashstack.gateway.app import create_app
from flashstack.gateway.config import Config, ModelConfig
from tests.fakes import anthropic_upstream, openai_upstream
from tests.fakes.server import FakeServer
from tests.gateway.protocol.conftest import ROUTING
from tests.npm_cli import npm_binary

VERSION = "2.1.332"
PER_RUN_ID = re.compile(
    rb"[0-9a-f]{64}|[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|toolu_[0-9A-Za-z]+|msg_[0-9A-Za-z]+"
)


@pytest.fixture(scope="module")
def claude() -> Path:
    return npm_binary("@anthropic-ai/claude-code", VERSION, "claude", "claude-code")


def _run(claude: Path, base_url: str, home: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": "sk-claude-code",
        "ANTHROPIC_MODEL": "claude",
        "ANTHROPIC_SMALL_FAST_MODEL": "claude",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    return subprocess.run(
        [str(claude), "-p", "Say hi"], env=env, cwd=cwd, capture_output=True, text=True, timeout=60
    )


def _bodies(requests: list, home: Path) -> list[bytes]:
    """Each /v1/messages body, its per-run ids and the run's home directory (the prompt
    names it) masked."""
    return [
        PER_RUN_ID.sub(
            b"<id>",
            orjson.dumps(r.body, option=orjson.OPT_SORT_KEYS).replace(
                str(home).encode(), b"<home>"
            ),
        )
        for r in requests
        if r.path == "/v1/messages"
    ]


def test_claude_code_through_the_gateway_sends_what_it_sends_directly(claude, tmp_path):
    with FakeServer(anthropic_upstream.create_app()) as fake:
        config = Config(
            state_dir=tmp_path / "state",
            router=ROUTING,
            models=[
                ModelConfig(
                    name="claude",
                    provider="anthropic",
                    model="claude",
                    api_base=fake.url,
                    api_key="sk-up",
                )
            ],
        )
        with FakeServer(create_app(config), lifespan="on") as gateway:
            # A fresh home each (Claude Code remembers earlier runs), one working directory (the
            # prompt names it).
            for d in ("home-direct", "home-gateway", "work"):
                (tmp_path / d).mkdir()
            direct = _run(claude, fake.url, tmp_path / "home-direct", tmp_path / "work")
            n = len(fake.requests)
            through = _run(claude, gateway.url, tmp_path / "home-gateway", tmp_path / "work")
    assert direct.returncode == 0 and through.returncode == 0, (direct.stderr, through.stderr)
    assert through.stdout == direct.stdout
    direct_requests, through_requests = fake.requests[:n], fake.requests[n:]
    assert n >= 2  # a tool call and its result, at least: not just one prompt
    assert _bodies(through_requests, tmp_path / "home-gateway") == _bodies(
        direct_requests, tmp_path / "home-direct"
    )
    first = through_requests[0]
    assert "cache_control" in first.raw.decode() and first.body["thinking"]
    assert first.headers["anthropic-beta"] == direct_requests[0].headers["anthropic-beta"]


def test_claude_code_works_through_the_gateway_with_an_openai_compatible_model(claude, tmp_path):
    # Its Anthropic-only fields (thinking, context_management, cache_control, output_config.effort)
    # are dropped and named; none is refused, so Claude Code runs on any model.
    with FakeServer(openai_upstream.create_app()) as fake:
        config = Config(
            state_dir=tmp_path / "state",
            router=ROUTING,
            models=[
                ModelConfig(
                    name="claude",
                    provider="openai",
                    model="gpt-4o-mini",
                    api_base=fake.url + "/v1",
                    api_key="sk-up",
                )
            ],
        )
        with FakeServer(create_app(config), lifespan="on") as gateway:
            for d in ("home", "work"):
                (tmp_path / d).mkdir()
            done = _run(claude, gateway.url, tmp_path / "home", tmp_path / "work")
    assert done.returncode == 0, done.stderr
    assert len(fake.requests) >= 2 and done.stdout.startswith("tool said:")
    first = fake.requests[0]
    assert (
        "cache_control" not in first.raw.decode() and first.body["messages"][0]["role"] == "system"
    )
    assert first.body["tools"][0]["type"] == "function"

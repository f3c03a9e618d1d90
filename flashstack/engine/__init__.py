"""flashstack.engine: block-wise KV cache, continuous batching, HF Llama/Qwen/Mistral models."""

from flashstack.engine.config import EngineConfig
from flashstack.engine.llm import LLM, AsyncLLM, LLMEngine
from flashstack.engine.outputs import RequestOutput, StreamDelta
from flashstack.engine.sampling import SamplingParams

__all__ = [
    "LLM",
    "AsyncLLM",
    "EngineConfig",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "StreamDelta",
]

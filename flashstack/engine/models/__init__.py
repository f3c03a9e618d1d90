"""Model families the engine runs, keyed by Hugging Face architecture name and model_type."""

from __future__ import annotations

from typing import Any

from flashstack.engine.models.llama import LlamaForCausalLM, ModelArgs
from flashstack.engine.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}


def model_class(hf: dict[str, Any]) -> type[LlamaForCausalLM]:
    """The class for a config.json, by `architectures` first and `model_type` second."""
    for name in [*(hf.get("architectures") or []), hf.get("model_type", "")]:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    raise ValueError(
        f"unsupported model: architectures={hf.get('architectures')}, "
        f"model_type={hf.get('model_type')!r}; supported: Llama, Mistral, Qwen2, Qwen3"
    )


__all__ = [
    "MODEL_REGISTRY",
    "LlamaForCausalLM",
    "ModelArgs",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "model_class",
]

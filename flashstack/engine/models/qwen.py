"""Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm, no bias) on the shared Llama-style decoder."""

from __future__ import annotations

from typing import Any

from flashstack.engine.models.llama import LlamaForCausalLM, ModelArgs


def _window(hf: dict[str, Any]) -> int | None:
    # Qwen configs carry a sliding_window that only applies when use_sliding_window is set.
    return hf.get("sliding_window") if hf.get("use_sliding_window") else None


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5: biased q, k, v projections."""

    @classmethod
    def args_from_hf(cls, hf: dict[str, Any]) -> ModelArgs:
        """Qwen2 always has q/k/v bias and no o_proj bias."""
        return ModelArgs.from_hf(hf, qkv_bias=True, o_bias=False, sliding_window=_window(hf))


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: RMSNorm on each head of q and k before rope."""

    @classmethod
    def args_from_hf(cls, hf: dict[str, Any]) -> ModelArgs:
        """Qwen3 adds q/k norm; bias follows attention_bias (off in released models)."""
        return ModelArgs.from_hf(hf, qk_norm=True, sliding_window=_window(hf))

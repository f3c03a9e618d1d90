"""Real model shapes with random weights, written as Hugging Face checkpoints for the benchmarks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

LLAMA3_8B: dict[str, Any] = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
    tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001, torch_dtype="bfloat16",
)
QWEN3_0_6B: dict[str, Any] = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=1024,
    intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
    head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
    tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16",
)


def random_hf_model(shape: dict[str, Any], device: str = "cuda"):
    """A transformers model of `shape` with random bf16 weights, initialised on `device`."""
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(**shape)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    return model.eval()


def save_checkpoint(model: Any, path: Path) -> Path:
    """Write `model` as safetensors + config.json (no tokenizer: benchmarks feed token ids)."""
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path

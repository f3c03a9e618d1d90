"""Real model shapes with random weights, written as Hugging Face checkpoints for the benchmarks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

LLAMA3_8B: dict[str, Any] = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=False,
    bos_token_id=128000,
    eos_token_id=128001,
    torch_dtype="bfloat16",
)
QWEN3_0_6B: dict[str, Any] = dict(
    architectures=["Qwen3ForCausalLM"],
    model_type="qwen3",
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    bos_token_id=151643,
    eos_token_id=151645,
    torch_dtype="bfloat16",
)

LLAMA3_2_1B: dict[str, Any] = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling=dict(
        rope_type="llama3",
        factor=32.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
    tie_word_embeddings=True,
    bos_token_id=128000,
    eos_token_id=128001,
    torch_dtype="bfloat16",
)
# SmolLM2-135M(-Instruct)'s shape: the trained default model, as random weights (same kernels and
# bytes).
SMOLLM2_135M: dict[str, Any] = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    torch_dtype="bfloat16",
)


def random_hf_model(shape: dict[str, Any], device: str = "cuda", seed: int = 0):
    """A transformers model of `shape` with random bf16 weights, initialised on `device` from `seed`
    (the same weights in every run on one machine)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(**shape)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    return model.eval()


def save_checkpoint(model: Any, path: Path) -> Path:
    """Write `model` as safetensors + config.json (no tokenizer: benchmarks feed token ids)."""
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


def plant_head(model: Any, seed: int = 0) -> Any:
    """Give `model` a clear-cut greedy argmax: embeddings of std 1 and lm_head row j = embedding
    row perm(j) (untied). Untrained weights otherwise give nearly tied top logits, where bf16
    rounding alone decides the argmax and agreement measures noise, not the engine; here the
    decoder layers still shape every logit, but no longer sit on a knife edge."""
    import torch

    emb = model.get_input_embeddings().weight
    gen = torch.Generator(device=emb.device).manual_seed(seed)
    vocab = emb.shape[0]
    with torch.no_grad():
        emb.copy_(torch.randn(emb.shape, generator=gen, device=emb.device, dtype=torch.float32))
        # a permutation: 7919 is prime
        perm = (torch.arange(vocab, device=emb.device) * 7919 + 1) % vocab
        head = torch.nn.Linear(emb.shape[1], vocab, bias=False, device=emb.device, dtype=emb.dtype)
        head.weight.copy_(emb[perm])
    model.config.tie_word_embeddings = False
    model.set_output_embeddings(head)
    return model

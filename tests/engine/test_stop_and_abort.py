"""Stop strings stop exactly, stop tokens and max_tokens finish, abort frees every block."""

from __future__ import annotations

from flashstack.engine import LLM, SamplingParams
from tests.engine.helpers import check_engine

PROMPT = "def main():"


def _free_run(llm: LLM, n: int = 40):
    return llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]


def test_stop_string_stops_exactly(tiny_llm) -> None:
    full = _free_run(tiny_llm)
    # Pick a stop string from the middle of what the model writes anyway, spanning token boundaries.
    start = len(full.text) // 2
    stop = full.text[start : start + 3]
    assert len(stop) == 3 and stop not in full.text[:start], (
        "pick a stop string that first occurs here"
    )
    out = tiny_llm.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    )[0]
    assert out.text == full.text[:start]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert full.token_ids[: len(out.token_ids)] == out.token_ids and len(out.token_ids) < len(
        full.token_ids
    )
    inc = tiny_llm.generate(
        PROMPT,
        SamplingParams(
            temperature=0,
            max_tokens=40,
            ignore_eos=True,
            stop=stop,
            include_stop_str_in_output=True,
        ),
    )[0]
    assert inc.text == full.text[:start] + stop


def test_stop_token_ids_and_length(tiny_llm) -> None:
    full = _free_run(tiny_llm, 10)
    target = full.token_ids[4]
    out = tiny_llm.generate(
        PROMPT,
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop_token_ids=[target]),
    )[0]
    first = full.token_ids.index(target)
    assert out.token_ids == full.token_ids[: first + 1] and out.finish_reason == "stop"
    assert _free_run(tiny_llm, 3).finish_reason == "length"


def test_eos_stops_unless_ignored(tiny_model_dir) -> None:
    llm = LLM(tiny_model_dir, block_size=16, device="cpu", show_progress=False)
    tok = llm.tokenizer
    assert llm.engine.scheduler.eos_token_ids == {
        tok.token_to_id("<|end_of_text|>"),
        tok.token_to_id("<|im_end|>"),
    }
    # Declare the model's first greedy token to be EOS, so the stop is certain whatever the weights.
    eos = _free_run(llm, 1).token_ids[0]
    llm.engine.scheduler.eos_token_ids = {eos}
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5))[0]
    assert out.finish_reason == "stop" and out.token_ids == [eos] and out.stop_reason == eos
    kept = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert kept.finish_reason == "length" and len(kept.token_ids) == 5
    late = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5, min_tokens=3))[0]
    assert len(late.token_ids) >= 3


def test_abort_frees_every_block(tiny_model_dir) -> None:
    llm = LLM(tiny_model_dir, block_size=4, device="cpu", show_progress=False)
    engine = llm.engine
    ids = [
        engine.add_request(p, SamplingParams(max_tokens=100, ignore_eos=True))
        for p in ("a b c d e f g", "hello world", "x" * 30)
    ]
    for _ in range(3):
        engine.step()
        check_engine(engine)
    assert engine.block_manager.num_used_blocks > 0
    assert engine.abort_request(ids[0])
    check_engine(engine)
    for rid in ids[1:]:
        engine.abort_request(rid)
    assert engine.block_manager.num_used_blocks == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    deltas = engine.step()
    assert sorted(d.request_id for d in deltas) == sorted(ids)
    assert all(d.finish_reason == "abort" for d in deltas) and not engine.has_unfinished_requests()
    assert not engine.abort_request(ids[0])


def test_prompt_validation(tiny_llm) -> None:
    import pytest

    with pytest.raises(ValueError, match="empty"):
        tiny_llm.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="fits"):
        tiny_llm.generate([[5] * 5000], SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        tiny_llm.generate([[10**7]], SamplingParams())


def test_sequence_stops_at_max_model_len(tiny_model_dir) -> None:
    llm = LLM(tiny_model_dir, block_size=4, num_kv_blocks=3, device="cpu", show_progress=False)
    assert llm.engine.config.max_model_len == 12  # capped to what the KV cache holds
    out = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=100, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 7

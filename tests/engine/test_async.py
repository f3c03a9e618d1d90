"""AsyncLLM streams per-step deltas; leaving early aborts and frees the request's blocks."""

from __future__ import annotations

import asyncio

import pytest

from flashstack.engine import AsyncLLM, SamplingParams, StreamDelta
from flashstack.engine.config import EngineConfig
from flashstack.engine.llm import LLMEngine


@pytest.fixture
def engine(tiny_model_dir):
    eng = AsyncLLM(
        LLMEngine(
            EngineConfig(model=str(tiny_model_dir), block_size=8, device="cpu", show_progress=False)
        )
    )
    yield eng
    eng._executor.shutdown(wait=False)


async def test_stream_deltas_add_up(engine, tiny_llm) -> None:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    deltas: list[StreamDelta] = [d async for d in engine.stream("def main():", params)]
    ref = tiny_llm.generate("def main():", params)[0]
    assert [t for d in deltas for t in d.token_ids] == ref.token_ids
    assert "".join(d.text for d in deltas) == ref.text
    assert [d.completion_tokens for d in deltas] == list(range(1, 13))
    assert deltas[-1].finish_reason == "length" and all(
        d.finish_reason is None for d in deltas[:-1]
    )
    assert deltas[0].prompt_tokens == len(engine.tokenizer.encode("def main():"))
    await engine.close()


async def test_concurrent_streams_are_batched(engine) -> None:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = await asyncio.gather(*(engine.generate(p, params) for p in ("a", "bb", [5, 6, 7])))
    assert all(len(o.token_ids) == 8 for o in outs)
    await engine.close()


async def test_consumer_leaving_aborts_and_frees(engine) -> None:
    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    gen = engine.stream("x " * 20, params, request_id="gone")
    async for d in gen:
        if d.completion_tokens >= 3:
            break
    await gen.aclose()  # what a server does when the client disconnects
    bm = engine.engine.block_manager
    for _ in range(100):
        if not engine.engine.has_unfinished_requests():
            break
        await asyncio.sleep(0.01)
    assert not engine.engine.has_unfinished_requests()
    assert bm.num_used_blocks == 0
    bm.check_invariants(engine.engine.scheduler.seqs)
    await engine.close()


async def test_cancelled_task_aborts(engine) -> None:
    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)

    async def consume() -> None:
        async for _ in engine.stream("hello", params):
            pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(100):
        if not engine.engine.has_unfinished_requests():
            break
        await asyncio.sleep(0.01)
    assert engine.engine.block_manager.num_used_blocks == 0
    await engine.close()


async def test_explicit_abort_ends_stream(engine) -> None:
    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    last = None
    async for d in engine.stream("hello", params, request_id="r1"):
        if d.completion_tokens == 2:
            await engine.abort("r1")
        last = d
    assert last is not None and last.finish_reason == "abort"
    await engine.close()


async def test_bad_request_raises_before_streaming(engine) -> None:
    with pytest.raises(ValueError, match="empty"):
        async for _ in engine.stream([], SamplingParams()):
            pass
    await engine.close()


async def test_stream_chat_uses_the_template(engine, tiny_llm) -> None:
    conv = [{"role": "user", "content": "hi"}]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    deltas = [d async for d in engine.stream_chat(conv, params)]
    ref = tiny_llm.chat(conv, params)[0]
    assert [t for d in deltas for t in d.token_ids] == ref.token_ids
    assert deltas[0].prompt_tokens == len(engine.tokenizer.encode_chat(conv))
    await engine.close()


def test_engine_survives_a_second_event_loop(engine) -> None:
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    first = asyncio.run(engine.generate("a", params))
    second = asyncio.run(engine.generate("a", params))
    assert first.token_ids == second.token_ids and len(first.token_ids) == 3

"""The engine core in its own process (core_process.py): a stream that falls behind gets the
steps it missed merged into one delta, every token in order."""

from __future__ import annotations

import asyncio
import functools

import pytest

from flashstack.engine import SamplingParams
from flashstack.engine.core_process import EngineCoreClient, EngineCoreError
from flashstack.engine.llm import LLMEngine, _engine_config

PROMPT = [5, 17, 42, 99, 123, 7]


async def _read(engine: EngineCoreClient, pause_s: float) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    deltas = []
    async for d in engine.stream(PROMPT, params):
        deltas.append(d)
        if len(deltas) == 1:
            # the core keeps stepping meanwhile: its deltas wait for this stream
            await asyncio.sleep(pause_s)
    return deltas


def test_a_lagging_stream_gets_every_token_in_order(tiny_model_dir) -> None:
    engine = EngineCoreClient(tiny_model_dir, block_size=16, device="cpu", show_progress=False)
    try:

        async def both() -> tuple[list, list]:
            # a hang fails here instead of waiting for the suite's timeout
            keeping_up = await asyncio.wait_for(_read(engine, 0.0), timeout=60)
            return keeping_up, await asyncio.wait_for(_read(engine, 2.0), timeout=60)

        keeping_up, lagging = asyncio.run(both())
    finally:
        engine.close()
    ids = [t for d in keeping_up for t in d.token_ids]
    assert len(ids) == 24 and [t for d in lagging for t in d.token_ids] == ids
    assert "".join(d.text for d in lagging) == "".join(d.text for d in keeping_up)
    assert len(lagging) < len(keeping_up)  # the missed steps came as one delta
    assert lagging[-1].finish_reason == "length" and lagging[-1].completion_tokens == 24


BROKEN = [3, 3, 3]  # the prompt the engine below fails to add


class _FaultyEngine(LLMEngine):
    """Fails to add one prompt with an error that is not the request's (not a ValueError)."""

    def make_sequence(self, prompt, *args, **kwargs):
        if list(prompt) == BROKEN:
            raise RuntimeError("the engine could not take this one")
        return super().make_sequence(prompt, *args, **kwargs)


def _faulty_engine(model: str) -> LLMEngine:
    return _FaultyEngine(_engine_config(model, dict(block_size=16, device="cpu")))


def test_a_request_the_engine_fails_to_add_fails_alone(tiny_model_dir) -> None:
    factory = functools.partial(_faulty_engine, str(tiny_model_dir))
    engine = EngineCoreClient(tiny_model_dir, engine_factory=factory)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    async def both() -> list:
        with pytest.raises(EngineCoreError, match="could not take this one"):
            async for _ in engine.stream(BROKEN, params):
                pass
        return [d async for d in engine.stream(PROMPT, params)]  # the core is still stepping

    try:
        deltas = asyncio.run(asyncio.wait_for(both(), timeout=120))
    finally:
        engine.close()
    assert sum(len(d.token_ids) for d in deltas) == 4 and deltas[-1].finished

"""The engine core in its own process (core_process.py): a stream that falls behind gets the
steps it missed merged into one delta, every token in order."""

from __future__ import annotations

import asyncio

from flashstack.engine import SamplingParams
from flashstack.engine.core_process import EngineCoreClient

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

"""The engine core in its own process (core_process.py): a stream that falls behind gets the
steps it missed merged into one delta, every token in order; a grammar compiles beside the step
loop, not on it; a long prompt's message waits for the core without holding up the event loop."""

from __future__ import annotations

import asyncio
import functools
import multiprocessing as mp
import threading
from collections.abc import Iterator

import pytest

from flashstack.engine import SamplingParams
from flashstack.engine.core_process import (
    EngineCoreClient,
    EngineCoreError,
    _Core,
    _RequestPipe,
    _step_loop,
)
from flashstack.engine.guided import GrammarError, GuideSpec
from flashstack.engine.llm import LLMEngine, _engine_config
from tests.engine.conftest import VOCAB

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


# ---- grammars compile off the step thread ----------------------------------------------------


class _HeldCompiler:
    """Compiles only once `release` is set, on whichever thread calls it; a regex "[" is refused."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.threads: list[str] = []

    def compile(self, spec: GuideSpec) -> None:
        self.threads.append(threading.current_thread().name)
        self.release.wait(120)
        if spec.regex == "[":
            raise GrammarError("guided_regex cannot be compiled: unterminated set")
        return None  # no mask: the request decodes as it would unguided


class _InProcessCore:
    """A `_Core` and its step loop on a thread of this process, fed and read through pipes."""

    def __init__(self, model_dir, compiler: _HeldCompiler) -> None:
        engine = LLMEngine(_engine_config(str(model_dir), dict(block_size=16, device="cpu")))
        req_recv, self.requests = mp.Pipe(duplex=False)
        self.outputs, out_send = mp.Pipe(duplex=False)
        core = _Core(engine, out_send, make_compiler=lambda: compiler)
        self.loop = threading.Thread(target=_step_loop, args=(core, req_recv), name="step-loop")
        self.loop.start()
        self.finish: dict[str, str] = {}  # request id -> finish reason
        self.errors: dict[str, tuple[bool, str]] = {}
        self.seen: set[str] = set()  # request ids any step reported

    def add(self, rid: str, spec: GuideSpec | None) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        self.requests.send(("add", rid, PROMPT, params, spec, 0))

    def read_until(self, rid: str) -> None:
        """Step messages until `rid` has ended; fails if the core goes quiet before that."""
        while rid not in self.finish and rid not in self.errors:
            assert self.outputs.poll(60), f"no step reported {rid!r} in 60 s: the core is stalled"
            _, packed, errors, _ = self.outputs.recv()
            for fields in packed:
                self.seen.add(fields[0])
                if fields[3] is not None:
                    self.finish[fields[0]] = fields[3]
            self.errors.update({r: (bad, message) for r, bad, message in errors})

    def stop(self) -> None:
        self.requests.send(("stop",))
        self.loop.join(60)


@pytest.fixture
def held(tiny_model_dir) -> Iterator[tuple[_InProcessCore, _HeldCompiler]]:
    compiler = _HeldCompiler()
    core = _InProcessCore(tiny_model_dir, compiler)
    yield core, compiler
    compiler.release.set()
    core.stop()


def test_a_compiling_grammar_holds_up_no_other_request(held) -> None:
    core, compiler = held
    core.add("guided", GuideSpec(regex="[a-z]+"))
    core.add("plain", None)
    core.read_until("plain")  # compiled on the step thread, the grammar would stall this forever
    assert core.finish["plain"] == "length" and "guided" not in core.seen
    compiler.release.set()
    core.read_until("guided")
    assert core.finish["guided"] == "length"
    assert compiler.threads and "step-loop" not in compiler.threads


def test_a_request_aborted_while_its_grammar_compiles_ends_as_aborted(held) -> None:
    core, compiler = held
    core.add("guided", GuideSpec(regex="[a-z]+"))
    core.requests.send(("abort", "guided"))
    core.read_until("guided")
    assert core.finish["guided"] == "abort"
    compiler.release.set()  # its compile ends unused: the request does not come back
    core.add("plain", None)
    core.read_until("plain")
    assert core.seen == {"guided", "plain"} and core.finish["guided"] == "abort"


def test_a_grammar_the_core_cannot_compile_is_the_requests_400(held) -> None:
    core, compiler = held
    compiler.release.set()
    core.add("bad", GuideSpec(regex="["))
    core.read_until("bad")
    assert core.errors["bad"] == (True, "guided_regex cannot be compiled: unterminated set")


# ---- request messages never wait for the core ----------------------------------------------

LONG_PROMPT = list(range(VOCAB)) * 3000  # 1.15 M token ids: ~2.5 MB pickled, more than any pipe


def test_request_messages_never_wait_for_the_core_and_stay_in_order() -> None:
    recv, send = mp.Pipe(duplex=False)
    pipe = _RequestPipe(send)
    msgs = [("add", "a", [1, 2]), ("add", "long", LONG_PROMPT), ("abort", "long"), ("stop",)]
    sent = threading.Event()

    def send_all() -> None:
        for msg in msgs:
            pipe.send(msg)
        sent.set()

    threading.Thread(target=send_all, daemon=True).start()
    # Nothing reads meanwhile: a send that waits for its reader returns only after the bound.
    sent_unread = sent.wait(30)
    assert [recv.recv() for _ in msgs] == msgs
    assert sent_unread
    pipe.close()  # its writer thread ends and the descriptor is released
    assert not pipe._writer.is_alive() and send.closed


def test_a_send_after_the_core_is_gone_says_so() -> None:
    recv, send = mp.Pipe(duplex=False)
    pipe = _RequestPipe(send)
    recv.close()
    for _ in range(2):  # the first write fails, then every later one
        with pytest.raises(BrokenPipeError, match="engine core is gone"):
            pipe.send(("add", "long", LONG_PROMPT))
    pipe.close()


class _GatedEngine(LLMEngine):
    """Each step waits for `gate`; `stepping` tells the test a step has begun."""

    def __init__(self, config, gate, stepping) -> None:
        super().__init__(config)
        self.gate, self.stepping = gate, stepping

    def step(self):
        self.stepping.set()
        self.gate.wait()
        return super().step()


def _gated_engine(model: str, gate, stepping) -> LLMEngine:
    return _GatedEngine(_engine_config(model, dict(block_size=16, device="cpu")), gate, stepping)


async def _collect(stream) -> list | BaseException:
    try:
        return [d async for d in stream]
    except ValueError as exc:
        return exc


def test_a_long_prompt_leaves_the_event_loop_running_while_the_core_steps(tiny_model_dir) -> None:
    ctx = mp.get_context("spawn")
    gate, stepping = ctx.Event(), ctx.Event()
    factory = functools.partial(_gated_engine, str(tiny_model_dir), gate, stepping)
    engine = EngineCoreClient(tiny_model_dir, engine_factory=factory)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    opened_by: list[str] = []
    # Bounds a send that blocks the event loop (it waits for the core, the core for the gate).
    watchdog = threading.Timer(30, lambda: (opened_by.append("watchdog"), gate.set()))

    async def scenario() -> list:
        running = asyncio.create_task(_collect(engine.stream(PROMPT, params, "running")))
        await asyncio.to_thread(stepping.wait, 60)  # the core is in a step: it reads nothing
        watchdog.start()
        long = asyncio.create_task(_collect(engine.stream(LONG_PROMPT, params, "long")))
        after = asyncio.create_task(_collect(engine.stream(PROMPT, params, "after")))
        await asyncio.sleep(0)  # both adds sent: each task ran to its first wait
        await engine.abort("after")  # behind its add, still queued behind the long prompt
        if not gate.is_set():
            opened_by.append("event loop")
            gate.set()
        return await asyncio.gather(running, long, after)

    try:
        running, long, after = asyncio.run(asyncio.wait_for(scenario(), timeout=120))
    finally:
        watchdog.cancel()
        gate.set()
        engine.close()
    assert opened_by[0] == "event loop"  # the loop ran on while the long prompt waited
    assert isinstance(long, ValueError) and f"prompt has {len(LONG_PROMPT)} tokens" in str(long)
    assert running[-1].finish_reason == "length" and running[-1].completion_tokens == 8
    assert after[-1].finish_reason == "abort"  # the abort did not overtake its add

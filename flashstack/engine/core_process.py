"""The engine core in a process of its own, as vLLM v1 runs it: the API server's event loop (HTTP,
JSON, SSE writes) and the engine's step loop no longer share one GIL.

In one process, every handoff of the GIL between the step thread and the event loop waited up to
the interpreter's switch interval, and the loop's per-token HTTP work ran between engine steps:
a 256-request burst streamed at 55 % of offline throughput (docs/benchmarks.md, engine_serving).

`EngineCoreClient` is `AsyncLLM`'s streaming surface over a pipe: requests (token ids, sampling
parameters, a grammar's spec) go in, one message per engine step comes back with every request's
delta and the engine's counters for /metrics. Text prompts are tokenized here, in the API
process; the core detokenizes (stop strings need the text) and steps without pause.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing as mp
import os
import pickle
import threading
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Callable
from multiprocessing.connection import Connection
from pathlib import Path
from queue import SimpleQueue
from typing import Any

from flashstack.engine.gguf import GGUFError
from flashstack.engine.llm import EngineInfo, EngineStats, Prompt, model_name
from flashstack.engine.outputs import StreamDelta
from flashstack.engine.sampling import SamplingParams
from flashstack.engine.tokenizer import load_tokenizer

log = logging.getLogger("flashstack.engine")


class EngineCoreError(RuntimeError):
    """The engine core process failed or is gone; the message says what happened there."""


# ---- the core process -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _EngineSpec:
    """Builds the LLMEngine in the child (picklable, unlike the engine)."""

    model: str
    kwargs: dict[str, Any]

    def __call__(self) -> Any:
        from flashstack.engine.llm import LLMEngine, _engine_config

        return LLMEngine(_engine_config(self.model, self.kwargs))


class _Core:
    """Runs in the child: drains the request pipe, steps, sends each step's deltas."""

    def __init__(self, engine: Any, out: Connection) -> None:
        self.engine = engine
        self.out = out
        self.outbox = _Outbox(out)
        self._grammars: Any = None
        # (request id, whether the request itself was bad: a 400, else the engine failed it)
        self.errors: list[tuple[str, bool, str]] = []

    def handle(self, msg: tuple[Any, ...]) -> bool:
        """Apply one request message; False on stop."""
        kind = msg[0]
        if kind == "add":
            _, rid, prompt, params, spec, priority = msg
            try:
                if spec is not None:
                    params = dataclasses.replace(params, guide=self._compile(spec))
                self.engine.add_state(self.engine.make_sequence(prompt, params, rid, priority))
            except ValueError as exc:  # a bad request: its stream raises it as a 400
                self.errors.append((rid, True, str(exc)))
            except Exception:  # this request's failure, not the engine's: the others go on
                failed = traceback.format_exc()
                self.errors.append((rid, False, f"the engine could not add the request:\n{failed}"))
        elif kind == "abort":
            self.engine.abort_request(msg[1])
        elif kind == "stop":
            return False
        return True

    def _compile(self, spec: Any) -> Any:
        # The API process compiled the spec already (a bad one was its 400); compiled grammars do
        # not cross processes, so the core compiles its own copy.
        if self._grammars is None:
            from flashstack.engine.guided import GrammarCompiler

            self._grammars = GrammarCompiler(
                self.engine.tokenizer, self.engine.model.args.vocab_size
            )
        return self._grammars.compile(spec)

    def step(self) -> None:
        try:
            deltas = self.engine.step() if self.engine.has_pending_output() else []
        except Exception:  # every live stream ends with the engine's error
            failed = traceback.format_exc()
            rids = list(self.engine.requests)
            self.engine.abort_all()
            self.errors += [(rid, False, f"engine step failed:\n{failed}") for rid in rids]
            deltas = []
        if deltas or self.errors:
            self.outbox.put(
                ("step", [_pack(d) for d in deltas], self.errors, EngineStats.of(self.engine))
            )
            self.errors = []


def _pack(d: StreamDelta) -> tuple[Any, ...]:
    # A tuple unpickles in C; a slots dataclass goes through dataclasses' Python __setstate__.
    return (
        d.request_id,
        d.token_ids,
        d.text,
        d.finish_reason,
        d.prompt_tokens,
        d.completion_tokens,
        d.logprobs,
        d.stop_reason,
        d.num_cached_tokens,
        d.times,
    )


class _Outbox:
    """Step messages written by a thread of their own: a full pipe (the API process busy) delays
    the writes, never the next step."""

    def __init__(self, out: Connection) -> None:
        self.out = out
        self._queue: SimpleQueue[bytes | None] = SimpleQueue()
        self._thread = threading.Thread(target=self._write, name="engine-core-outbox", daemon=True)
        self._thread.start()

    def put(self, msg: tuple[Any, ...]) -> None:
        self._queue.put(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    def _write(self) -> None:
        while (data := self._queue.get()) is not None:
            try:
                self.out.send_bytes(data)  # releases the GIL while the pipe is full
            except (BrokenPipeError, OSError):
                return  # the API process is gone

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(10)


def _core_main(
    make_engine: Callable[[], Any], requests: Connection, out: Connection, parent: int
) -> None:
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    try:
        core = _Core(make_engine(), out)
    except GGUFError as exc:  # the user's file, not a crash: the parent raises it as it is
        out.send(("bad_model", str(exc)))
        return
    except ValueError as exc:  # a bad option or a device that cannot run it: the user's to fix
        out.send(("bad_config", str(exc)))
        return
    except BaseException:
        out.send(("fatal", traceback.format_exc()))
        return
    out.send(("ready", EngineInfo.of(core.engine), EngineStats.of(core.engine)))
    # Not on the main thread: there the same CPU forward measured 7x slower (27.8 s against
    # 3.8 s for one batch of SmolLM2 on CPU); AsyncLLM's steps always ran on a worker thread.
    loop = threading.Thread(target=_step_loop, args=(core, requests), name="flashstack-engine")
    loop.start()
    loop.join()


def _step_loop(core: _Core, requests: Connection) -> None:
    try:
        running = True
        while running:
            # Block only when idle: a live batch steps again at once.
            if not core.engine.has_pending_output():
                requests.poll(None)
            while running and requests.poll(0):
                running = core.handle(requests.recv())
            if running:
                core.step()
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the API process is gone or stopping
    finally:
        core.outbox.close()
        core.engine.shutdown()


# ---- the API side ---------------------------------------------------------------------------


class EngineCoreClient:
    """`AsyncLLM.stream` with the engine in a child process; construct it before the event loop.

    `engine_factory` (picklable, called in the child) replaces the LLMEngine of `model`: the API
    side's benchmark (bench/engine_api.py) steps a synthetic engine at a GPU's pace.
    """

    def __init__(
        self,
        model: str | Path,
        startup_timeout_s: float = 1800.0,
        engine_factory: Callable[[], Any] | None = None,
        **kwargs: Any,
    ) -> None:
        ctx = mp.get_context("spawn")  # fork after torch or CUDA started is unsafe
        req_recv, self._requests = ctx.Pipe(duplex=False)
        self._outputs, out_send = ctx.Pipe(duplex=False)
        make_engine = engine_factory or _EngineSpec(str(model), kwargs)
        self._proc = ctx.Process(
            target=_core_main,
            args=(make_engine, req_recv, out_send, os.getpid()),
            name="flashstack-engine-core",
        )
        self._proc.start()
        req_recv.close()
        out_send.close()
        if not self._outputs.poll(startup_timeout_s):
            self._proc.kill()
            raise EngineCoreError(f"the engine core did not start in {startup_timeout_s:.0f} s")
        msg = self._recv_or_exit()
        if msg[0] == "bad_model":
            self._proc.join(10)
            raise GGUFError(msg[1])
        if msg[0] == "bad_config":
            self._proc.join(10)
            raise ValueError(msg[1])
        if msg[0] == "fatal":
            self._proc.join(10)
            raise EngineCoreError(f"the engine core failed to start:\n{msg[1]}")
        _, self.info, self.latest_stats = msg
        self.tokenizer = load_tokenizer(Path(model))
        self._queues: dict[str, asyncio.Queue[StreamDelta | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._send_lock = threading.Lock()
        self._closed = False
        self._failure: str | None = None
        self._reader = threading.Thread(target=self._read, name="engine-core-reader", daemon=True)

    def _recv_or_exit(self) -> tuple[Any, ...]:
        try:
            return self._outputs.recv()
        except EOFError:
            self._proc.join(10)
            raise EngineCoreError(
                f"the engine core exited with code {self._proc.exitcode} before it was ready"
            ) from None

    @property
    def model_name(self) -> str:
        """The model file's or directory's name."""
        return model_name(self.info.model)

    def stats(self) -> EngineStats:
        """The engine's counters as of its last step."""
        return self.latest_stats

    async def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[StreamDelta]:
        """Per-step deltas of one request until it ends; ValueError on a bad request."""
        self._bind_loop()
        if self._failure is not None:
            raise EngineCoreError(self._failure)
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass token ids instead of text")
            prompt = self.tokenizer.encode(prompt)
        spec = params.guide.spec if params.guide is not None else None
        if spec is not None:
            params = dataclasses.replace(params, guide=None)
        rid = request_id or uuid.uuid4().hex
        if rid in self._queues:
            raise ValueError(f"request id {rid!r} is already live")
        queue: asyncio.Queue[StreamDelta | BaseException] = asyncio.Queue()
        self._queues[rid] = queue
        finished = False
        try:
            self._send(("add", rid, list(prompt), params, spec, priority))
            while not finished:
                items = [await queue.get()]
                while not queue.empty():  # the reader fell behind: one delta for all of it
                    items.append(queue.get_nowait())
                deltas = [d for d in items if isinstance(d, StreamDelta)]
                if deltas:
                    delta = merge_deltas(deltas)
                    finished = delta.finished
                    yield delta
                failures = [e for e in items if isinstance(e, BaseException)]
                if failures and not finished:
                    raise failures[0]
        finally:
            self._queues.pop(rid, None)
            if not finished and self._failure is None:
                self._send(("abort", rid))

    async def abort(self, request_id: str) -> None:
        """Abort a live request; its stream ends with finish_reason 'abort'."""
        self._send(("abort", request_id))

    def _bind_loop(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._reader.start()

    def _send(self, msg: tuple[Any, ...]) -> None:
        with self._send_lock:
            self._requests.send(msg)

    def _read(self) -> None:
        # One thread: recv waits without the GIL, and each step's batch is one loop callback.
        while True:
            try:
                msg = self._outputs.recv()
            except (EOFError, OSError):
                if not self._closed:
                    code = self._proc.exitcode
                    self._loop.call_soon_threadsafe(
                        self._fail, f"the engine core exited (code {code})"
                    )
                return
            self._loop.call_soon_threadsafe(self._dispatch, msg)

    def _dispatch(self, msg: tuple[Any, ...]) -> None:
        _, packed, errors, stats = msg
        self.latest_stats = stats
        queues = self._queues
        for fields in packed:
            queue = queues.get(fields[0])
            if queue is not None:
                queue.put_nowait(StreamDelta(*fields))
        for rid, bad_request, message in errors:
            queue = queues.get(rid)
            if queue is not None:
                queue.put_nowait(ValueError(message) if bad_request else EngineCoreError(message))

    def _fail(self, message: str) -> None:
        self._failure = message
        for queue in self._queues.values():
            queue.put_nowait(EngineCoreError(message))

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the core process (it finishes its step first); kill it past `timeout_s`."""
        if self._closed:
            return
        self._closed = True
        try:
            self._send(("stop",))
        except (BrokenPipeError, OSError):
            pass
        self._proc.join(timeout_s)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)


def merge_deltas(deltas: list[StreamDelta]) -> StreamDelta:
    """One delta carrying several steps' news, as vLLM's AsyncLLM merges the outputs a slow
    consumer has not read yet: fewer, larger SSE events instead of a backlog of small ones."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    logprobs = None
    if any(d.logprobs is not None for d in deltas):
        logprobs = [lp for d in deltas for lp in d.logprobs or []]
    return dataclasses.replace(
        last,
        token_ids=[t for d in deltas for t in d.token_ids],
        text="".join(d.text for d in deltas),
        logprobs=logprobs,
    )


def _watch_parent(parent: int) -> None:
    # A killed API server leaves no engine core holding the GPU behind it.
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)

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
import contextlib
import dataclasses
import fcntl
import logging
import multiprocessing as mp
import os
import pickle
import select
import struct
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection, wait
from pathlib import Path
from queue import SimpleQueue
from typing import TYPE_CHECKING, Any

from flashstack.engine.gc_heap import freeze_startup_heap
from flashstack.engine.gguf import GGUFError
from flashstack.engine.llm import EngineInfo, EngineStats, Prompt, model_name
from flashstack.engine.outputs import StreamDelta
from flashstack.engine.sampling import SamplingParams
from flashstack.engine.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from flashstack.engine.guided import GrammarCompiler, Guide, GuideSpec

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

    def __init__(
        self,
        engine: Any,
        out: Connection,
        make_compiler: Callable[[], GrammarCompiler] | None = None,
    ) -> None:
        self.engine = engine
        self.out = out
        self.outbox = _Outbox(out)
        self.grammars = _GrammarWorker(make_compiler or self._grammar_compiler)
        # (request id, whether the request itself was bad: a 400, else the engine failed it)
        self.errors: list[tuple[str, bool, str]] = []

    def handle(self, msg: tuple[Any, ...]) -> bool:
        """Apply one request message; False on stop."""
        kind = msg[0]
        if kind == "add":
            _, rid, prompt, params, spec, priority = msg
            with self._failing_alone(rid):
                state = self.engine.make_sequence(prompt, params, rid, priority)
                if spec is None:
                    self.engine.add_state(state)
                else:
                    self.grammars.submit(rid, spec, state)
        elif kind == "abort":
            state = self.grammars.cancel(msg[1])
            if state is not None:  # still compiling: the engine ends it as any other abort
                self.engine.add_state(state)
            self.engine.abort_request(msg[1])
        elif kind == "stop":
            return False
        return True

    @contextlib.contextmanager
    def _failing_alone(self, rid: str) -> Iterator[None]:
        try:
            yield
        except ValueError as exc:  # a bad request: its stream raises it as a 400
            self.errors.append((rid, True, str(exc)))
        except Exception:  # this request's failure, not the engine's: the others go on
            failed = traceback.format_exc()
            self.errors.append((rid, False, f"the engine could not add the request:\n{failed}"))

    def _grammar_compiler(self) -> GrammarCompiler:
        from flashstack.engine.guided import GrammarCompiler

        if self.engine.tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer; this model has none")
        return GrammarCompiler(self.engine.tokenizer, self.engine.model.args.vocab_size)

    def _admit_compiled(self) -> None:
        for rid, grammar, state in self.grammars.finished():
            with self._failing_alone(rid):  # a grammar the library refused is the request's 400
                state.seq.params = dataclasses.replace(state.seq.params, guide=grammar.result())
                self.engine.add_state(state)

    def step(self) -> None:
        self._admit_compiled()
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


class _GrammarWorker:
    """Compiles guided requests' grammars on a thread of its own: a big JSON schema takes tens to
    hundreds of ms, which on the step thread would stall every running stream. A request joins
    the engine once its grammar is ready; the requests behind it do not wait for it.

    The API process compiled the same grammar for its 400; shipping that one instead measured
    worse (xgrammar's serialize_json: 44 MiB, 0.55 s to load, for a schema compiled in 0.13 s)."""

    def __init__(self, make_compiler: Callable[[], GrammarCompiler]) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="engine-core-grammar")
        # Built now, before requests come (the core waits for it before reporting ready): its
        # ~1 s (imports, the vocabulary's table) holds the GIL in stretches of up to 0.4 s.
        self._compiler = self._pool.submit(make_compiler)
        self._pending: dict[str, tuple[Future[Guide], Any]] = {}
        # Readable once a compile has ended: the idle step loop waits on it with the requests.
        self.ready, self._done = mp.Pipe(duplex=False)

    def submit(self, rid: str, spec: GuideSpec, state: Any) -> None:
        """Compile `spec`; the request's `state` waits here until it is done."""
        grammar = self._pool.submit(self._compile, spec)
        grammar.add_done_callback(lambda _: self._done.send_bytes(b""))
        self._pending[rid] = (grammar, state)

    def cancel(self, rid: str) -> Any | None:
        """Drop a request still compiling; its state, or None when `rid` is not compiling."""
        grammar, state = self._pending.pop(rid, (None, None))
        if grammar is not None:
            grammar.cancel()  # a compile already running ends unused
        return state

    def finished(self) -> list[tuple[str, Future[Guide], Any]]:
        """The requests whose compile has ended (a grammar or its error), in arrival order."""
        while self.ready.poll(0):
            self.ready.recv_bytes()
        done = [(rid, g, state) for rid, (g, state) in self._pending.items() if g.done()]
        for rid, _, _ in done:
            del self._pending[rid]
        return done

    def _compile(self, spec: GuideSpec) -> Guide:
        return self._compiler.result().compile(spec)

    def wait_compiler(self) -> None:
        """Until the compiler is built (or failed: each guided request then gets its error)."""
        self._compiler.exception()  # waits; a failure is returned, not raised

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


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
    # Its imports and vocabulary tables (~1 s, holding the GIL in stretches) finish before the
    # first step, and what they leave is frozen with the rest.
    core.grammars.wait_compiler()
    freeze_startup_heap()  # torch and the model: no full collection walks them between steps
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
                wait([requests, core.grammars.ready])
            while running and requests.poll(0):
                running = core.handle(requests.recv())
            if running:
                core.step()
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the API process is gone or stopping
    finally:
        core.grammars.close()
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
        req_recv, req_send = ctx.Pipe(duplex=False)
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
        tokenizer_error: Exception | None = None
        try:  # read while the child loads the same file: seconds of a GGUF's metadata, in parallel
            self.tokenizer = load_tokenizer(Path(model))
        except GGUFError:  # not a readable file: the child would say the same, later
            self._proc.kill()
            self._proc.join(10)
            raise
        except Exception as exc:  # the child meets the same fault: its report comes first
            tokenizer_error = exc
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
        if tokenizer_error is not None:
            self._proc.kill()
            self._proc.join(10)
            raise tokenizer_error
        _, self.info, self.latest_stats = msg
        self._requests = _RequestPipe(req_send)
        self._queues: dict[str, asyncio.Queue[StreamDelta | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
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
        self._requests.close()


# Linux's default /proc/sys/fs/pipe-max-size: a prompt of up to ~300k token ids goes straight in.
_PIPE_BYTES = 1 << 20


class _RequestPipe:
    """Request messages onto the core's pipe without blocking the event loop: a message is written
    at once as far as the pipe has room (the core reads only between engine steps); the rest of it
    goes to a writer thread, and every later message follows it there until it has drained, so an
    abort never overtakes its add and a small request costs no thread handoff."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn  # kept open; written through its descriptor, in Connection's framing
        self._fd = conn.fileno()
        _enlarge_pipe(self._fd)
        os.set_blocking(self._fd, False)
        self._lock = threading.Condition()
        self._backlog: deque[memoryview] = deque()  # what the writer thread has yet to write
        self._failure: OSError | None = None  # the writer's: the core is gone
        self._closing = False
        self._writer = threading.Thread(target=self._drain, name="engine-core-writer", daemon=True)
        self._writer.start()

    def send(self, msg: tuple[Any, ...]) -> None:
        """Queue `msg` for the core; never waits for the core to read."""
        data = memoryview(_frame(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)))
        with self._lock:
            if self._failure is not None:  # a fresh error each time: no traceback piles up
                raise BrokenPipeError("the engine core is gone") from self._failure
            if not self._backlog:
                try:
                    data = data[_write_some(self._fd, data) :]
                except OSError as exc:
                    self._failure = exc
                    raise BrokenPipeError("the engine core is gone") from exc
                if not data:
                    return
            self._backlog.append(data)
            self._lock.notify()

    def _drain(self) -> None:
        writable = select.poll()  # not select.select: a server's descriptors pass FD_SETSIZE
        writable.register(self._fd, select.POLLOUT)
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._backlog or self._closing)
                if not self._backlog:
                    return  # closing, everything written
                data = self._backlog[0]
            try:
                while data:
                    writable.poll()  # without the GIL, until the core has read some
                    data = data[_write_some(self._fd, data) :]
            except OSError as exc:
                with self._lock:
                    self._failure = exc
                    self._backlog.clear()
                return
            with self._lock:
                self._backlog.popleft()

    def close(self, timeout_s: float = 10.0) -> None:
        """Let the writer finish what it holds (it fails at once when the core is gone), then
        close the pipe."""
        with self._lock:
            self._closing = True
            self._lock.notify()
        self._writer.join(timeout_s)
        self._conn.close()


def _frame(payload: bytes) -> bytes:
    # Connection.send_bytes's framing, which the core's Connection.recv reads.
    n = len(payload)
    if n > 0x7FFFFFFF:
        return struct.pack("!i", -1) + struct.pack("!Q", n) + payload
    return struct.pack("!i", n) + payload


def _write_some(fd: int, data: memoryview) -> int:
    try:
        return os.write(fd, data)
    except BlockingIOError:
        return 0


def _enlarge_pipe(fd: int) -> None:
    # Fewer messages overflow into the writer thread; where the system refuses, they still do.
    if not hasattr(fcntl, "F_SETPIPE_SZ"):  # Linux only
        return
    with contextlib.suppress(OSError):
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)


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

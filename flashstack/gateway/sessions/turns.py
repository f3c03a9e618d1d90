"""One exchange with the model, seen from the session: lock, history, and an all-or-nothing commit.

The turn is stored *before* the client sees the final event (the JSON body, or the stream's
finish), so whatever a client saw complete is in the database; a turn that fails keeps the
user's messages, marked incomplete with the error, and never half an answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import orjson

from flashstack.gateway.auth import UNLIMITED, Auth, Caller, Reservation
from flashstack.gateway.config import Config, StoreConfig
from flashstack.gateway.core import (
    SAME_RAW,
    BlockStop,
    ChatRequest,
    ChatResponse,
    Error,
    ErrorKind,
    Event,
    Finish,
    GatewayError,
    Message,
    Part,
    Raw,
    Start,
    StopReason,
    Text,
    TextDelta,
    Thinking,
    ThinkingDelta,
    ToolArgsDelta,
    ToolCall,
    ToolCallStart,
    Usage,
    invalid_request,
)
from flashstack.gateway.routing import RouteTrace
from flashstack.gateway.sessions import codec
from flashstack.gateway.sessions.db import Database
from flashstack.gateway.sessions.store import (
    Failure,
    SessionStore,
    check_message_sizes,
    reply_from_json,
    reply_too_large,
    session_busy,
)
from flashstack.gateway.spend import budgets_from_config
from flashstack.gateway.translate import anthropic as anthropic_t
from flashstack.gateway.translate import openai as openai_t

log = logging.getLogger("flashstack.sessions")


@dataclass(slots=True)
class Idempotency:
    """An `Idempotency-Key` and the fingerprint of the request that carried it."""

    key: str
    fingerprint: str

    @classmethod
    def of(cls, headers: Any, path: str, body: bytes | Any) -> Idempotency | None:
        key = headers.get("idempotency-key")
        if not key:
            return None
        if len(key) > 255:
            raise invalid_request(
                "Idempotency-Key must be at most 255 characters", "Idempotency-Key"
            )
        raw = body if isinstance(body, bytes) else orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
        return cls(key, hashlib.sha256(path.encode() + b"\0" + raw).hexdigest())


async def open_sessions(config: Config) -> Sessions:
    """Open (and migrate) the configured database; sessions and API keys share it."""
    db = await Database.from_config(config).open()
    return Sessions(
        SessionStore(db),
        Auth.from_config(config.auth, db, budgets_from_config(config, db)),
        config.store,
    )


class _Locks:
    """In-process per-session locks: waiters queue here instead of polling the database."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    async def acquire(self, key: str) -> None:
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            await lock.acquire()
        except BaseException:
            self._drop(key)
            raise

    def release(self, key: str) -> None:
        self._locks[key][0].release()
        self._drop(key)

    def _drop(self, key: str) -> None:
        lock, users = self._locks[key]
        if users == 1:
            del self._locks[key]
        else:
            self._locks[key] = (lock, users - 1)


class Sessions:
    """The session service: the store, the per-session locks, and turns."""

    def __init__(self, store: SessionStore, auth: Auth, config: StoreConfig) -> None:
        self.store = store
        self.auth = auth
        self.config = config
        self._locks = _Locks()

    async def aclose(self) -> None:
        await self.auth.aclose()
        await self.store.db.close()

    async def open_turn(
        self,
        caller: Caller,
        session_id: str,
        inputs: list[Message],
        idem: Idempotency | None = None,
        wire: str | None = None,
    ) -> Turn:
        """Lock the session (in this process, then across replicas) and load its history: the newest
        whole turns within store.max_history_bytes. 413 first if an input is over max_message_bytes.
        `wire`: the one the client speaks (None: the gateway's own request), stored
        with the turn."""
        check_message_sizes(inputs, self.config.max_message_bytes)
        lock_key = f"{caller.owner}\0{session_id}"
        try:
            await asyncio.wait_for(self._locks.acquire(lock_key), self.config.lock_timeout)
        except TimeoutError:
            raise session_busy(session_id, self.config.lock_timeout) from None
        turn = Turn(self, caller, session_id, inputs, idem, lock_key=lock_key, wire=wire)
        try:
            turn.session = await self.store.acquire(
                caller.owner,
                session_id,
                turn.token,
                self.config.lease_ttl,
                self.config.lock_timeout,
            )
        except BaseException:
            self._locks.release(lock_key)
            raise
        turn.start_heartbeat()
        try:
            if idem is not None:
                await self._replay(turn, idem)
            if turn.replay is None:
                turn.history, turn.history_ids = await self.store.history_with_ids(
                    session_id, self.config.max_history_bytes
                )
            else:
                await turn.close()  # nothing to store: the first request stored it
        except BaseException:
            await turn.close()
            raise
        return turn

    async def _replay(self, turn: Turn, idem: Idempotency) -> None:
        """Give `turn` the stored reply of an earlier request with the same Idempotency-Key."""
        row = await self.store.idempotent_reply(turn.caller.owner, idem.key)
        if row is None:
            return
        if row["fingerprint"] != idem.fingerprint:
            raise GatewayError(
                ErrorKind.INVALID_REQUEST,
                f"Idempotency-Key {idem.key!r} was already used for a different request; use a new "
                "key",
                status=422,
                param="Idempotency-Key",
                code="idempotency_key_reused",
            )
        stored = orjson.loads(row["response"])
        turn.replay, turn.replay_message_id = reply_from_json(stored), stored["message_id"]


@dataclass(eq=False)
class Turn:
    """Bookkeeping for one exchange; without a session it only charges tokens."""

    sessions: Sessions | None
    caller: Caller
    session_id: str | None = None
    inputs: list[Message] = field(default_factory=list)
    idem: Idempotency | None = None
    lock_key: str | None = None
    wire: str | None = None  # the client's, which its messages' extras are in
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    session: dict[str, Any] = field(default_factory=dict)
    history: list[Message] = field(default_factory=list)
    history_ids: list[str] = field(default_factory=list)
    # Message embeddings the compressor computed, by position in history + inputs;
    # stored with the turn.
    vectors: dict[int, bytes] = field(default_factory=dict)
    replay: ChatResponse | None = None  # the stored reply of an idempotent retry
    replay_message_id: str | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)  # what the commit stored
    reservation: Reservation = UNLIMITED  # the tokens held against the key's tpm
    # of output that went out in a stream: what an abandoned stream is charged by
    output_bytes: int = 0
    _open: bool = True
    _streaming: bool = False
    _heartbeat: asyncio.Task[None] | None = None

    @property
    def in_session(self) -> bool:
        return self.session_id is not None

    async def admit(self, auth: Auth | None, req: ChatRequest) -> None:
        """Count `req` against the key's limits (429), holding its tokens; a refusal
        frees the session."""
        if auth is None:
            return
        try:
            self.reservation = await auth.admit(self.caller, req)
        except BaseException:
            await self.close()
            raise

    def route(self, router: Any) -> Any:
        """The router this turn's request goes to: an idempotent retry gets the stored reply."""
        if self.replay is not None:
            return ReplayRouter(self.replay, self.wire)
        return MeteredRouter(router, self.reservation) if self.reservation.metered else router

    def metadata(self) -> dict[str, str]:
        """The session's metadata (empty without a session)."""
        raw = self.session.get("metadata")
        return orjson.loads(raw) if isinstance(raw, str | bytes) else dict(raw or {})

    def system(self) -> list[Text]:
        text = self.session.get("system")
        return [Text(text)] if text else []

    def start_heartbeat(self) -> None:
        self._heartbeat = asyncio.create_task(self._renew())

    async def _renew(self) -> None:
        ttl = self.sessions.config.lease_ttl
        while True:
            await asyncio.sleep(ttl / 3)
            with suppress(Exception):
                await self.sessions.store.renew(self.session_id, self.token, ttl)  # type: ignore[arg-type]

    async def complete(self, resp: ChatResponse) -> None:
        """Store the whole turn (and settle its tokens) before the client sees the reply."""
        if self.replay is not None:
            await self.reservation.settle(0)
            return
        size = _output_bytes(resp)
        await self.reservation.finish(resp.usage, self.output_bytes or size)
        if self.in_session and self._open:
            limit = self.sessions.config.max_message_bytes  # type: ignore[union-attr]
            if size > limit:
                raise reply_too_large(limit)  # the caller records the failure
        if not self._claim():
            return
        try:
            self.rows = await self.sessions.store.commit_turn(
                self.session_id,
                self.token,
                self.inputs,
                _whole(resp),  # type: ignore[arg-type]
                idem=(self.caller.owner, self.idem.key, self.idem.fingerprint)
                if self.idem
                else None,
                vectors=self.vectors,
                history_ids=self.history_ids,
                wire=self.wire,
            )
        finally:
            await self._finish()

    async def fail(self, error: BaseException) -> None:
        """Keep the user's messages, marked incomplete with `error`; store no reply. The tokens:
        none if no output went out, else the whole hold (Reservation.abandon)."""
        await _shielded(self.reservation.abandon(self.output_bytes))
        if not self._claim():
            return
        try:
            failure = _failure(error)
            self.rows = await self.sessions.store.commit_turn(
                self.session_id,
                self.token,
                self.inputs,
                None,
                failure,
                wire=self.wire,  # type: ignore[arg-type]
            )
        except Exception:
            log.exception("could not record the failed turn of session %s", self.session_id)
            with suppress(Exception):
                await self.sessions.store.release(self.session_id, self.token)  # type: ignore[arg-type]
        finally:
            await self._finish()

    async def close(self) -> None:
        """Release the session if nothing stored the turn (an idempotent replay, or a refusal)."""
        await _shielded(self.reservation.abandon(self.output_bytes))
        if not self._claim():
            return
        try:
            await self.sessions.store.release(self.session_id, self.token)  # type: ignore[arg-type]
        except Exception:
            log.exception(
                "could not release session %s; its lock expires by itself", self.session_id
            )
        finally:
            await self._finish()

    async def close_stream(self) -> None:
        """After a stream's response: a stream that never began counts as interrupted."""
        await self.fail(ConnectionAbortedError("the client went away before the stream began"))

    def _claim(self) -> bool:
        """True once for the first of complete / fail / close: it alone writes and releases."""
        if not self._open or not self.in_session:
            return False
        self._open = False
        return True

    @asynccontextmanager
    async def guard(self) -> AsyncIterator[None]:
        """Record the failure of the block as this turn's error, unless a stream took
        the turn over."""
        try:
            yield
        except BaseException as e:
            if not self._streaming:
                await _shielded(self.fail(e))
            raise
        finally:
            if not self._streaming:
                await _shielded(self.close())

    async def _finish(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        if self.lock_key is not None:
            self.sessions._locks.release(self.lock_key)
            self.lock_key = None

    def watch(self, events: AsyncIterator[Event]) -> AsyncIterator[Event]:
        """`events`, with the turn stored before its Finish goes out and failures recorded."""
        self._streaming = True  # from here the stream, not `guard`, settles the turn
        if self.in_session:
            return self._watch(events)
        if self.reservation.metered:
            return self._settle_at_finish(events)
        return events

    def _count_output(self, ev: Event) -> None:
        if isinstance(ev, TextDelta | ThinkingDelta):
            self.output_bytes += len(ev.text.encode())
        elif isinstance(ev, ToolArgsDelta):
            self.output_bytes += len(ev.fragment.encode())
        elif isinstance(ev, ToolCallStart):
            self.output_bytes += len(ev.name.encode())

    async def _settle_at_finish(self, events: AsyncIterator[Event]) -> AsyncIterator[Event]:
        start_usage = Usage()
        try:
            async for ev in events:
                self._count_output(ev)
                if isinstance(ev, Start):
                    start_usage = ev.usage
                elif isinstance(ev, Finish):
                    await self.reservation.finish(_total(start_usage, ev.usage), self.output_bytes)
                yield ev
        finally:
            # A stream cut short (the client went away, the upstream broke off) settles here.
            await _shielded(self.reservation.abandon(self.output_bytes))
            await events.aclose()  # type: ignore[attr-defined]

    async def _watch(self, events: AsyncIterator[Event]) -> AsyncIterator[Event]:
        reply = _ReplyBuilder()
        try:
            limit = self.sessions.config.max_message_bytes  # type: ignore[union-attr]
            async for ev in events:
                reply.feed(ev)
                self._count_output(ev)
                if self.output_bytes > limit:  # stop before the reply outgrows what may be stored
                    error = reply_too_large(limit)
                    await _shielded(self.fail(error))
                    yield Error(error)
                    return
                if isinstance(ev, Finish):
                    try:
                        await self.complete(reply.response(ev))
                    except GatewayError as e:
                        await _shielded(self.fail(e))
                        yield Error(e)
                        return
                    except Exception:
                        log.exception("could not store the turn of session %s", self.session_id)
                        yield Error(
                            GatewayError(
                                ErrorKind.INTERNAL, "the turn could not be stored; send it again"
                            )
                        )
                        return
                elif isinstance(ev, Error):
                    await _shielded(self.fail(ev.error))
                yield ev
        except BaseException as e:  # upstream failure, or the client went away (cancel / aclose)
            await _shielded(self.fail(e))
            raise
        finally:
            await _shielded(
                self.fail(ConnectionAbortedError("the stream ended without a final event"))
            )
            await events.aclose()  # type: ignore[attr-defined]


async def _shielded(work: Any) -> None:
    """Finish `work` even if this task is cancelled meanwhile; the cancellation then goes on."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        with suppress(asyncio.CancelledError):
            await asyncio.shield(task)
        raise


def _failure(error: BaseException) -> Failure:
    if isinstance(error, GatewayError):
        return Failure(error.kind.value, error.message)
    # Stored and shown to whoever reads the session: fixed words, never the exception's text (task
    # names, file paths, addresses). The traceback goes to the gateway's log where it is raised.
    if isinstance(error, asyncio.CancelledError | GeneratorExit | ConnectionAbortedError):
        return Failure("interrupted", "the client went away before the reply was complete")
    return Failure(ErrorKind.INTERNAL.value, "internal error; see the gateway log")


class _ReplyBuilder:
    """Collects stream events into the canonical reply that the turn stores."""

    def __init__(self) -> None:
        self.id, self.model = "", ""
        self.usage = Usage()
        self.blocks: dict[int, Part] = {}
        self.args: dict[int, list[str]] = {}
        # The upstream's own message, whole, where the client speaks its wire (the events carry it).
        self.message: anthropic_t.MessageAccumulator | openai_t.MessageAccumulator | None = None

    def feed(self, ev: Event) -> None:
        raw = getattr(ev, "raw", None)
        if raw is not None and raw.wire in _ACCUMULATORS:
            self.message = self.message or _ACCUMULATORS[raw.wire]()
            for name, data in raw.items:
                self.message.feed(name, data)
        if isinstance(ev, Start):
            self.id, self.model, self.usage = ev.id, ev.model, ev.usage
        elif isinstance(ev, TextDelta):
            block = self.blocks.setdefault(ev.index, Text(""))
            block.text += ev.text  # type: ignore[union-attr]
        elif isinstance(ev, ThinkingDelta):
            block = self.blocks.setdefault(ev.index, Thinking(""))
            block.text += ev.text  # type: ignore[union-attr]
            if ev.signature:
                block.signature = ev.signature  # type: ignore[union-attr]
        elif isinstance(ev, ToolCallStart):
            self.blocks[ev.index] = ToolCall(ev.id, ev.name, "")
            self.args[ev.index] = []
        elif isinstance(ev, ToolArgsDelta):
            self.args.setdefault(ev.index, []).append(ev.fragment)
        elif isinstance(ev, BlockStop) and ev.index in self.args:
            self.blocks[ev.index].arguments = "".join(self.args.pop(ev.index))  # type: ignore[union-attr]

    def response(self, finish: Finish) -> ChatResponse:
        for index, fragments in self.args.items():  # a tool call the stream never closed
            self.blocks[index].arguments = "".join(fragments)  # type: ignore[union-attr]
        whole = self.message.reply() if self.message is not None else None
        content = (
            whole.parts if whole is not None else [self.blocks[i] for i in sorted(self.blocks)]
        )
        usage = _total(self.usage, finish.usage)
        return ChatResponse(
            self.id,
            self.model,
            content,
            finish.stop_reason,
            usage,
            finish.stop_sequence,
            extra=whole.extra if whole is not None else {},
        )


_ACCUMULATORS = {
    anthropic_t.WIRE: anthropic_t.MessageAccumulator,
    openai_t.WIRE: openai_t.MessageAccumulator,
}


def _whole(resp: ChatResponse) -> ChatResponse:
    """`resp` as stored: an upstream's reply to a client of its wire whole (every block and key)."""
    if resp.raw is None:
        return resp
    body = resp.raw.items[0][1]
    if resp.raw.wire == anthropic_t.WIRE:
        return dataclasses.replace(
            resp, content=anthropic_t.whole_content(body.get("content") or [])
        )
    if resp.raw.wire == openai_t.WIRE:
        message = openai_t.whole_reply(body)
        return dataclasses.replace(resp, content=message.parts, extra=message.extra)
    return resp


def _output_bytes(resp: ChatResponse) -> int:
    """The size of a whole reply's content: what it is charged by when its upstream
    reported no usage."""
    return len(orjson.dumps(codec.parts_json(resp.content)))


def _total(start: Usage, finish: Usage) -> Usage:
    """The finish's totals, with the input count from the start where the finish lacks it."""
    if finish.input_tokens or not start.input_tokens:
        return finish
    return Usage(
        start.input_tokens,
        finish.output_tokens,
        finish.cache_read_input_tokens,
        finish.cache_creation_input_tokens,
    )


class MeteredRouter:
    """`router`, with a whole reply's usage settled the moment it arrives: before any check of
    the reply that may still refuse it (json_schema), which does not make its tokens free."""

    def __init__(self, router: Any, reservation: Reservation) -> None:
        self.router, self.reservation = router, reservation

    async def complete(self, request: Any, *args: Any) -> ChatResponse:
        resp = await self.router.complete(request, *args)
        self.reservation.served_by = _served_by(args)
        await self.reservation.finish(resp.usage, _output_bytes(resp))
        return resp

    async def open_stream(self, request: Any, *args: Any) -> AsyncIterator[Event]:
        events = await self.router.open_stream(request, *args)
        self.reservation.served_by = _served_by(args)  # known from the first token on
        return events


def _served_by(args: tuple[Any, ...]) -> str | None:
    """The deployment the router's trace (its second argument) says served the request."""
    return args[0].served_by if args and isinstance(args[0], RouteTrace) else None


class ReplayRouter:
    """Answers with a stored reply, as a whole or as the stream that would have carried it."""

    def __init__(self, reply: ChatResponse, wire: str | None = None) -> None:
        self.reply, self.wire = reply, wire  # the client's wire, which the reply was stored for

    async def complete(self, request: Any, *_: Any) -> ChatResponse:
        return self.reply

    async def open_stream(self, request: Any, *_: Any) -> AsyncIterator[Event]:
        return _iterate(replay_events(self.reply, self.wire))


async def _iterate(events: list[Event]) -> AsyncIterator[Event]:
    for ev in events:
        yield ev


def replay_events(resp: ChatResponse, wire: str | None = None) -> list[Event]:
    """A stored reply as the stream that would have carried it (idempotent stream replays); to an
    Anthropic or OpenAI client as that wire's events, every key and block type included."""
    events: list[Event] = [Start(resp.id, resp.model, Usage(input_tokens=resp.usage.input_tokens))]
    reasoning = openai_t.stored_reasoning(resp.extra)
    if reasoning is not None:  # an OpenAI reply's, stored as its message key
        events += [ThinkingDelta(len(resp.content), reasoning[1]), BlockStop(len(resp.content))]
    for i, part in enumerate(resp.content):
        block: list[Event] = []
        if isinstance(part, Text):
            block.append(TextDelta(i, part.text))
        elif isinstance(part, Thinking):
            block.append(ThinkingDelta(i, part.text, part.signature))
        elif isinstance(part, ToolCall):
            block += [ToolCallStart(i, part.id, part.name), ToolArgsDelta(i, part.arguments)]
        block.append(BlockStop(i))
        # the encoder sends these as they are, the canonical ones count
        if wire == anthropic_t.WIRE:
            block[0].raw = Raw(anthropic_t.WIRE, anthropic_t.part_events(i, part))
            for ev in block[1:]:
                ev.raw = SAME_RAW
        events += block
    events.append(Finish(resp.stop_reason or StopReason.END_TURN, resp.usage, resp.stop_sequence))
    if wire == openai_t.WIRE:  # as the upstream's chunks were: every key of the message and calls
        for ev in events:
            ev.raw = Raw(openai_t.WIRE, [("", chunk) for chunk in openai_t.replay_chunks(resp, ev)])
    return events

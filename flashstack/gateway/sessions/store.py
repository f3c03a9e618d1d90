"""Sessions and their messages in the database: every write is one transaction.

A turn is serialized per session by a lease row lock (`lease_token`, `lease_until` on the session):
taken with a conditional UPDATE, renewed while the model answers, and released by the same
transaction that appends the turn. The commit only succeeds while the lease is still ours, and
`UNIQUE (session_id, seq)` is the last guard, so two replicas can never interleave a session's
messages. A replica that dies holding a lease loses it after `lease_ttl`; what it had not committed
was never written.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any, Literal

import orjson
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from flashstack.gateway.core import (
    ChatResponse,
    ErrorKind,
    GatewayError,
    Message,
    StopReason,
    ToolResult,
    invalid_request,
)
from flashstack.gateway.sessions import codec
from flashstack.gateway.sessions.db import (
    Database,
    idempotency,
    message_vectors,
    messages,
    sessions,
    summaries,
)

log = logging.getLogger("flashstack.sessions")

Order = Literal["asc", "desc"]
MAX_METADATA_PAIRS = 16


def new_id(prefix: str) -> str:
    """`prefix_` + microseconds + randomness: ids sort by creation time, as cursors expect."""
    return f"{prefix}_{time.time_ns() // 1000:014x}{secrets.token_hex(9)}"


def now_ms() -> int:
    return int(time.time() * 1000)


def not_found(session_id: str) -> GatewayError:
    return GatewayError(
        ErrorKind.NOT_FOUND,
        f"session {session_id!r} does not exist (or belongs to another key)",
        param="session_id",
        code="session_not_found",
    )


def session_busy(session_id: str, waited: float) -> GatewayError:
    return GatewayError(
        ErrorKind.RATE_LIMIT,
        f"session {session_id!r} has been busy with another turn for over {waited:.0f} s; retry "
        "later",
        status=409,
        retry_after=1,
        code="session_busy",
    )


class LeaseLost(GatewayError):
    """The turn's lease expired or its session was deleted; the turn was not stored."""

    def __init__(self, session_id: str) -> None:
        super().__init__(
            ErrorKind.INTERNAL,
            f"session {session_id!r} changed while this turn ran (deleted, or its lock expired); "
            "the turn was not stored — send it again",
            status=409,
        )


@dataclass(slots=True)
class Page:
    data: list[dict[str, Any]]
    has_more: bool

    def json(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": self.data,
            "first_id": self.data[0]["id"] if self.data else None,
            "last_id": self.data[-1]["id"] if self.data else None,
            "has_more": self.has_more,
        }


@dataclass(slots=True)
class Failure:
    """What an incomplete turn records next to the user's message."""

    type: str
    message: str


class SessionStore:
    """Session and message reads and writes for one owner at a time (the caller's key)."""

    def __init__(self, db: Database) -> None:
        self.db = db

    # ---- sessions ---------------------------------------------------------------------------

    async def create(
        self,
        owner: str,
        metadata: dict[str, str],
        model: str | None,
        system: str | None,
        max_sessions: int | None = None,
    ) -> dict[str, Any]:
        """A new session of `owner`; 403 when `owner` already has `max_sessions` (None: no cap)."""
        row = {
            "id": new_id("sess"),
            "owner": owner,
            "created_at": now_ms(),
            "metadata": orjson.dumps(check_metadata(metadata)).decode(),
            "model": model,
            "system": system,
            "next_seq": 0,
        }
        async with self.db.write() as conn:
            if max_sessions is not None:
                await self._check_session_cap(conn, owner, max_sessions)
            await conn.execute(sessions.insert().values(**row))
        return session_json(row)

    async def _check_session_cap(self, conn: AsyncConnection, owner: str, cap: int) -> None:
        # Counted in the inserting transaction, serialized per owner (SQLite: its one writer;
        # PostgreSQL: a transaction lock on the owner), so concurrent creates cannot pass the cap.
        if not self.db.is_sqlite:
            await conn.execute(
                sa.text("SELECT pg_advisory_xact_lock(7305, hashtext(:o))"), {"o": owner}
            )
        count = (
            await conn.execute(
                sa.select(sa.func.count()).select_from(sessions).where(sessions.c.owner == owner)
            )
        ).scalar_one()
        if count >= cap:
            raise GatewayError(
                ErrorKind.PERMISSION,
                f"this API key already has {count} sessions, its cap (store.max_sessions_per_key "
                f"is {cap}); "
                "delete sessions it no longer needs (DELETE /v1/sessions/{id}) or ask an admin to "
                "raise the cap",
                code="session_limit_reached",
            )

    async def get(self, owner: str, session_id: str) -> dict[str, Any]:
        async with self.db.read() as conn:
            return session_json(await _session_row(conn, owner, session_id))

    async def update(self, owner: str, session_id: str, metadata: dict[str, str]) -> dict[str, Any]:
        body = orjson.dumps(check_metadata(metadata)).decode()
        async with self.db.write() as conn:
            result = await conn.execute(
                sessions.update().where(_owned(owner, session_id)).values(metadata=body)
            )
            if result.rowcount != 1:
                raise not_found(session_id)
            return session_json(await _session_row(conn, owner, session_id))

    async def delete(self, owner: str, session_id: str) -> dict[str, Any]:
        async with self.db.write() as conn:
            result = await conn.execute(sessions.delete().where(_owned(owner, session_id)))
            if result.rowcount != 1:
                raise not_found(session_id)
            await conn.execute(messages.delete().where(messages.c.session_id == session_id))
            await conn.execute(idempotency.delete().where(idempotency.c.session_id == session_id))
            await conn.execute(
                message_vectors.delete().where(message_vectors.c.session_id == session_id)
            )
            await conn.execute(summaries.delete().where(summaries.c.session_id == session_id))
        return {"id": session_id, "object": "session.deleted", "deleted": True}

    async def list(self, owner: str, after: str | None, limit: int, order: Order) -> Page:
        check_page(limit, order)
        key = sa.tuple_(sessions.c.created_at, sessions.c.id)
        query = sessions.select().where(sessions.c.owner == owner)
        async with self.db.read() as conn:
            if after is not None:
                anchor = (
                    await conn.execute(
                        sa.select(sessions.c.created_at, sessions.c.id).where(_owned(owner, after))
                    )
                ).first()
                if anchor is None:
                    raise invalid_request(
                        f"after: {after!r} is not a session of this key; pass the last_id of a "
                        "page",
                        "after",
                    )
                bound = sa.tuple_(sa.literal(anchor.created_at), sa.literal(anchor.id))
                query = query.where(key > bound if order == "asc" else key < bound)
            ordered = (sessions.c.created_at, sessions.c.id)
            query = query.order_by(*(c.asc() if order == "asc" else c.desc() for c in ordered))
            rows = (await conn.execute(query.limit(limit + 1))).mappings().all()
        return Page([session_json(r) for r in rows[:limit]], len(rows) > limit)

    # ---- messages ---------------------------------------------------------------------------

    async def list_messages(
        self, owner: str, session_id: str, after: str | None, limit: int, order: Order
    ) -> Page:
        check_page(limit, order)
        query = messages.select().where(messages.c.session_id == session_id)
        async with self.db.read() as conn:
            await _session_row(conn, owner, session_id)
            if after is not None:
                seq = (
                    await conn.execute(
                        sa.select(messages.c.seq).where(
                            messages.c.id == after, messages.c.session_id == session_id
                        )
                    )
                ).scalar()
                if seq is None:
                    raise invalid_request(
                        f"after: {after!r} is not a message of session {session_id!r}; pass the "
                        "last_id of a page",
                        "after",
                    )
                query = query.where(
                    messages.c.seq > seq if order == "asc" else messages.c.seq < seq
                )
            query = query.order_by(
                messages.c.seq.asc() if order == "asc" else messages.c.seq.desc()
            )
            rows = (await conn.execute(query.limit(limit + 1))).mappings().all()
        return Page([message_json(r) for r in rows[:limit]], len(rows) > limit)

    async def history(self, session_id: str) -> list[Message]:
        """The completed messages, oldest first: what the model sees before the new turn."""
        return (await self.history_with_ids(session_id))[0]

    async def history_with_ids(
        self, session_id: str, max_bytes: int | None = None
    ) -> tuple[list[Message], list[str]]:
        """`history`, and each message's id (what its stored embeddings are keyed by).

        With `max_bytes`, only the newest whole turns whose stored content fits in it (sizes are
        summed by the database, so what is left out is never loaded); older turns stay stored.
        """
        completed = sa.and_(messages.c.session_id == session_id, messages.c.status == "completed")
        async with self.db.read() as conn:
            first_seq = (
                0 if max_bytes is None else await self._history_start(conn, completed, max_bytes)
            )
            if first_seq is None:
                log.info(
                    "session %s: its newest turn alone is over store.max_history_bytes=%d; no "
                    "history sent",
                    session_id,
                    max_bytes,
                )
                return [], []
            rows = (
                await conn.execute(
                    sa.select(
                        messages.c.id,
                        messages.c.role,
                        messages.c.content,
                        messages.c.wire_fields,
                        messages.c.stop_reason,
                    )
                    .where(completed, messages.c.seq >= first_seq)
                    .order_by(messages.c.seq)
                )
            ).all()
        history = [
            # a reply row (it has a stop reason) goes back upstream as a request message
            codec.message_from_row(r.role, r.content, r.wire_fields, r.stop_reason is not None)
            for r in rows
        ]
        ids = [r.id for r in rows]
        if first_seq > 0:
            history, ids = _from_user_turn(history, ids)
            log.info(
                "session %s: history from seq %d sent (store.max_history_bytes=%d)",
                session_id,
                first_seq,
                max_bytes,
            )
        return history, ids

    async def _history_start(
        self, conn: AsyncConnection, completed: Any, max_bytes: int
    ) -> int | None:
        """The first seq of the newest whole turns whose content sums to at most `max_bytes` (0: all
        of them; None: not even the newest)."""
        size = (
            sa.func.octet_length(messages.c.content)
            if not self.db.is_sqlite
            else sa.func.length(sa.cast(messages.c.content, sa.LargeBinary))
        )  # SQLite 3.40 has no octet_length
        turns = (
            await conn.execute(
                sa.select(
                    messages.c.turn_id,
                    sa.func.min(messages.c.seq).label("first"),
                    sa.func.sum(size).label("bytes"),
                )
                .where(completed)
                .group_by(messages.c.turn_id)
                .order_by(sa.func.min(messages.c.seq).desc())
            )
        ).all()
        total, start = 0, None
        for turn in turns:
            total += int(turn.bytes or 0)
            if total > max_bytes:
                return start
            start = turn.first
        return 0

    # ---- compression memory: embeddings per message, summaries per session ------------------

    async def compression_memory(self, session_id: str) -> tuple[dict[str, bytes], dict[str, str]]:
        """The session's stored message embeddings (by message id) and cluster
        summaries (by key)."""
        async with self.db.read() as conn:
            vectors = (
                await conn.execute(
                    sa.select(message_vectors.c.message_id, message_vectors.c.vectors).where(
                        message_vectors.c.session_id == session_id
                    )
                )
            ).all()
            texts = (
                await conn.execute(
                    sa.select(summaries.c.key, summaries.c.summary).where(
                        summaries.c.session_id == session_id
                    )
                )
            ).all()
        return {r.message_id: bytes(r.vectors) for r in vectors}, {r.key: r.summary for r in texts}

    async def save_summaries(self, session_id: str, new: dict[str, str]) -> None:
        """Keep cluster summaries; a key another replica stored first keeps its summary."""
        if not new:
            return
        rows = [{"s": session_id, "k": k, "v": v, "t": now_ms()} for k, v in new.items()]
        async with self.db.write(durable=False) as conn:  # a lost summary is only computed again
            await conn.execute(
                sa.text(
                    "INSERT INTO fs_summaries (session_id, key, summary, created_at) VALUES (:s, "
                    ":k, :v, :t) ON CONFLICT (session_id, key) DO NOTHING"
                ),
                rows,
            )

    async def message(self, message_id: str) -> dict[str, Any]:
        async with self.db.read() as conn:
            row = (
                (await conn.execute(messages.select().where(messages.c.id == message_id)))
                .mappings()
                .one()
            )
        return message_json(row)

    # ---- the per-session lease --------------------------------------------------------------

    async def acquire(
        self, owner: str, session_id: str, token: str, ttl: float, timeout: float
    ) -> dict[str, Any]:
        """Take the session's lease, waiting up to `timeout` s; returns the session row."""
        deadline, delay = time.monotonic() + timeout, 0.005
        while True:
            now = time.time()
            free = sa.or_(sessions.c.lease_until.is_(None), sessions.c.lease_until < now)
            async with self.db.write(durable=False) as conn:
                result = await conn.execute(
                    sessions.update()
                    .where(_owned(owner, session_id), free)
                    .values(lease_token=token, lease_until=now + ttl)
                )
                if result.rowcount == 1:
                    return dict(await _session_row(conn, owner, session_id))
            async with self.db.read() as conn:
                await _session_row(conn, owner, session_id)  # 404 rather than waiting for nothing
            if time.monotonic() > deadline:
                raise session_busy(session_id, timeout)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)

    async def renew(self, session_id: str, token: str, ttl: float) -> bool:
        async with self.db.write(durable=False) as conn:
            result = await conn.execute(
                sessions.update()
                .where(sessions.c.id == session_id, sessions.c.lease_token == token)
                .values(lease_until=time.time() + ttl)
            )
        return result.rowcount == 1

    async def release(self, session_id: str, token: str) -> None:
        async with self.db.write(durable=False) as conn:
            await _release(conn, session_id, token, 0)

    # ---- turns ------------------------------------------------------------------------------

    async def commit_turn(
        self,
        session_id: str,
        token: str,
        inputs: list[Message],
        reply: ChatResponse | None,
        failure: Failure | None = None,
        idem: tuple[str, str, str] | None = None,
        vectors: dict[int, bytes] | None = None,
        history_ids: list[str] | None = None,
        wire: str | None = None,
    ) -> list[dict[str, Any]]:
        """Append a whole turn and release the lease, in one transaction; returns the rows.

        Completed: the inputs and the reply. Failed (`failure` set, `reply` None): the inputs only,
        marked incomplete with the error, so the user's words are kept but never replayed as
        history. `vectors` are message embeddings by position in history + inputs (with
        `history_ids`); `wire` is the one the client spoke (what the messages' extras are in).
        """
        turn_id, created = new_id("turn"), now_ms()
        async with self.db.write() as conn:
            seq = (
                await conn.execute(
                    sa.select(sessions.c.next_seq).where(
                        sessions.c.id == session_id, sessions.c.lease_token == token
                    )
                )
            ).scalar()
            if seq is None:
                raise LeaseLost(session_id)
            rows = _turn_rows(session_id, turn_id, seq, created, inputs, reply, failure, wire)
            await conn.execute(messages.insert(), rows)
            if not await _release(conn, session_id, token, len(rows)):
                raise LeaseLost(session_id)
            if vectors and reply is not None:
                await _save_vectors(
                    conn, session_id, vectors, (history_ids or []) + [r["id"] for r in rows]
                )
            if idem is not None and reply is not None:
                await conn.execute(
                    idempotency.insert().values(
                        owner=idem[0],
                        key=idem[1],
                        fingerprint=idem[2],
                        session_id=session_id,
                        turn_id=turn_id,
                        response=orjson.dumps(reply_json(reply, rows[-1]["id"])).decode(),
                        created_at=created,
                    )
                )
        return rows

    async def idempotent_reply(self, owner: str, key: str) -> dict[str, Any] | None:
        async with self.db.read() as conn:
            row = (
                (
                    await conn.execute(
                        idempotency.select().where(
                            idempotency.c.owner == owner, idempotency.c.key == key
                        )
                    )
                )
                .mappings()
                .first()
            )
        return dict(row) if row else None


async def _save_vectors(
    conn: AsyncConnection, session_id: str, vectors: dict[int, bytes], ids: list[str]
) -> None:
    rows = [{"m": ids[i], "s": session_id, "v": v} for i, v in vectors.items() if i < len(ids)]
    await conn.execute(
        sa.text(
            "INSERT INTO fs_message_vectors (message_id, session_id, vectors) VALUES (:m, :s, :v) "
            "ON CONFLICT (message_id) DO UPDATE SET vectors = excluded.vectors"
        ).bindparams(sa.bindparam("v", type_=sa.LargeBinary)),
        rows,
    )


async def _release(conn: AsyncConnection, session_id: str, token: str, appended: int) -> bool:
    result = await conn.execute(
        sessions.update()
        .where(sessions.c.id == session_id, sessions.c.lease_token == token)
        .values(next_seq=sessions.c.next_seq + appended, lease_token=None, lease_until=None)
    )
    return result.rowcount == 1


def _turn_rows(
    session_id: str,
    turn_id: str,
    seq: int,
    created: int,
    inputs: list[Message],
    reply: ChatResponse | None,
    failure: Failure | None,
    wire: str | None = None,
) -> list[dict[str, Any]]:
    status = "completed" if failure is None else "incomplete"
    error = (
        orjson.dumps({"type": failure.type, "message": failure.message}).decode()
        if failure
        else None
    )
    rows = [
        _row(session_id, turn_id, seq + i, created, m, status, error, wire)
        for i, m in enumerate(inputs)
    ]
    if reply is not None and failure is None:
        # Replayed as its client got it: Anthropic's content is a list of blocks, OpenAI's a string.
        answer = Message("assistant", reply.content, reply.extra, plain=wire != codec.ANTHROPIC)
        row = _row(session_id, turn_id, seq + len(rows), created, answer, status, None, wire)
        row.update(
            model=reply.model,
            stop_reason=reply.stop_reason.value,
            usage=orjson.dumps(codec.usage_json(reply.usage)).decode(),
        )
        rows.append(row)
    return rows


def _row(
    session_id: str,
    turn_id: str,
    seq: int,
    created: int,
    m: Message,
    status: str,
    error: str | None,
    wire: str | None,
) -> dict[str, Any]:
    return {
        "id": new_id("msg"),
        "session_id": session_id,
        "seq": seq,
        "turn_id": turn_id,
        "role": m.role,
        "content": orjson.dumps(codec.parts_json(m.parts)).decode(),
        "status": status,
        "error": error,
        "model": None,
        "stop_reason": None,
        "usage": None,
        "created_at": created,
        "wire_fields": codec.message_fields_json(m, wire),
    }


def _owned(owner: str, session_id: str) -> sa.ColumnElement[bool]:
    return sa.and_(sessions.c.id == session_id, sessions.c.owner == owner)


async def _session_row(conn: AsyncConnection, owner: str, session_id: str) -> Any:
    row = (
        (await conn.execute(sessions.select().where(_owned(owner, session_id)))).mappings().first()
    )
    if row is None:
        raise not_found(session_id)
    return row


def _from_user_turn(history: list[Message], ids: list[str]) -> tuple[list[Message], list[str]]:
    """A cut history, begun at a user message that answers no tool call: one whose call was cut off
    would be refused upstream."""
    for i, m in enumerate(history):
        if m.role == "user" and not any(isinstance(p, ToolResult) for p in m.parts):
            return history[i:], ids[i:]
    return [], []


def check_message_sizes(inputs: list[Message], limit: int) -> None:
    """413 if a message, as it would be stored, is over `limit` bytes (store.max_message_bytes)."""
    for i, m in enumerate(inputs):
        size = len(orjson.dumps(codec.parts_json(m.parts)))
        if size > limit:
            raise GatewayError(
                ErrorKind.REQUEST_TOO_LARGE,
                f"messages[{i}] is {size} bytes, over the session message limit of {limit} bytes "
                "(store.max_message_bytes); nothing was stored — send it without X-Session-Id, or "
                "split it",
                param=f"messages[{i}]",
            )


def reply_too_large(limit: int) -> GatewayError:
    return GatewayError(
        ErrorKind.UPSTREAM,
        f"the model's reply is over the session message limit of {limit} bytes "
        "(store.max_message_bytes); it was not stored — ask for a shorter one (max_tokens), or "
        "raise the limit",
    )


def check_metadata(metadata: Any) -> dict[str, str]:
    """OpenAI's metadata rules: at most 16 string pairs, keys ≤ 64 and values ≤ 512 characters."""
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS:
        raise invalid_request(
            f"metadata must be an object of at most {MAX_METADATA_PAIRS} string pairs", "metadata"
        )
    for k, v in metadata.items():
        if not isinstance(v, str) or len(k) > 64 or len(v) > 512:
            raise invalid_request(
                f"metadata[{k[:64]!r}]: keys are strings of at most 64 characters, values of at "
                "most 512",
                "metadata",
            )
    return metadata


def check_page(limit: int, order: str) -> None:
    if not 1 <= limit <= 100:
        raise invalid_request(f"limit must be between 1 and 100, got {limit}", "limit")
    if order not in ("asc", "desc"):
        raise invalid_request(f"order must be 'asc' or 'desc', got {order!r}", "order")


def session_json(row: Any) -> dict[str, Any]:
    return {
        "id": row["id"],
        "object": "session",
        "created_at": row["created_at"] // 1000,
        "metadata": orjson.loads(row["metadata"]),
        "model": row["model"],
        "system": row["system"],
    }


def message_json(row: Any) -> dict[str, Any]:
    return {
        "id": row["id"],
        "object": "session.message",
        "session_id": row["session_id"],
        "turn_id": row["turn_id"],
        "role": row["role"],
        "content": orjson.loads(row["content"]),
        "status": row["status"],
        "error": orjson.loads(row["error"]) if row["error"] else None,
        "model": row["model"],
        "stop_reason": row["stop_reason"],
        "usage": orjson.loads(row["usage"]) if row["usage"] else None,
        "created_at": row["created_at"] // 1000,
    }


def reply_json(reply: ChatResponse, message_id: str) -> dict[str, Any]:
    """The canonical reply as stored for idempotent replays."""
    return {
        "id": reply.id,
        "model": reply.model,
        "content": codec.parts_json(reply.content),
        "stop_reason": reply.stop_reason.value,
        "stop_sequence": reply.stop_sequence,
        "usage": codec.usage_json(reply.usage),
        "created": reply.created,
        "message_id": message_id,
        "extra": reply.extra,
    }


def reply_from_json(d: dict[str, Any]) -> ChatResponse:
    return ChatResponse(
        d["id"],
        d["model"],
        codec.parts_from_json(d["content"]),
        StopReason(d["stop_reason"]),
        codec.usage_from_json(d["usage"]),
        d.get("stop_sequence"),
        d.get("created", 0),
        extra=d.get("extra") or {},
    )

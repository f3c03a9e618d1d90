"""The database layer on both stores: versioned migrations, SQLite in WAL mode,
whole-turn commits."""

from __future__ import annotations

import asyncio

import orjson
import pytest
import sqlalchemy as sa

from flashstack.gateway.config import ConfigError
from flashstack.gateway.core import (
    ChatRequest,
    ChatResponse,
    Message,
    StopReason,
    Text,
    ToolCall,
    Usage,
)
from flashstack.gateway.sessions import store as store_module
from flashstack.gateway.sessions.db import SCHEMA_VERSION, Database
from flashstack.gateway.sessions.store import LeaseLost, SessionStore
from flashstack.gateway.translate import openai as openai_t
from tests.gateway.sessions.support import ScratchStore


@pytest.fixture
async def db(store):
    database = await Database(store.url, store.schema).open()
    yield database
    await database.close()


async def test_migrations_are_versioned_and_idempotent(db, store):
    await db.open()  # a second start-up applies nothing
    assert store.query("SELECT version FROM fs_schema_version") == [
        (v,) for v in range(1, SCHEMA_VERSION + 1)
    ]
    if store.kind == "sqlite":
        assert store.query("PRAGMA journal_mode") == [("wal",)]


def test_start_ups_at_once_create_and_migrate_a_fresh_store(store, tmp_path):
    fresh = ScratchStore(store.kind, tmp_path)

    async def start_ups() -> None:
        # Replicas starting together: each creates the schema and migrates it, none may fail.
        databases = [Database(fresh.url, fresh.schema) for _ in range(8)]
        try:
            await asyncio.gather(*(d.open() for d in databases))
        finally:
            await asyncio.gather(*(d.close() for d in databases))

    try:
        asyncio.run(start_ups())
        assert fresh.query("SELECT version FROM fs_schema_version") == [
            (v,) for v in range(1, SCHEMA_VERSION + 1)
        ]
    finally:
        fresh.drop()


async def test_a_newer_schema_is_refused(db, store):
    async with db.write() as conn:
        await conn.execute(
            sa.text("INSERT INTO fs_schema_version (version, applied_at) VALUES (999, 0)")
        )
    with pytest.raises(ConfigError, match="newer than this flashstack"):
        await Database(store.url, store.schema).open()
    async with db.write() as conn:
        await conn.execute(sa.text("DELETE FROM fs_schema_version WHERE version = 999"))


async def test_a_turn_commits_whole_or_not_at_all(db, store, monkeypatch):
    sessions = SessionStore(db)
    s = await sessions.create("owner", {}, "gpt", None)
    reply = ChatResponse("r1", "gpt", [Text("answer")], StopReason.END_TURN, Usage(3, 1))
    await sessions.acquire("owner", s["id"], "lease-1", ttl=30, timeout=1)
    # Another holder's token cannot commit: nothing of its turn is written.
    with pytest.raises(LeaseLost):
        await sessions.commit_turn(s["id"], "someone-else", [Message("user", [Text("q")])], reply)
    assert store.query("SELECT COUNT(*) FROM fs_messages WHERE session_id = ?", s["id"]) == [(0,)]

    # A failure after the messages are inserted (here: freeing the lease) rolls them back.
    async def broken_release(*args):
        raise RuntimeError("the database went away mid-commit")

    monkeypatch.setattr(store_module, "_release", broken_release)
    with pytest.raises(RuntimeError):
        await sessions.commit_turn(s["id"], "lease-1", [Message("user", [Text("q")])], reply)
    monkeypatch.undo()
    assert store.query("SELECT COUNT(*) FROM fs_messages WHERE session_id = ?", s["id"]) == [(0,)]
    rows = await sessions.commit_turn(s["id"], "lease-1", [Message("user", [Text("q")])], reply)
    assert [(r["seq"], r["role"]) for r in rows] == [(0, "user"), (1, "assistant")]
    # The commit freed the lease: the next turn takes it at once.
    await sessions.acquire("owner", s["id"], "lease-2", ttl=30, timeout=0.5)
    await sessions.release(s["id"], "lease-2")


async def test_a_held_lease_makes_others_wait_then_refuses(db):
    sessions = SessionStore(db)
    s = await sessions.create("owner", {}, None, None)
    await sessions.acquire("owner", s["id"], "holder", ttl=30, timeout=1)
    with pytest.raises(Exception) as e:
        await sessions.acquire("owner", s["id"], "waiter", ttl=30, timeout=0.3)
    assert e.value.status == 409 and e.value.code == "session_busy"
    # An expired lease (its replica died) is taken over.
    await sessions.release(s["id"], "holder")
    await sessions.acquire("owner", s["id"], "short", ttl=0.05, timeout=1)
    await sessions.acquire("owner", s["id"], "after-expiry", ttl=30, timeout=2)


async def test_openai_replies_go_back_upstream_without_their_reply_only_keys(db, store):
    sessions = SessionStore(db)
    s = await sessions.create("owner", {}, "gpt", None)
    audio = {"id": "audio_1", "data": "UklGRg==", "expires_at": 1, "transcript": "a1"}
    answer = {
        "refusal": None,
        "annotations": [],
        "reasoning_content": "thought 1",
        "audio": audio,
        "future_key": 1,
    }
    calling = {"content": None, "reasoning_content": "thought 2", "annotations": []}
    turns = [
        ("q1", [Text("a1")], answer, StopReason.END_TURN),
        ("q2", [ToolCall("call_1", "get_weather", "{}")], calling, StopReason.TOOL_USE),
    ]
    for lease, (question, content, extra, stop) in enumerate(turns):
        reply = ChatResponse("r", "gpt", content, stop, Usage(1, 1), extra=extra)
        await sessions.acquire("owner", s["id"], f"lease-{lease}", ttl=30, timeout=1)
        await sessions.commit_turn(
            s["id"], f"lease-{lease}", [Message("user", [Text(question)])], reply, wire="openai"
        )
    history = await sessions.history(s["id"])
    req = ChatRequest("gpt", [*history, Message("user", [Text("q3")])], wire="openai")
    sent = openai_t.request_json(req, "gpt-4o-mini")["messages"]
    assert sent[1] == {
        "role": "assistant",
        "content": "a1",
        "refusal": None,
        "audio": {"id": "audio_1"},  # a request names the audio answer, nothing more
    }
    # DeepSeek's thinking mode needs a tool-calling turn's reasoning back; no other turn's.
    assert sent[3] == {
        "role": "assistant",
        "content": None,
        "reasoning_content": "thought 2",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": "{}"},
            }
        ],
    }
    # The session keeps the replies as they came.
    stored = store.query(
        "SELECT wire_fields FROM fs_messages WHERE session_id = ? AND role = 'assistant' "
        "ORDER BY seq",
        s["id"],
    )
    assert [orjson.loads(f)["extra"] for (f,) in stored] == [answer, calling]

"""The database layer on both stores: versioned migrations, SQLite in WAL mode,
whole-turn commits."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from flashstack.gateway.config import ConfigError
from flashstack.gateway.core import ChatResponse, Message, StopReason, Text, Usage
from flashstack.gateway.sessions import store as store_module
from flashstack.gateway.sessions.db import SCHEMA_VERSION, Database
from flashstack.gateway.sessions.store import LeaseLost, SessionStore


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

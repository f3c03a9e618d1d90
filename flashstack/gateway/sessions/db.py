"""The database: one async SQLAlchemy engine (two for SQLite), tables, and versioned migrations.

SQLite is the embedded default (WAL, synchronous=FULL so an acknowledged commit survives power
loss, not only a crash); PostgreSQL is for replicas. Both run the same SQL.
"""

from __future__ import annotations

import asyncio
import re
import sqlite3
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from flashstack.gateway.config import Config, ConfigError

meta = sa.MetaData()

sessions = sa.Table(
    "fs_sessions",
    meta,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("owner", sa.Text, nullable=False),
    sa.Column("created_at", sa.BigInteger, nullable=False),  # unix ms
    sa.Column("metadata", sa.Text, nullable=False),  # JSON object
    sa.Column("model", sa.Text),
    sa.Column("system", sa.Text),
    sa.Column("next_seq", sa.BigInteger, nullable=False),
    sa.Column("lease_token", sa.Text),
    sa.Column("lease_until", sa.Float),  # unix seconds
)

messages = sa.Table(
    "fs_messages",
    meta,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("session_id", sa.Text, nullable=False),
    sa.Column("seq", sa.BigInteger, nullable=False),
    sa.Column("turn_id", sa.Text, nullable=False),
    sa.Column("role", sa.Text, nullable=False),
    sa.Column("content", sa.Text, nullable=False),  # JSON list of parts
    sa.Column("status", sa.Text, nullable=False),  # completed | incomplete
    sa.Column("error", sa.Text),  # JSON {type, message} when incomplete
    sa.Column("model", sa.Text),
    sa.Column("stop_reason", sa.Text),
    sa.Column("usage", sa.Text),  # JSON
    sa.Column("created_at", sa.BigInteger, nullable=False),
    # JSON: the message's wire, its own extras, list content (codec.py)
    sa.Column("wire_fields", sa.Text),
)

idempotency = sa.Table(
    "fs_idempotency",
    meta,
    sa.Column("owner", sa.Text, primary_key=True),
    sa.Column("key", sa.Text, primary_key=True),
    sa.Column("fingerprint", sa.Text, nullable=False),
    sa.Column("session_id", sa.Text, nullable=False),
    sa.Column("turn_id", sa.Text, nullable=False),
    sa.Column("response", sa.Text, nullable=False),  # JSON of the canonical reply
    sa.Column("created_at", sa.BigInteger, nullable=False),
)

api_keys = sa.Table(
    "fs_api_keys",
    meta,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("name", sa.Text, nullable=False),
    sa.Column("key_hash", sa.Text, nullable=False, unique=True),
    sa.Column("prefix", sa.Text, nullable=False),
    sa.Column("models", sa.Text),  # JSON list; NULL: every model
    sa.Column("rpm", sa.Integer),
    sa.Column("tpm", sa.Integer),
    sa.Column("expires_at", sa.Float),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("revoked_at", sa.Float),
    sa.Column("budget_day_usd", sa.Float),  # NULL: no daily budget (UTC days)
    sa.Column("budget_month_usd", sa.Float),  # NULL: no monthly budget (UTC months)
)

# One row per chat request (gateway/requestlog.py): what it cost, and how it was routed.
requests = sa.Table(
    "fs_requests",
    meta,
    sa.Column("id", sa.Text, primary_key=True),
    # x-request-id (the client's, when it sent one)
    sa.Column("request_id", sa.Text, nullable=False),
    sa.Column("created_at", sa.BigInteger, nullable=False),  # unix ms
    sa.Column("key_id", sa.Text),  # NULL: the master key, or auth off
    sa.Column("model", sa.Text),  # as requested
    sa.Column("deployment", sa.Text),  # the one that served it
    sa.Column("status", sa.Integer, nullable=False),
    sa.Column("stream", sa.Integer, nullable=False),
    sa.Column("input_tokens", sa.BigInteger, nullable=False),  # without the cached ones
    sa.Column("output_tokens", sa.BigInteger, nullable=False),
    sa.Column("cache_read_tokens", sa.BigInteger, nullable=False),
    sa.Column("cache_write_tokens", sa.BigInteger, nullable=False),
    sa.Column("cost_usd", sa.Float, nullable=False),
    sa.Column("latency_ms", sa.Float, nullable=False),
    # JSON: attempts, ttft, error, dropped fields, wire
    sa.Column("detail", sa.Text, nullable=False),
)

# Compression memory (issue 11): each message's embeddings, and cluster summaries per session.
message_vectors = sa.Table(
    "fs_message_vectors",
    meta,
    sa.Column("message_id", sa.Text, primary_key=True),
    sa.Column("session_id", sa.Text, nullable=False),
    sa.Column("vectors", sa.LargeBinary, nullable=False),  # compress.memory.pack_vectors
)

summaries = sa.Table(
    "fs_summaries",
    meta,
    sa.Column("session_id", sa.Text, primary_key=True),
    sa.Column("key", sa.Text, primary_key=True),  # summarizer + cluster content hash
    sa.Column("summary", sa.Text, nullable=False),
    sa.Column("created_at", sa.BigInteger, nullable=False),
)

# Stored Responses (POST /v1/responses with store): what previous_response_id continues from.
responses = sa.Table(
    "fs_responses",
    meta,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("owner", sa.Text, nullable=False),
    sa.Column("created_at", sa.BigInteger, nullable=False),
    sa.Column("input_items", sa.Text, nullable=False),  # this request's own input items (JSON)
    # every item before the output: earlier turns too
    sa.Column("history", sa.Text, nullable=False),
    sa.Column("response", sa.Text, nullable=False),  # the response object as the client got it
)

# Append-only: a released version never changes, a new one is added. Plain SQL that SQLite and
# PostgreSQL both accept, so the two stores cannot drift apart.
MIGRATIONS: list[list[str]] = [
    [
        """CREATE TABLE fs_sessions (
            id TEXT PRIMARY KEY, owner TEXT NOT NULL, created_at BIGINT NOT NULL,
            metadata TEXT NOT NULL, model TEXT, system TEXT, next_seq BIGINT NOT NULL,
            lease_token TEXT, lease_until DOUBLE PRECISION)""",
        "CREATE INDEX fs_sessions_owner ON fs_sessions (owner, created_at, id)",
        """CREATE TABLE fs_messages (
            id TEXT PRIMARY KEY, session_id TEXT NOT NULL, seq BIGINT NOT NULL,
            turn_id TEXT NOT NULL,
            role TEXT NOT NULL, content TEXT NOT NULL, status TEXT NOT NULL, error TEXT,
            model TEXT, stop_reason TEXT, usage TEXT, created_at BIGINT NOT NULL,
            UNIQUE (session_id, seq))""",
        """CREATE TABLE fs_idempotency (
            owner TEXT NOT NULL, key TEXT NOT NULL, fingerprint TEXT NOT NULL,
            session_id TEXT NOT NULL, turn_id TEXT NOT NULL, response TEXT NOT NULL,
            created_at BIGINT NOT NULL, PRIMARY KEY (owner, key))""",
        """CREATE TABLE fs_api_keys (
            id TEXT PRIMARY KEY, name TEXT NOT NULL, key_hash TEXT NOT NULL UNIQUE,
            prefix TEXT NOT NULL,
            models TEXT, rpm INTEGER, tpm INTEGER, expires_at DOUBLE PRECISION,
            created_at DOUBLE PRECISION NOT NULL, revoked_at DOUBLE PRECISION)""",
    ],
    [  # 2: compression memory. BYTEA has no meaning to SQLite, which stores the blob as given.
        """CREATE TABLE fs_message_vectors (
            message_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, vectors BYTEA NOT NULL)""",
        "CREATE INDEX fs_message_vectors_session ON fs_message_vectors (session_id)",
        """CREATE TABLE fs_summaries (
            session_id TEXT NOT NULL, key TEXT NOT NULL, summary TEXT NOT NULL,
            created_at BIGINT NOT NULL,
            PRIMARY KEY (session_id, key))""",
    ],
    [  # 3: spend (gateway/spend.py): budgets per key, a row per request
        "ALTER TABLE fs_api_keys ADD COLUMN budget_day_usd DOUBLE PRECISION",
        "ALTER TABLE fs_api_keys ADD COLUMN budget_month_usd DOUBLE PRECISION",
        """CREATE TABLE fs_requests (
            id TEXT PRIMARY KEY, request_id TEXT NOT NULL, created_at BIGINT NOT NULL, key_id TEXT,
            model TEXT, deployment TEXT, status INTEGER NOT NULL, stream INTEGER NOT NULL,
            input_tokens BIGINT NOT NULL, output_tokens BIGINT NOT NULL,
            cache_read_tokens BIGINT NOT NULL,
            cache_write_tokens BIGINT NOT NULL, cost_usd DOUBLE PRECISION NOT NULL,
            latency_ms DOUBLE PRECISION NOT NULL, detail TEXT NOT NULL)""",
        "CREATE INDEX fs_requests_key ON fs_requests (key_id, created_at)",
        "CREATE INDEX fs_requests_time ON fs_requests (created_at)",
    ],
    [  # 4: stored Responses (gateway/responses_store.py)
        """CREATE TABLE fs_responses (
            id TEXT PRIMARY KEY, owner TEXT NOT NULL, created_at BIGINT NOT NULL,
            input_items TEXT NOT NULL,
            history TEXT NOT NULL, response TEXT NOT NULL)""",
        "CREATE INDEX fs_responses_owner ON fs_responses (owner, created_at)",
    ],
    [  # 5: what a message's wire gave it beyond its parts, so that history replays as sent
        "ALTER TABLE fs_messages ADD COLUMN wire_fields TEXT",
    ],
]
SCHEMA_VERSION = len(MIGRATIONS)
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
# The PostgreSQL advisory lock that serializes start-ups' schema creation and migrations.
_MIGRATION_LOCK = 7305917260
# How long a SQLite connection waits on another's lock before it reports the database locked.
_SQLITE_BUSY_MS = 30_000


def database_url(config: Config) -> str:
    """The configured URL, or the embedded SQLite file under state_dir."""
    url = config.store.database_url
    if url:
        return url
    return f"sqlite+aiosqlite:///{Path(config.state_dir) / 'flashstack.db'}"


class Database:
    """Async engines over the configured URL; `read()` and `write()` give connections."""

    def __init__(self, url: str, schema: str | None = None, pool_size: int = 10) -> None:
        self.url = sa.make_url(url)
        self.is_sqlite = self.url.get_backend_name() == "sqlite"
        if not self.is_sqlite and self.url.get_backend_name() != "postgresql":
            raise ConfigError(
                f"store.database_url {url!r}: use sqlite+aiosqlite:///PATH or postgresql+asyncpg://…"
            )
        if schema is not None and not _IDENTIFIER.match(schema):
            raise ConfigError(f"store.db_schema {schema!r} must be a plain SQL identifier")
        self.schema = schema
        if self.is_sqlite:
            self._reader = _sqlite_engine(self.url, "BEGIN")
            # One writer connection: in-process writers queue in the pool instead of spinning on
            # SQLITE_BUSY; BEGIN IMMEDIATE takes the write lock up front, so a transaction never
            # fails half-way on a lock upgrade (which busy_timeout does not retry).
            self._writer = _sqlite_engine(self.url, "BEGIN IMMEDIATE", pool_size=1)
        else:
            args: dict[str, Any] = {"server_settings": {"search_path": schema}} if schema else {}
            self._reader = self._writer = create_async_engine(
                self.url,
                pool_size=pool_size,
                max_overflow=pool_size,
                pool_pre_ping=True,
                connect_args=args,
            )

    @classmethod
    def from_config(cls, config: Config) -> Database:
        return cls(database_url(config), config.store.db_schema, config.store.pool_size)

    @asynccontextmanager
    async def read(self) -> AsyncIterator[AsyncConnection]:
        async with self._reader.connect() as conn:
            yield conn

    @asynccontextmanager
    async def write(self, durable: bool = True) -> AsyncIterator[AsyncConnection]:
        """A transaction: committed when the block ends, rolled back if it raises.

        `durable=False` (PostgreSQL) skips the commit's WAL flush: for writes a database crash may
        lose harmlessly, like taking or renewing a session lock.
        """
        async with self._writer.begin() as conn:
            if not durable and not self.is_sqlite:
                await conn.exec_driver_sql("SET LOCAL synchronous_commit TO OFF")
            yield conn

    async def open(self) -> Database:
        """Create what is missing (file, schema) and apply pending migrations."""
        if self.is_sqlite and self.url.database and self.url.database != ":memory:":
            Path(self.url.database).parent.mkdir(parents=True, exist_ok=True)
            await asyncio.to_thread(_enable_wal, self.url.database)
        if self.schema:
            async with self._writer.begin() as conn:
                # IF NOT EXISTS alone races: two replicas starting at once both try to create it.
                await conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_MIGRATION_LOCK})")
                await conn.exec_driver_sql(f'CREATE SCHEMA IF NOT EXISTS "{self.schema}"')
        await migrate(self)
        return self

    async def close(self) -> None:
        await self._reader.dispose()
        if self._writer is not self._reader:
            await self._writer.dispose()


def _enable_wal(path: str) -> None:
    """Switch the file to WAL (a setting it keeps), retrying while another start-up holds it.

    Once per open, not per connection: the switch reads, then writes the header, and where two
    connections both read first SQLite answers "locked" at once instead of waiting (its busy
    handler is skipped when waiting could deadlock), so start-ups at once retry it here.
    """
    deadline = time.monotonic() + _SQLITE_BUSY_MS / 1000
    while True:
        conn = sqlite3.connect(path, timeout=_SQLITE_BUSY_MS / 1000, isolation_level=None)
        try:
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)
            continue
        finally:
            conn.close()
        if mode.lower() != "wal":
            raise ConfigError(f"SQLite file {path}: WAL is refused (mode {mode}); use a local disk")
        return


def _sqlite_engine(url: sa.URL, begin: str, pool_size: int = 5) -> AsyncEngine:
    engine = create_async_engine(url, pool_size=pool_size, max_overflow=0, pool_timeout=120)

    @event.listens_for(engine.sync_engine, "connect")
    def _pragmas(dbapi_conn: Any, _record: Any) -> None:
        # The driver's own implicit transactions are off; `begin` below opens ours.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout={_SQLITE_BUSY_MS}")
        cur.execute("PRAGMA synchronous=FULL")  # per connection; WAL is the file's, set in open()
        cur.close()

    @event.listens_for(engine.sync_engine, "begin")
    def _begin(conn: Any) -> None:
        conn.exec_driver_sql(begin)

    return engine


async def migrate(db: Database) -> int:
    """Apply the migrations this database lacks, in one transaction; returns the schema version."""
    async with db.write() as conn:
        # Serializes concurrent start-ups: SQLite by BEGIN IMMEDIATE, PostgreSQL by this lock.
        if not db.is_sqlite:
            await conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_MIGRATION_LOCK})")
        await conn.exec_driver_sql(
            "CREATE TABLE IF NOT EXISTS fs_schema_version (version INTEGER PRIMARY KEY, applied_at "
            "BIGINT NOT NULL)"
        )
        current = (
            await conn.exec_driver_sql("SELECT MAX(version) FROM fs_schema_version")
        ).scalar() or 0
        if current > SCHEMA_VERSION:
            raise ConfigError(
                f"the database is at schema version {current}, newer than this flashstack "
                f"({SCHEMA_VERSION}); upgrade flashstack"
            )
        for version in range(current + 1, SCHEMA_VERSION + 1):
            for statement in MIGRATIONS[version - 1]:
                await conn.exec_driver_sql(statement)
            await conn.execute(
                sa.text("INSERT INTO fs_schema_version (version, applied_at) VALUES (:v, :t)"),
                {"v": version, "t": _now_ms()},
            )
    return SCHEMA_VERSION


def _now_ms() -> int:
    return int(time.time() * 1000)

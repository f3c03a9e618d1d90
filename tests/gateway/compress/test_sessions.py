"""Compression inside sessions: the session's mode, and embeddings and summaries kept in the store,
so a turn after a restart (a new app on the same database) embeds and summarizes
only what is new."""

from __future__ import annotations

import httpx
import openai
import pytest

from flashstack.gateway.app import create_app
from flashstack.gateway.compress import Compressor
from flashstack.gateway.compress.planner import Planner
from flashstack.gateway.compress.units import message_texts
from flashstack.gateway.config import CompressionConfig, Config, ModelConfig, ServerConfig
from flashstack.gateway.core import Message, Text
from tests.fakes.server import FakeServer
from tests.gateway.conftest import API_KEY
from tests.gateway.sessions.support import ScratchStore, pg_available

from .conftest import MODELS_DIR, SMALL_WINDOW
from .test_gateway import history

QUESTION = "What is the vault code?"
FOLLOW_UP = "And which city does the train leave from?"


@pytest.fixture(
    scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def store(request, tmp_path_factory):
    if request.param == "postgres" and not pg_available():
        pytest.skip("PostgreSQL is not running on 127.0.0.1:5432")
    s = ScratchStore(request.param, tmp_path_factory.mktemp(request.param))
    yield s
    s.drop()


class Counts:
    """Texts the embedding model ran on, and extractive summaries written, since the last reset."""

    def __init__(self) -> None:
        self.encoded: list[str] = []
        self.summaries = 0


@pytest.fixture
def counts(monkeypatch):
    from flashstack.gateway.compress.embed import Embedder

    c = Counts()

    def load(self):  # a fresh embedder per app, as after a restart; it records what it encodes
        e = Embedder(MODELS_DIR)
        encode = e.encode
        e.encode = lambda texts, *budget: (c.encoded.extend(texts), encode(texts, *budget))[1]
        return e

    summarize = Planner.extractive_summary

    def counted(self, *args):
        c.summaries += 1
        return summarize(self, *args)

    monkeypatch.setattr(Compressor, "_load_embedder", load)
    monkeypatch.setattr(Planner, "extractive_summary", counted)
    return c


class Gateway:
    """One app instance on the shared store; `restart` is a new instance on the same database."""

    def __init__(self, upstreams, store: ScratchStore, tmp) -> None:
        self.config = Config(
            server=ServerConfig(max_body_bytes=4 * 1024 * 1024),
            models=[
                ModelConfig(
                    name="tiny",
                    provider="openai",
                    model="gpt-4-0613",
                    context_window=SMALL_WINDOW,
                    max_output_tokens=100,
                    api_base=upstreams["openai"].url + "/v1",
                    api_key=API_KEY,
                )
            ],
            store=store.config(),
            compression=CompressionConfig(cache_dir=MODELS_DIR, preload=True),
            state_dir=tmp,
        )
        self.server: FakeServer | None = None

    def start(self) -> Gateway:
        self.server = FakeServer(create_app(self.config), lifespan="on", loop="uvloop").start()
        # preloaded: no request is truncated meanwhile
        assert self.server.app.services.compressor.wait_loaded(60)
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.url

    def session(self, **metadata: str) -> str:
        r = httpx.post(self.url + "/v1/sessions", json={"model": "tiny", "metadata": metadata})
        assert r.status_code == 200, r.text
        return r.json()["id"]

    def chat(self, sid: str, messages: list[dict], **extra) -> httpx.Headers:
        client = openai.OpenAI(
            base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60
        )
        raw = client.chat.completions.with_raw_response.create(
            model="tiny",
            messages=messages,
            extra_headers={"x-session-id": sid},
            extra_body=extra or None,
        )
        raw.parse()
        return raw.headers

    def post(self, sid: str, text: str, **extra) -> httpx.Response:
        r = httpx.post(
            f"{self.url}/v1/sessions/{sid}/messages", json={"content": text, **extra}, timeout=60
        )
        assert r.status_code == 200, r.text
        return r


@pytest.fixture
def gateway(upstreams, store, tmp_path, counts):  # counts first: the embedder preloads at start
    g = Gateway(upstreams, store, tmp_path).start()
    yield g
    g.stop()


def long_history() -> list[dict]:
    return [*history(40), {"role": "user", "content": QUESTION}]


def test_bad_session_mode_is_400_at_create_and_update(gateway):
    r = httpx.post(gateway.url + "/v1/sessions", json={"metadata": {"compression": "squash"}})
    assert r.status_code == 400 and "metadata.compression" in r.json()["error"]["message"]
    sid = gateway.session(compression="off")
    r = httpx.post(f"{gateway.url}/v1/sessions/{sid}", json={"metadata": {"compression": "zip"}})
    assert r.status_code == 400 and "auto, off, truncate" in r.json()["error"]["message"]
    assert httpx.get(f"{gateway.url}/v1/sessions/{sid}").json()["metadata"] == {
        "compression": "off"
    }


def test_session_mode_applies_to_every_turn_unless_the_request_overrides_it(gateway, upstreams):
    sid = gateway.session(compression="off")
    headers = gateway.chat(sid, long_history())
    # the session said off: the model got all of it
    assert "x-flashstack-compression" not in headers
    r = gateway.post(sid, "Anything else?")  # the session endpoint too
    assert "x-flashstack-compression" not in r.headers
    assert r.json()["usage"]["input_tokens"] >= sum(
        len(m["content"].split()) for m in long_history()
    )
    r = gateway.post(sid, "And now?", compression="auto")  # the request wins over the session
    assert r.headers["x-flashstack-compression"] == "compressed"
    headers = gateway.chat(sid, [{"role": "user", "content": "Once more?"}], compression="truncate")
    assert headers["x-flashstack-compression"] == "truncated"

    sid = gateway.session(compression="truncate")
    assert gateway.chat(sid, long_history())["x-flashstack-compression"] == "truncated"
    assert gateway.post(sid, "Next?").headers["x-flashstack-compression"] == "truncated"
    r = httpx.post(f"{gateway.url}/v1/sessions/{sid}", json={"metadata": {"compression": "auto"}})
    assert r.status_code == 200
    assert gateway.post(sid, "And next?").headers["x-flashstack-compression"] == "compressed"


def test_bad_compression_on_a_session_turn_is_400(gateway):
    sid = gateway.session()
    r = httpx.post(
        f"{gateway.url}/v1/sessions/{sid}/messages", json={"content": "hi", "compression": "zip"}
    )
    assert r.status_code == 400 and "compression" in r.json()["error"]["message"]
    assert httpx.get(f"{gateway.url}/v1/sessions/{sid}/messages").json()["data"] == []


def test_bad_compression_on_a_chat_joined_to_a_session_changes_nothing(gateway):
    sid = gateway.session()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "compression": "zip"}
    r = httpx.post(
        f"{gateway.url}/v1/chat/completions", json=body, headers={"x-session-id": sid}, timeout=30
    )
    assert r.status_code == 400 and "compression" in r.json()["error"]["message"]
    assert httpx.get(f"{gateway.url}/v1/sessions/{sid}/messages").json()["data"] == []


def test_pinned_indexes_count_from_the_callers_own_messages():
    from flashstack.gateway.compress import shift_pinned
    from flashstack.gateway.core import ChatRequest, Message, Text

    req = ChatRequest(
        "m",
        [Message("user", [Text("x")])],
        extensions={"compression": {"mode": "auto", "pinned": [0, 2]}},
    )
    shift_pinned(req, 5)
    assert req.extensions["compression"]["pinned"] == [5, 7]
    shift_pinned(req, 0)
    assert req.extensions["compression"]["pinned"] == [5, 7]


def _turn_two(gateway: Gateway, store: ScratchStore, counts: Counts, sid: str) -> tuple[int, int]:
    """Restart, post the follow-up; (texts encoded, summaries written) by that turn."""
    gateway.stop()
    gateway.start()
    counts.encoded.clear()
    counts.summaries = 0
    r = gateway.post(sid, FOLLOW_UP)
    assert r.headers["x-flashstack-compression"] == "compressed"
    return len(counts.encoded), counts.summaries


def test_after_a_restart_a_turn_embeds_and_summarizes_only_what_is_new(gateway, store, counts):
    warm = gateway.session()
    gateway.chat(warm, long_history())
    assert counts.encoded and counts.summaries  # the first turn embedded and summarized cold
    first = set(counts.encoded)
    assert (
        store.query("SELECT COUNT(*) FROM fs_message_vectors WHERE session_id = ?", warm)[0][0]
        >= 40
    )
    n_summaries = store.query("SELECT COUNT(*) FROM fs_summaries WHERE session_id = ?", warm)[0][0]
    assert n_summaries > 0
    # the same conversation, its memory then wiped: what turn two costs without it
    cold = gateway.session()
    gateway.chat(cold, long_history())
    store.query("DELETE FROM fs_message_vectors WHERE session_id = ?", cold)
    store.query("DELETE FROM fs_summaries WHERE session_id = ?", cold)

    encoded, summarized = _turn_two(gateway, store, counts, warm)
    # Nothing embedded before the restart was embedded again; of whole messages, only turn one's
    # reply (never history before) and the follow-up were new. (A cluster that is new this turn may
    # still embed sentences of old messages that no summary needed before.)
    assert not set(counts.encoded) & first
    reply = Message("assistant", [Text(f"echo: {QUESTION}")])
    new = set(message_texts(reply)) | set(message_texts(Message("user", [Text(FOLLOW_UP)])))
    whole = {m["content"] for m in long_history()}
    assert FOLLOW_UP in counts.encoded and not set(counts.encoded) & (whole - new)
    cold_encoded, cold_summarized = _turn_two(gateway, store, counts, cold)
    assert cold_encoded >= 30 > encoded
    assert summarized < cold_summarized  # clusters summarized in turn one came from the store
    rows = store.query("SELECT COUNT(*) FROM fs_summaries WHERE session_id = ?", warm)[0][0]
    assert rows == n_summaries + summarized


def test_deleting_a_session_deletes_its_memory(gateway, store):
    sid = gateway.session()
    gateway.chat(sid, long_history())
    assert (
        store.query("SELECT COUNT(*) FROM fs_message_vectors WHERE session_id = ?", sid)[0][0] > 0
    )
    assert httpx.delete(f"{gateway.url}/v1/sessions/{sid}").status_code == 200
    assert store.query("SELECT COUNT(*) FROM fs_message_vectors WHERE session_id = ?", sid) == [
        (0,)
    ]
    assert store.query("SELECT COUNT(*) FROM fs_summaries WHERE session_id = ?", sid) == [(0,)]


class MemoryStore:
    """The two store calls compression makes, in memory: what another replica would read back."""

    def __init__(self) -> None:
        self.vectors: dict[str, bytes] = {}
        self.summaries: dict[str, str] = {}

    async def compression_memory(self, session_id):
        return dict(self.vectors), dict(self.summaries)

    async def save_summaries(self, session_id, new):
        self.summaries.update(new)


class FakeTurn:
    """A turn of session `s` whose history is every message but the last."""

    def __init__(
        self, store: MemoryStore, messages: list[Message], metadata: dict | None = None
    ) -> None:
        self.sessions = type("S", (), {"store": store})()
        self.session_id, self.in_session = "s", True
        self.history, self.inputs = messages[:-1], messages[-1:]
        self.history_ids = [f"msg_{i}" for i in range(len(self.history))]
        self.vectors: dict[int, bytes] = {}
        self._metadata = metadata or {}

    def metadata(self):
        return self._metadata


async def test_llm_summaries_are_kept_per_session_across_replicas(embedder):
    from flashstack.gateway.compress import SessionMemory

    from .conftest import long_conversation, model
    from .test_pipeline import StubRouter

    store, req = MemoryStore(), long_conversation(60)
    routers = [StubRouter("Short summary."), StubRouter("Short summary.")]
    replicas = [
        Compressor(CompressionConfig(summarizer="llm"), MODELS_DIR.parent, r, embedder=embedder)
        for r in routers
    ]
    out, _ = await replicas[0].compress(
        req, model(), 1200, memory=SessionMemory.of(FakeTurn(store, req.messages))
    )
    assert (
        "- Short summary." in out.system[-1].text and routers[0].calls == len(store.summaries) > 0
    )
    assert all(k for k in store.summaries)
    # Another replica (no in-process cache) summarizes none of those clusters again.
    again, _ = await replicas[1].compress(
        req, model(), 1200, memory=SessionMemory.of(FakeTurn(store, req.messages))
    )
    assert routers[1].calls == 0 and again.system == out.system
    # Without a session the replica has nothing to reuse: the in-process cache is per replica.
    await replicas[1].compress(req, model(), 1200)
    assert routers[1].calls == routers[0].calls


def test_pinned_on_a_responses_turn_names_the_callers_own_input(gateway, upstreams):
    sid = gateway.session(compression="off")
    gateway.chat(sid, long_history())  # 41 stored messages and the reply come before this turn
    fillers = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"Filler {i}. " + "words " * 30}
        for i in range(12)
    ]
    pinned = {"role": "user", "content": "Remember this: the launch word is heliotrope."}
    body = {
        "model": "tiny",
        "input": [pinned, *fillers, {"role": "user", "content": "What is the launch word?"}],
        "compression": {"mode": "truncate", "pinned": [0]},
    }
    r = httpx.post(
        f"{gateway.url}/v1/responses", json=body, headers={"x-session-id": sid}, timeout=60
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-flashstack-compression"] == "truncated"
    # the last chat request: a health probe (no body) may have come after it
    chats = [q for q in upstreams["openai"].requests if q.path.endswith("/chat/completions")]
    sent = str(chats[-1].body["messages"])
    # index 0 is the caller's first input item, not the session's oldest stored message
    assert "heliotrope" in sent
    assert "Turn 0." not in sent

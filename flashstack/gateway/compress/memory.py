"""What a session lends compression: its mode, its messages' stored embeddings and its summaries.

Embeddings are stored per message as float16 rows, one per `message_texts` entry, so the next
turn of a session never embeds its history again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flashstack.gateway import tokens
from flashstack.gateway.compress.budget import Budget
from flashstack.gateway.compress.options import session_mode
from flashstack.gateway.compress.units import chunks, message_texts
from flashstack.gateway.config import CompressionMode
from flashstack.gateway.core import Message

if TYPE_CHECKING:
    import numpy as np  # imported where used: 16 MB a gateway that never compresses need not hold

    from flashstack.gateway.compress.embed import Embedder

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SessionMemory:
    """What a session lends compression: its mode, and its stored message embeddings and
    summaries."""

    turn: Any  # sessions.turns.Turn: history (with ids) + inputs are req.messages' first messages
    mode: CompressionMode | None

    @classmethod
    def of(cls, turn: Any) -> SessionMemory:
        return cls(turn, session_mode(turn.metadata()))

    async def load(self) -> tuple[dict[str, bytes], dict[str, str]]:
        return await self.turn.sessions.store.compression_memory(self.turn.session_id)

    async def save_summaries(self, new: dict[str, str]) -> None:
        try:
            await self.turn.sessions.store.save_summaries(self.turn.session_id, new)
        except Exception:  # a summary not kept is computed again next turn; the turn goes on
            log.exception("could not store summaries of session %s", self.turn.session_id)


def pack_vectors(vectors: Sequence[np.ndarray | None]) -> bytes:
    """float16 rows, one per `message_texts` entry; NaN rows for texts never embedded."""
    import numpy as np

    from flashstack.gateway.compress.embed import DIM

    out = np.full((len(vectors), DIM), np.nan, np.float16)
    for i, v in enumerate(vectors):
        if v is not None:
            out[i] = v
    return out.tobytes()


def unpack_vectors(blob: bytes) -> np.ndarray:
    import numpy as np

    from flashstack.gateway.compress.embed import DIM

    return np.frombuffer(blob, np.float16).reshape(-1, DIM).astype(np.float32)


def seed_vectors(
    embedder: Embedder, messages: Sequence[Message], ids: Sequence[str], stored: dict[str, bytes]
) -> int:
    """Put the stored embeddings of the history's messages into the embedder's cache; returns
    how many."""
    import numpy as np

    pairs = []
    for m, mid in zip(messages, ids):
        blob = stored.get(mid)
        if blob is None:
            continue
        texts, rows = message_texts(m), unpack_vectors(blob)
        if len(rows) != len(texts):  # stored by a build that split texts differently: recompute
            continue
        pairs += [(t, r) for t, r in zip(texts, rows) if not np.isnan(r[0])]
    embedder.seed(pairs)
    return len(pairs)


def new_vectors(
    embedder: Embedder,
    messages: Sequence[Message],
    ids: Sequence[str],
    n_history: int,
    n_session: int,
    stored: dict[str, bytes],
    budget: Budget | None = None,
) -> dict[int, bytes]:
    """Embeddings to store, by message position: the new inputs' (embedded now if the plan did
    not), and any history message whose known embeddings grew since they were stored."""
    import numpy as np

    new_chunks = [c for m in messages[n_history:n_session] for c in chunks(tokens.message_text(m))]
    if new_chunks:
        embedder.embed(new_chunks, budget)  # the next turn reads them from the store instead
    out = {}
    for i, m in enumerate(messages[:n_session]):
        known = embedder.known(message_texts(m))
        n_known = sum(v is not None for v in known)
        blob = stored.get(ids[i]) if i < len(ids) else None
        n_stored = 0 if blob is None else int((~np.isnan(unpack_vectors(blob)[:, 0])).sum())
        if n_known > n_stored:
            out[i] = pack_vectors(known)
    return out

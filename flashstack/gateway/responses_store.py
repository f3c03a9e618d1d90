"""Stored Responses (`store: true`): the response, its input, and every item before it, per owner.

`previous_response_id` continues from a stored response: its history (earlier turns' items and
its own input) and its output are the new request's first items. Owners see only their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
import sqlalchemy as sa

from flashstack.gateway.core import ErrorKind, GatewayError
from flashstack.gateway.sessions.db import Database, responses
from flashstack.gateway.sessions.store import now_ms


@dataclass(slots=True)
class Stored:
    input_items: list[dict[str, Any]]
    history: list[dict[str, Any]]  # every item before this response's output
    response: dict[str, Any]

    def items_after(self) -> list[dict[str, Any]]:
        """What a request continuing from this response starts with."""
        return self.history + list(self.response.get("output") or [])


def not_found(response_id: str) -> GatewayError:
    return GatewayError(
        ErrorKind.NOT_FOUND,
        f"response {response_id!r} does not exist (or is another key's)",
        param="previous_response_id",
        code="not_found",
    )


class ResponseStore:
    """Reads and writes of fs_responses, always scoped to one owner."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def save(
        self,
        owner: str,
        input_items: list[dict[str, Any]],
        history: list[dict[str, Any]],
        response: dict[str, Any],
    ) -> None:
        row = {
            "id": response["id"],
            "owner": owner,
            "created_at": now_ms(),
            "input_items": orjson.dumps(input_items).decode(),
            "history": orjson.dumps(history).decode(),
            "response": orjson.dumps(response).decode(),
        }
        async with self.db.write() as conn:
            await conn.execute(sa.insert(responses).values(**row))

    async def get(self, owner: str, response_id: str) -> Stored:
        """The owner's stored response; 404 for an unknown id or another owner's."""
        query = sa.select(responses.c.input_items, responses.c.history, responses.c.response).where(
            responses.c.id == response_id, responses.c.owner == owner
        )
        async with self.db.read() as conn:
            row = (await conn.execute(query)).first()
        if row is None:
            raise not_found(response_id)
        return Stored(orjson.loads(row[0]), orjson.loads(row[1]), orjson.loads(row[2]))

    async def delete(self, owner: str, response_id: str) -> None:
        async with self.db.write() as conn:
            done = await conn.execute(
                sa.delete(responses).where(
                    responses.c.id == response_id, responses.c.owner == owner
                )
            )
        if done.rowcount == 0:
            raise not_found(response_id)

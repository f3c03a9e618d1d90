"""What compressing one request may spend on the embedding model: word pieces and a deadline."""

from __future__ import annotations

import time
from dataclasses import dataclass


class BudgetExceeded(Exception):
    """The request's embedding budget (model tokens or time) is spent; what it embedded stays
    cached."""


@dataclass(slots=True)
class Budget:
    """What one request may spend on the model: word pieces read (padding included), a deadline."""

    tokens: int
    deadline: float  # time.monotonic()

    @classmethod
    def of(cls, tokens: int, seconds: float) -> Budget:
        return cls(tokens, time.monotonic() + seconds)

    def spend(self, tokens: int) -> None:
        if time.monotonic() > self.deadline:
            raise BudgetExceeded("time")
        if tokens > self.tokens:
            raise BudgetExceeded("tokens")
        self.tokens -= tokens

"""Which of several healthy deployments of one model takes the next request."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Literal, Protocol

Strategy = Literal["weighted_random", "least_in_flight", "lowest_latency"]


class Candidate(Protocol):
    weight: float
    in_flight: int  # across replicas when the state is shared
    latency: float | None  # recent time to first token (streams) or to the response, seconds


def choose(candidates: Sequence[Candidate], strategy: Strategy) -> int:
    """Index of the chosen candidate (there is at least one)."""
    if len(candidates) == 1:
        return 0
    if strategy == "least_in_flight":
        return _lowest([c.in_flight for c in candidates])
    if strategy == "lowest_latency":
        # An unmeasured deployment counts as fastest, so every deployment gets measured.
        return _lowest([c.latency if c.latency is not None else 0.0 for c in candidates])
    weights = [max(c.weight, 0.0) for c in candidates]
    if sum(weights) <= 0:
        weights = [1.0] * len(candidates)
    return random.choices(range(len(candidates)), weights)[0]


def _lowest(values: Sequence[float]) -> int:
    best = min(values)
    return random.choice([i for i, v in enumerate(values) if v == best])  # ties spread the load

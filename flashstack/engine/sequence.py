"""A request's tokens, progress through the KV cache, and its block table."""

from __future__ import annotations

import enum
import itertools
import time

import torch

from flashstack.engine.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its KV blocks in the host pool
    FINISHED = "finished"


_seq_counter = itertools.count()


class Sequence:
    """One request: its tokens, how many have K/V in the cache, and which blocks hold them."""

    __slots__ = (
        "seq_id",
        "request_id",
        "token_ids",
        "num_prompt_tokens",
        "num_computed_tokens",
        "num_cached_tokens",
        "block_table",
        "block_hashes",
        "status",
        "params",
        "priority",
        "arrival_time",
        "first_scheduled_time",
        "first_token_time",
        "finished_time",
        "finish_reason",
        "generator",
        "logprobs",
        "num_preemptions",
        "stop_reason",
        "matcher",
    )

    def __init__(
        self,
        token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
    ) -> None:
        self.seq_id = next(_seq_counter)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # tokens served from the prefix cache at the last admission
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chain hashes of this sequence's leading full blocks
        self.status = SequenceStatus.WAITING
        self.params = params
        self.priority = priority
        # Request timeline (time.monotonic()), for TTFT / TPOT / queue-time metrics.
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.generator: torch.Generator | None = None
        self.logprobs: list[dict[int, float]] = []
        self.num_preemptions = 0
        self.matcher = None  # a guided request's grammar state (flashstack.engine.guided)

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.request_id!r}, len={len(self)}, "
            f"computed={self.num_computed_tokens}, "
            f"blocks={self.block_table}, status={self.status.value})"
        )

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt as given."""
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        """Tokens generated so far."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        """How many tokens were generated."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model before the next sample."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        """True once a finish reason is set."""
        return self.status is SequenceStatus.FINISHED

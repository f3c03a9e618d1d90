"""The types one forward step passes between the runner and tensor parallelism (engine/tp/), so
that both import down to here and neither imports the other's internals."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from flashstack.engine.kernels.attention import AttentionMetadata

if TYPE_CHECKING:
    from flashstack.engine.model_runner import ModelRunner


@dataclass(slots=True)
class StepInputs:
    """Device tensors for one forward pass, plus which rows get sampled."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # indices into the packed tokens whose logits are sampled
    sample_seqs: list[int]  # positions in batch.seqs that sample this step


@dataclass(frozen=True, slots=True)
class GraphStep:
    """A decode step replayed from a captured graph: its key (cuda_graphs.DecodeGraphs), `size`
    packed int64 inputs."""

    key: int
    size: int


@dataclass(frozen=True, slots=True)
class CaptureGraphs:
    """Capture the decode graphs now, alongside rank 0, for contexts up to `max_model_len`."""

    max_model_len: int


# Called between staging a graph step and replaying it: (graph key, packed inputs).
StepHook = Callable[[int, torch.Tensor], None]
# The first kernel of every decode graph: fills the packed inputs in place (a group's broadcast).
ShareInputs = Callable[[torch.Tensor], None]


class StepBroadcast:
    """Where rank 0's runner sends each step for the other ranks. This one has no other ranks: every
    call is a no-op (one GPU, or CPU). tp/worker.GroupBroadcast sends to a tensor-parallel group."""

    # Eager decode steps may be queued ahead of the host (ModelRunner.launch): nobody else must see
    # their host-built inputs first.
    queues_eager_steps = True

    def send(self, inputs: StepInputs) -> None:
        """Hand a host-built step to the other ranks (none here)."""

    def before_capture(self, runner: ModelRunner, max_model_len: int) -> ShareInputs | None:
        """Prepare the other ranks to capture alongside; returns the graphs' input broadcast, if
        any."""
        return None

    def replay_hook(self, share: ShareInputs | None) -> StepHook | None:
        """What to call before each graph replay (announce the step to the other ranks)."""
        return None

    def close(self) -> None:
        """Stop the other ranks (none here)."""

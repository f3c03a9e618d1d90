"""A ring of pinned host slots a decode graph fetches its step's inputs from (KernelOptions.
graph_fetches_inputs; the device side is kernels/triton_step_inputs.py).

Each slot is a header, the sequence number of the step it holds, then that step's packed values.
The host writes step s into slot s % slots, values first and the header last, and never rewrites a
slot before the replay queued behind its last write has finished (an event a slot), so a replay
reads a whole step or, header not matching, none. The graph's sampler writes step s's tokens into
row s % slots of `tokens`, which the host reads once that replay is done (`TokensRead`): no copy
back on the stream either.
"""

from __future__ import annotations

import numpy as np
import torch

# Slots in the ring: a step is written while at most the one before it is queued (the engine's
# lookahead), so a slot's event has long completed by the time it comes round again.
RING_SLOTS = 4


class InputRing:
    """`slots` pinned slots of `capacity` int64 values each, and the device's half of the protocol:
    `state` (the sequence number last taken, and the fetch kernel's arrival count)."""

    def __init__(
        self, capacity: int, device: torch.device, slots: int = RING_SLOTS, rows: int = 1
    ) -> None:
        pinned = device.type == "cuda"  # the device reads the slots over the bus
        self.host = torch.zeros(slots, 1 + capacity, dtype=torch.int64, pin_memory=pinned)
        self._view = self.host.numpy()
        # a step's tokens, `rows` at most, written by the device
        self.tokens = torch.zeros(slots, rows, dtype=torch.int64, pin_memory=pinned)
        self.state = torch.zeros(2, dtype=torch.int64, device=device)
        self.slots, self.capacity = slots, capacity
        self.written = 0  # sequence number of the last step written
        self._replayed: list[torch.cuda.Event | None] = [None] * slots

    def write(self, values: list[int] | np.ndarray) -> int:
        """Put the next step's values in its slot (waiting only if that slot's last replay has
        not finished); returns the slot, for `queued`."""
        seq = self.written + 1
        slot = seq % self.slots
        event = self._replayed[slot]
        if event is not None:
            event.synchronize()
        row = self._view[slot]
        n = len(values)
        assert n <= self.capacity, f"{n} values: the ring's slots hold {self.capacity}"
        row[1 : 1 + n] = values
        row[0] = seq  # last: a reader that sees this number sees the values before it
        self.written = seq
        return slot

    def queued(self, slot: int) -> None:
        """Mark `slot` in use until the work queued on the current stream so far (its replay) is
        done."""
        event = self._replayed[slot]
        if event is None:
            event = self._replayed[slot] = torch.cuda.Event()
        event.record()

    def tokens_read(self, n: int) -> TokensRead:
        """The reader of the last written step's n tokens (after `queued`)."""
        slot = self.written % self.slots
        event = self._replayed[slot]
        assert event is not None, "the step's replay is queued first"
        return TokensRead(self, self.written, event, n)


class TokensRead:
    """One step's tokens in the ring: `wait()` returns them once its replay is done (as
    flashstack.cuda's HostCopy does for a copy)."""

    def __init__(self, ring: InputRing, seq: int, done: torch.cuda.Event, n: int) -> None:
        self._ring, self._seq, self._done, self._n = ring, seq, done, n
        self._values: list[int] | None = None

    def wait(self) -> list[int]:
        if self._values is None:
            # the slot's event and row serve a later step once the ring comes round
            assert self._ring.written < self._seq + self._ring.slots, (
                "read before its slot is reused"
            )
            self._done.synchronize()
            slot = self._seq % self._ring.slots
            self._values = self._ring.tokens[slot, : self._n].tolist()
        return self._values

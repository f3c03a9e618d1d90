"""Swap preemption: a host KV pool, its block accounting, the swap-or-recompute cost estimate, and
the copies that move a preempted sequence's blocks out to host memory and back.

On CUDA the pool is page-locked memory (a `flashstack.cuda.PinnedBuffer`) and the copies run on a
`flashstack.cuda.Stream` of their own, ordered against torch's compute stream by events, so the
host never waits for them. On CPU the pool is just another CPU tensor, so CI tests the same logic.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from flashstack.engine.config import EngineConfig

log = logging.getLogger(__name__)

_GB = 1e9

# Defaults for the cost estimate, per device type: (host<->device bandwidth in GB/s, FLOP rate of a
# recomputing prefill in TFLOP/s). CUDA: pinned H2D measured at 55 GB/s on the H200 host
# (docs/benchmarks.md), taken as 50 for both directions; prefill at a third of the H200's ~990 bf16
# TFLOP/s. CPU: a memcpy at ~10 GB/s against ~0.2 TFLOP/s of matmuls on a few cores.
DEVICE_DEFAULTS = {"cuda": (50.0, 330.0), "cpu": (10.0, 0.2)}


class HostBlockPool:
    """Host KV block ids: O(1) allocate/free, plus the swapped-out sequences that own them."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.tables: dict[int, list[int]] = {}  # seq_id -> host block ids, in block-table order

    @property
    def num_free_blocks(self) -> int:
        """Host blocks no swapped sequence holds."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Host blocks held by swapped-out sequences."""
        return self.num_blocks - len(self._free)

    def allocate(self, seq_id: int, n: int) -> list[int]:
        """Take `n` host blocks for sequence `seq_id`."""
        if n > len(self._free):
            raise RuntimeError("out of host KV blocks: check can_swap_out first")
        ids = [self._free.pop() for _ in range(n)]
        self.tables[seq_id] = ids
        return ids

    def release(self, seq_id: int) -> list[int]:
        """Return `seq_id`'s host blocks to the pool; its table (empty if it held none)."""
        ids = self.tables.pop(seq_id, [])
        self._free.extend(reversed(ids))
        return ids

    def check_invariants(self) -> None:
        """Raise AssertionError unless free + used == total and each block has one owner."""
        held = [b for ids in self.tables.values() for b in ids]
        assert len(held) == len(set(held)), "a host block is held twice"
        assert not set(held) & set(self._free), "a held host block is also free"
        assert len(held) + len(self._free) == self.num_blocks, "host free + used != total"


@dataclass(slots=True)
class PreemptionCost:
    """Chooses swap or recompute for a victim by the seconds each would cost.

    swap: its computed blocks cross the host link twice (out now, in later) at `bandwidth` B/s.
    recompute: a prefill of its computed tokens at `flops` FLOP/s: 2 * params per token for the
    matmuls plus 4 * layers * heads * head_dim per (query, key) pair, n^2 / 2 pairs for causal
    attention. Prefix-cache hits that would make recompute cheaper are not counted.
    """

    mode: str  # "auto", "swap" or "recompute"
    bytes_per_block: int
    params: int
    attn_flops_per_pair: int
    bandwidth: float  # bytes/s
    flops: float  # FLOP/s

    @classmethod
    def for_model(
        cls,
        config: EngineConfig,
        model: torch.nn.Module,
        args: Any,
        bytes_per_block: int,
        device: torch.device,
    ) -> PreemptionCost:
        """The estimate for `model` on `device`, with the config's constants where set."""
        bw, tflops = DEVICE_DEFAULTS.get(device.type, DEVICE_DEFAULTS["cuda"])
        bw = config.swap_bandwidth_gbps or bw
        tflops = config.recompute_tflops or tflops
        params = sum(p.numel() for p in model.parameters())
        attn = 4 * args.num_layers * args.num_heads * args.head_dim
        return cls(config.preemption_mode, bytes_per_block, params, attn, bw * _GB, tflops * 1e12)

    def swap_seconds(self, num_blocks: int) -> float:
        """Time to move `num_blocks` out to host memory and back."""
        return 2 * num_blocks * self.bytes_per_block / self.bandwidth

    def recompute_seconds(self, num_tokens: int) -> float:
        """Time to prefill `num_tokens` tokens again."""
        flops = 2 * self.params * num_tokens + self.attn_flops_per_pair * num_tokens**2 / 2
        return flops / self.flops

    def prefers_swap(self, num_blocks: int, num_tokens: int) -> bool:
        """True when the mode says swap, or it is "auto" and swapping is estimated cheaper."""
        if self.mode != "auto":
            return self.mode == "swap"
        return self.swap_seconds(num_blocks) < self.recompute_seconds(num_tokens)


def num_host_blocks(config: EngineConfig, bytes_per_block: int) -> int:
    """Host KV blocks for swapping: 0 when swap is off (recompute mode, or tensor parallel)."""
    if config.preemption_mode == "recompute":
        return 0
    if config.tensor_parallel_size > 1:
        # Every rank would need its own host pool and copies driven by rank 0's step messages.
        log.warning(
            "swap preemption is single-GPU only for now: tensor_parallel_size=%d "
            "preempts by recompute",
            config.tensor_parallel_size,
        )
        return 0
    n = int(config.swap_space_gb * (1 << 30)) // bytes_per_block
    if config.max_model_len is not None:
        # Only running sequences are swapped, so more than all of them at full length is waste.
        n = min(n, config.max_num_seqs * -(-config.max_model_len // config.block_size))
    if n == 0 and config.preemption_mode == "swap":
        raise ValueError(
            f"swap_space_gb={config.swap_space_gb} holds no KV block of {bytes_per_block} bytes: "
            "raise swap_space_gb or use preemption_mode='recompute'"
        )
    return n


def block_runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(src, dst) block pairs merged into (src, dst, count) runs consecutive on both sides."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in pairs:
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            s, d, k = runs[-1]
            runs[-1] = (s, d, k + 1)
        else:
            runs.append((src, dst, 1))
    return runs


class SwapSpace:
    """Host copies of swapped KV blocks, shaped like the device cache; the copies both ways."""

    def __init__(self, kv_cache: torch.Tensor, num_blocks: int) -> None:
        self.kv_cache = kv_cache
        shape = (kv_cache.shape[0], num_blocks, *kv_cache.shape[2:])
        self._cuda: _CopyStream | None = None
        if kv_cache.is_cuda:
            self._cuda = _CopyStream(kv_cache.device)
            self.host_cache = self._cuda.pinned_tensor(shape, kv_cache.dtype)
        else:
            # CPU: the "host" pool is another CPU tensor; empty() commits pages only when written.
            self.host_cache = torch.empty(shape, dtype=kv_cache.dtype)

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Copy (device, host) pairs out, then (host, device) pairs in, before this step's forward.

        On CUDA the copies queue on the copy stream behind the compute stream's work so far, and
        the compute stream waits for them: the host never blocks.
        """
        if not (swap_out or swap_in):
            return
        if self._cuda is None:
            self._copy(swap_out, swap_in, non_blocking=False)
            return
        with self._cuda.ordered():
            self._copy(swap_out, swap_in, non_blocking=True)

    def _copy(
        self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]], non_blocking: bool
    ) -> None:
        dev, host = self.kv_cache, self.host_cache
        # One block of one layer is contiguous, so each (layer, run) is one memcpy.
        for src_cache, dst_cache, pairs in ((dev, host, swap_out), (host, dev, swap_in)):
            for src, dst, k in block_runs(pairs):
                for layer in range(dev.shape[0]):
                    dst_cache[layer, dst : dst + k].copy_(
                        src_cache[layer, src : src + k], non_blocking=non_blocking
                    )


class _CopyStream:
    """A flashstack.cuda copy stream, the two events that order it against torch's compute
    stream, and the pinned memory of the host pool."""

    def __init__(self, device: torch.device) -> None:
        from flashstack import cuda as fc
        from flashstack.cuda.torch_interop import device_for

        self.device = device_for(device)
        self.stream = fc.Stream(self.device)
        self.compute_ready = fc.Event(self.device)
        self.copies_done = fc.Event(self.device)
        # torch issues the copies (strided block views) on our stream through this alias.
        self.torch_stream = torch.cuda.ExternalStream(self.stream.raw, device=device)
        self.buffers: list[Any] = []

    def pinned_tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor over page-locked memory, allocated once for the engine's life: one
        PinnedBuffer, not a pool block, whose power-of-two sizes could double a large swap space."""
        from flashstack import cuda as fc
        from flashstack.cuda.torch_interop import host_tensor

        numel = torch.Size(shape).numel()
        buf = fc.PinnedBuffer(
            max(numel * torch.empty((), dtype=dtype).element_size(), 1), self.device
        )
        self.buffers.append(buf)  # the numpy view keeps it alive too, and open while it lives
        return host_tensor(buf, dtype, shape)

    @contextmanager
    def ordered(self) -> Iterator[None]:
        """Copies issued inside run on the copy stream after the compute stream's work so far;
        the compute stream's later work waits for them."""
        from flashstack.cuda.torch_interop import current_stream

        compute = current_stream(self.device)
        self.compute_ready.record(compute)  # swap-out reads blocks that earlier steps wrote
        self.stream.wait(self.compute_ready)
        with torch.cuda.stream(self.torch_stream):
            yield
        self.copies_done.record(self.stream)
        # The forward writes blocks just swapped out and reads blocks just swapped in.
        compute.wait(self.copies_done)

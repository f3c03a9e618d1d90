"""Engine configuration: one slots dataclass that flows through every engine component."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class EngineConfig:
    """Everything the engine needs to run one model; filled in further by `LLM` after loading."""

    model: str
    block_size: int = 256
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    dtype: str = "auto"
    device: str = "auto"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"  # "fcfs" or "priority" (lower value is served first)
    num_kv_blocks: int | None = (
        None  # None: sized from memory (see kv_cache_memory_gb, gpu_memory_utilization)
    )
    kv_cache_memory_gb: float | None = None  # CPU: KV budget; None means 1 GiB
    gpu_memory_utilization: float = 0.9
    attention_backend: str = (
        "auto"  # "auto", "reference", or a name registered in kernels.attention
    )
    enforce_eager: bool = False  # True: no CUDA graphs for decode (debugging, or to save capture time)
    # Queue each decode step's successor before reading the step's tokens back, so the device
    # never idles while the host schedules and streams (vLLM's async scheduling). False: one step
    # at a time.
    async_scheduling: bool = True
    show_progress: bool = True
    seed: int = 0
    tensor_parallel_size: int = 1  # ranks (GPUs, or CPU processes over gloo) sharing one model
    # Preemption when KV blocks run out: "swap" the victim's blocks to host memory, "recompute" its
    # prefill later, or "auto": whichever engine/swap.py's cost estimate says is cheaper.
    preemption_mode: str = "auto"
    swap_space_gb: float = 4.0  # host memory for swapped-out KV blocks (pinned on CUDA)
    # The estimate's constants; None takes engine/swap.py's DEVICE_DEFAULTS for the device type.
    swap_bandwidth_gbps: float | None = None  # host<->device copy rate, GB/s
    recompute_tflops: float | None = None  # achieved prefill rate, TFLOP/s
    hf_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.preemption_mode not in ("auto", "swap", "recompute"):
            raise ValueError(
                "preemption_mode must be 'auto', 'swap' or 'recompute', "
                f"got {self.preemption_mode!r}"
            )
        if self.swap_space_gb < 0:
            raise ValueError(f"swap_space_gb must be >= 0, got {self.swap_space_gb}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}"
            )

"""The mixed-step graphs' buckets and switch (their replay is tested on CUDA in test_gpu.py)."""

from __future__ import annotations

import pytest

from flashstack.engine.config import EngineConfig
from flashstack.engine.mixed_graphs import token_buckets
from flashstack.engine.model_runner import mixed_graph_tokens


def test_buckets_cover_every_step_size_with_bounded_padding() -> None:
    buckets = token_buckets(2048)
    assert buckets[:5] == [16, 32, 64, 128, 256]
    assert buckets[5:] == [384, 512, 768, 1024, 1536, 2048]
    for n in range(1, 2049):
        bucket = next(b for b in buckets if b >= n)
        assert bucket == 16 or n <= 256 or bucket <= n * 1.5
    assert token_buckets(100) == [16, 32, 64, 100]
    assert token_buckets(16) == [16]


def test_the_switch_follows_the_step_budget_and_tensor_parallelism() -> None:
    assert mixed_graph_tokens(EngineConfig("m")) == 2048
    assert mixed_graph_tokens(EngineConfig("m", max_num_batched_tokens=512)) == 512
    assert mixed_graph_tokens(EngineConfig("m", mixed_step_graph_tokens=0)) == 0
    assert mixed_graph_tokens(EngineConfig("m", tensor_parallel_size=2)) == 0
    with pytest.raises(ValueError, match="mixed_step_graph_tokens must be >= 0"):
        EngineConfig("m", mixed_step_graph_tokens=-1)

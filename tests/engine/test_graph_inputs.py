"""Step inputs: a span's KV slots, and the decode graphs' packed inputs: each bucket's views read
back exactly the step that was staged, padded the way the graphs rely on (slot -1 writes nothing,
context length 1 reads one slot). Capture and replay need CUDA (tests/engine/test_gpu.py); the
packing is host code and runs here."""

from __future__ import annotations

import torch

from flashstack.engine.cuda_graphs import DecodeGraphs, graph_buckets
from flashstack.engine.kernels.attention import get_attention_backend
from flashstack.engine.model_runner import slots_of
from flashstack.engine.models.ops import TorchOps


def _graphs(max_num_seqs: int = 16) -> DecodeGraphs:
    # block_size 16, max_model_len 64: tables are 4 blocks wide.
    cpu = torch.device("cpu")
    return DecodeGraphs(
        torch.nn.Identity(),
        [],
        TorchOps(get_attention_backend("reference", cpu)),
        16,
        64,
        max_num_seqs,
        cpu,
    )


def test_buckets() -> None:
    assert graph_buckets(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert graph_buckets(3) == [1, 2, 3]
    assert graph_buckets(1000)[-1] == 512


def test_staged_step_reads_back_through_its_bucket_views() -> None:
    g = _graphs()
    bucket = g.stage(
        [11, 12, 13], [5, 17, 40], [85, 273, 680], [[5], [2, 17], [9, 1, 42]], [6, 18, 41]
    )
    assert bucket == 4
    v = g._views(4)
    assert v.input_ids.tolist() == [11, 12, 13, 0]
    assert v.positions.tolist() == [5, 17, 40, 0]
    assert v.slot_mapping.tolist() == [85, 273, 680, -1], "a padded row must write no KV slot"
    assert v.context_lens.tolist() == [6, 18, 41, 1], "a padded row reads one slot"
    assert v.block_tables.tolist() == [[5, 0, 0, 0], [2, 17, 0, 0], [9, 1, 42, 0], [0, 0, 0, 0]]
    assert v.temperatures.tolist() == [0] * 4, "without temperatures every row is greedy"
    # a temperature a row and the seed after the block table
    assert g.packed_size(4) == 4 * (4 + 4 + 1) + 1


def test_staged_temperatures_and_seed_read_back_bit_for_bit() -> None:
    """The sampler's inputs ride in the packed int64 tensor: float32 bit patterns that read back
    as the very temperatures staged, padded rows greedy, and the step's seed."""
    g = _graphs()
    temps = [0.6, 0.0, 1.3]
    bucket = g.stage([1, 2, 3], [4, 5, 6], [7, 8, 9], [[1], [2], [3]], [5, 6, 7], temps, 2**31 - 2)
    v = g._views(bucket)
    as_float = v.temperatures.to(torch.int32).view(torch.float32)
    assert as_float.tolist() == torch.tensor(temps + [0.0], dtype=torch.float32).tolist()
    assert v.seed.tolist() == [2**31 - 2]
    assert v.block_tables.tolist()[:3] == [[1, 0, 0, 0], [2, 0, 0, 0], [3, 0, 0, 0]]
    assert g.packed_capacity(64, 16, 16) == g.packed_size(16)


def test_a_smaller_step_after_a_larger_one_uses_only_its_own_layout() -> None:
    g = _graphs()
    # bucket 16
    g.stage(list(range(9)), list(range(9)), list(range(9)), [[1, 2, 3, 4]] * 9, [64] * 9)
    assert g.stage([7], [3], [19], [[1]], [4]) == 1
    v = g._views(1)
    assert (v.input_ids.tolist(), v.positions.tolist(), v.slot_mapping.tolist()) == ([7], [3], [19])
    assert v.context_lens.tolist() == [4] and v.block_tables.tolist() == [[1, 0, 0, 0]]


def test_slots_of_a_span_match_the_per_token_formula() -> None:
    table, bs = [7, 2, 9, 4], 4
    for start in range(16):
        for end in range(start, 17):
            want = [table[p // bs] * bs + p % bs for p in range(start, end)]
            assert slots_of(table, bs, start, end) == want

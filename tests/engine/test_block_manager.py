"""Block manager: O(1) pools, refcounts, chain-hashed prefix cache, LRU eviction, invariants."""

from __future__ import annotations

import pytest

from flashstack.engine.block_manager import BlockManager, chain_hash
from flashstack.engine.sampling import SamplingParams
from flashstack.engine.sequence import Sequence


def seq_of(tokens: list[int]) -> Sequence:
    return Sequence(tokens, SamplingParams())


def admit(bm: BlockManager, seq: Sequence) -> int:
    """Match the prefix, allocate the rest, mark all computed (as a finished prefill would)."""
    hits = bm.match_prefix(seq)
    bm.append_slots(seq, seq.num_uncomputed_tokens)
    seq.num_computed_tokens = len(seq)
    bm.cache_full_blocks(seq)
    return hits


def test_allocate_free_roundtrip_keeps_counts() -> None:
    bm = BlockManager(8, 4)
    ids = [bm.allocate_block() for _ in range(8)]
    assert sorted(ids) == list(range(8)) and bm.num_free_blocks == 0
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate_block()
    for b in ids:
        bm.free_block(b)
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0
    with pytest.raises(RuntimeError, match="freed more often"):
        bm.free_block(0)


def test_prefix_blocks_are_shared_and_refcounted() -> None:
    bm = BlockManager(16, 4)
    a, b = seq_of(list(range(10))), seq_of(list(range(8)) + [99, 98, 97])
    assert admit(bm, a) == 0
    assert admit(bm, b) == 8  # two full blocks shared
    assert a.block_table[:2] == b.block_table[:2] and a.block_table[2] != b.block_table[2]
    assert bm.ref_counts[a.block_table[0]] == 2
    bm.check_invariants([a, b])
    bm.free(a)
    assert bm.ref_counts[b.block_table[0]] == 1
    bm.check_invariants([b])
    bm.free(b)
    bm.check_invariants([])
    assert bm.num_free_blocks == 16


def test_last_token_is_never_served_from_cache() -> None:
    bm = BlockManager(8, 4)
    a = seq_of(list(range(8)))
    admit(bm, a)
    b = seq_of(
        list(range(8))
    )  # identical: only the first block may be reused, the last token must run
    assert admit(bm, b) == 4


def test_chain_hash_depends_on_the_whole_prefix() -> None:
    assert chain_hash(None, [1, 2]) != chain_hash(chain_hash(None, [0, 0]), [1, 2])
    bm = BlockManager(16, 2)
    admit(bm, seq_of([1, 2, 3, 4, 5]))
    # Same second block [3, 4] after a different first block: no hit.
    assert admit(bm, seq_of([9, 9, 3, 4, 5])) == 0


def test_freed_cached_blocks_survive_until_evicted_lru_first() -> None:
    bm = BlockManager(4, 2)
    a, b = seq_of([1, 2, 3]), seq_of([5, 6, 7])
    admit(bm, a)
    admit(bm, b)
    bm.free(a)  # a's cached block [1, 2] becomes least recently used
    bm.free(b)
    assert bm.num_free_blocks == 4 and len(bm.hash_to_block) == 2
    # Taking the two plain blocks must not touch the cache; the third allocation evicts a's block
    # first.
    taken = [bm.allocate_block() for _ in range(3)]
    assert len(bm.hash_to_block) == 1
    for t in taken:
        bm.free_block(t)
    assert admit(bm, seq_of([1, 2, 0])) == 0  # a's block was evicted
    assert admit(bm, seq_of([5, 6, 0])) == 2  # b's block is still cached


def test_invariant_check_catches_corruption() -> None:
    bm = BlockManager(4, 2)
    a = seq_of([1, 2, 3])
    admit(bm, a)
    a.block_table.append(a.block_table[0])  # a block owned twice by one sequence
    with pytest.raises(AssertionError):
        bm.check_invariants([a])
    a.block_table.pop()
    bm.ref_counts[a.block_table[0]] += 1  # a leaked reference
    with pytest.raises(AssertionError):
        bm.check_invariants([a])


def test_disabled_prefix_cache_never_hits() -> None:
    bm = BlockManager(8, 2, enable_prefix_caching=False)
    admit(bm, seq_of([1, 2, 3]))
    assert admit(bm, seq_of([1, 2, 3])) == 0 and not bm.hash_to_block

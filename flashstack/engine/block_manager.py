"""Fixed-size KV blocks: O(1) alloc/free, refcounts, chain-hashed prefix cache, LRU eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from collections.abc import Sequence as Seq

from flashstack.engine.sequence import Sequence


def chain_hash(parent: int | None, tokens: Seq[int]) -> int:
    """Hash of a full block that also covers every block before it (via the parent's hash)."""
    # Python's hash of a tuple of ints is deterministic across processes (no string salting).
    return hash((parent, tuple(tokens)))


class BlockManager:
    """Owns the block pool; sequences hold block ids in their `block_table`.

    A block is free (ref_count 0) or used (ref_count > 0). Free blocks live in one of two pools:
    `_free` (no reusable content, a stack) or `_cached` (content registered in the prefix cache,
    kept in LRU order and evicted oldest first when `_free` runs dry).
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"need at least one KV block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        # Reversed so that pop() hands out block 0 first: handy when reading test failures.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._cached: OrderedDict[int, None] = OrderedDict()
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no owner, reusable content or not."""
        return len(self._free) + len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        """Blocks owned by at least one sequence."""
        return self.num_blocks - self.num_free_blocks

    def allocate_block(self) -> int:
        """Take a free block (plain ones first, then evict the least recently used cached one)."""
        if self._free:
            block_id = self._free.pop()
        elif self._cached:
            block_id, _ = self._cached.popitem(last=False)
            self._uncache(block_id)
        else:
            raise RuntimeError("out of KV blocks: the scheduler must check can_allocate first")
        self.ref_counts[block_id] = 1
        return block_id

    def free_block(self, block_id: int) -> None:
        """Drop one reference; at zero the block returns to a free pool."""
        ref = self.ref_counts[block_id] - 1
        if ref < 0:
            raise RuntimeError(f"block {block_id} freed more often than allocated")
        self.ref_counts[block_id] = ref
        if ref == 0:
            if self.block_hash[block_id] is None:
                self._free.append(block_id)
            else:
                self._cached[block_id] = None

    def _uncache(self, block_id: int) -> None:
        h = self.block_hash[block_id]
        if h is not None:
            del self.hash_to_block[h]
            self.block_hash[block_id] = None
            self.block_tokens[block_id] = None

    def _acquire(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            del self._cached[block_id]
        self.ref_counts[block_id] += 1

    def can_allocate(self, num_blocks: int) -> bool:
        """True when `num_blocks` more blocks can be handed out now."""
        return num_blocks <= self.num_free_blocks

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `seq` must add to hold K/V for its next `num_new_tokens` tokens."""
        needed = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, needed - len(seq.block_table))

    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks for `seq`'s leading full blocks; returns the tokens reused."""
        assert not seq.block_table, "match_prefix is only for sequences that own no blocks"
        seq.block_hashes = []
        seq.num_cached_tokens = 0
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        # The last token is always recomputed: its logits are needed to sample.
        num_full = (len(seq.token_ids) - 1) // bs
        parent = None
        self.num_prefix_queries += num_full
        for i in range(num_full):
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            h = chain_hash(parent, tokens)
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.block_tokens[block_id] != tuple(tokens):
                break
            self._acquire(block_id)
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)
            parent = h
        num_hits = len(seq.block_table)
        self.num_prefix_hits += num_hits
        seq.num_computed_tokens = seq.num_cached_tokens = num_hits * bs
        return seq.num_cached_tokens

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow `seq`'s block table to fit `num_new_tokens` more tokens."""
        for _ in range(self.num_blocks_needed(seq, num_new_tokens)):
            seq.block_table.append(self.allocate_block())

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register `seq`'s newly completed blocks (all K/V computed) in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        for i in range(len(seq.block_hashes), num_full):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = chain_hash(parent, tokens)
            seq.block_hashes.append(h)
            block_id = seq.block_table[i]
            # Two sequences may compute the same content at once; the first one registered wins.
            if h not in self.hash_to_block and self.block_hash[block_id] is None:
                self.hash_to_block[h] = block_id
                self.block_hash[block_id] = h
                self.block_tokens[block_id] = tokens

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks, tail first, so the LRU evicts them before the prefix."""
        for block_id in reversed(seq.block_table):
            self.free_block(block_id)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def reset_prefix_cache(self) -> None:
        """Forget all cached content (used blocks keep their data but are no longer shareable)."""
        for block_id in list(self._cached):
            self._uncache(block_id)
            self._free.append(block_id)
        self._cached.clear()
        self.hash_to_block.clear()
        self.block_hash = [None] * self.num_blocks
        self.block_tokens = [None] * self.num_blocks

    def check_invariants(self, seqs: Iterable[Sequence]) -> None:
        """Raise AssertionError unless free + used == total and every reference is accounted for."""
        free_ids = self._free + list(self._cached)
        assert len(free_ids) == len(set(free_ids)), "a block is in the free pools twice"
        assert all(self.ref_counts[b] == 0 for b in free_ids), "a free block has references"
        assert all(self.block_hash[b] is None for b in self._free), (
            "an uncached free block has a hash"
        )
        owners = [0] * self.num_blocks
        for seq in seqs:
            assert len(seq.block_table) == len(set(seq.block_table)), f"{seq} holds a block twice"
            for b in seq.block_table:
                owners[b] += 1
        assert owners == self.ref_counts, "reference counts differ from the sequences' block tables"
        used = sum(1 for r in self.ref_counts if r > 0)
        assert len(free_ids) + used == self.num_blocks, "free + used != total"
        for h, b in self.hash_to_block.items():
            assert self.block_hash[b] == h, (
                "prefix-cache index points at a block with other content"
            )

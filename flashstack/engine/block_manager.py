"""Fixed-size KV blocks: O(1) alloc/free, refcounts, chain-hashed prefix cache, LRU eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from collections.abc import Sequence as Seq

from flashstack.engine.sequence import Sequence
from flashstack.engine.swap import HostBlockPool


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
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_host_blocks: int = 0,
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
        self.host = HostBlockPool(num_host_blocks)  # swapped-out sequences' blocks

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

    def num_computed_blocks(self, seq: Sequence) -> int:
        """Blocks holding `seq`'s computed K/V: what a swap-out has to move."""
        return -(-seq.num_computed_tokens // self.block_size)

    def can_swap_out(self, seq: Sequence) -> bool:
        """True when `seq` has K/V to save and the host pool has room for it."""
        n = self.num_computed_blocks(seq)
        return 0 < n <= self.host.num_free_blocks

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Give `seq`'s device blocks back for host blocks; (device, host) pairs to copy first.

        The device blocks are free at once: the runner copies them out before the step's forward,
        which is the first thing that can write them again.
        """
        n = self.num_computed_blocks(seq)
        pairs = list(zip(seq.block_table[:n], self.host.allocate(seq.seq_id, n)))
        for block_id in reversed(seq.block_table):
            self.free_block(block_id)
        seq.block_table = []
        return pairs

    def can_swap_in(self, seq: Sequence, num_new_tokens: int) -> bool:
        """True when `seq`'s swapped blocks plus room for `num_new_tokens` fit the free blocks."""
        held = len(self.host.tables.get(seq.seq_id, ()))
        needed = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(held, needed) <= self.num_free_blocks

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Give `seq` device blocks for its host blocks; (host, device) pairs to copy first."""
        host_ids = self.host.release(seq.seq_id)
        seq.block_table = [self.allocate_block() for _ in host_ids]
        bs = self.block_size
        for i, h in enumerate(seq.block_hashes):  # the content is back: make it shareable again
            block_id = seq.block_table[i]
            if h not in self.hash_to_block:
                self.hash_to_block[h] = block_id
                self.block_hash[block_id] = h
                self.block_tokens[block_id] = tuple(seq.token_ids[i * bs : (i + 1) * bs])
        return list(zip(host_ids, seq.block_table))

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks, tail first, so the LRU evicts them before the prefix."""
        self.host.release(seq.seq_id)
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
        seqs = list(seqs)
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
        self.host.check_invariants()
        live = {seq.seq_id for seq in seqs}
        assert set(self.host.tables) <= live, "host blocks held for a sequence that is gone"
        for seq in seqs:
            if seq.seq_id in self.host.tables:
                assert not seq.block_table, f"{seq} holds device blocks while swapped out"

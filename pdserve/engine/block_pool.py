"""The pool of KV blocks: reference counts, the prefix-cache map and the LRU of free blocks.

Every block is in exactly one of three states:

* **used** — ``ref_cnt > 0``: some request's block table holds it;
* **free cached** — ``ref_cnt == 0`` with a hash: its KV is still valid and a
  later prompt with the same prefix may take it back (``touch``);
* **free empty** — ``ref_cnt == 0`` without a hash.

Both free kinds sit in one queue ordered by eviction priority: new blocks are
taken from the front, freed blocks are appended at the back, so the least
recently freed cached block is evicted first. Taking a free cached block for new
data evicts it: its hash leaves the cache map and a ``removed`` event is queued
for the prefix index.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from pdserve.hashing import BlockEvent, BlockHash


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, record_events: bool = False) -> None:
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.record_events = record_events
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # block_id -> block, in eviction order (front = next to be reused).
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVCacheBlock] = {}
        self._events: list[BlockEvent] = []

    # -- queries -------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that ``get_new_blocks`` can hand out (free empty + free cached)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    # -- changes -------------------------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the front of the free queue, evicting cached ones."""
        if num_blocks > len(self._free):
            raise ValueError(f"cannot get {num_blocks} blocks: only {len(self._free)} free")
        out = []
        evicted = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                evicted.append(block.block_hash)
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        if evicted and self.record_events:
            self._events.append(BlockEvent(stored=False, block_hashes=tuple(evicted)))
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks found in the cache, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference; blocks reaching zero join the back of the free queue in the order given."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash]) -> None:
        """Register full blocks under their hashes (``blocks[i]`` holds the block hashed ``block_hashes[i]``).

        A hash already held by another block keeps that block; this one stays uncached, so the
        map never points at two copies and freeing either one is safe.
        """
        if not self.enable_caching:
            return
        stored = []
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            if block.block_hash is not None:
                assert block.block_hash == block_hash, f"{block} re-hashed with different content"
                continue
            if block_hash in self._cached:
                continue
            block.block_hash = block_hash
            self._cached[block_hash] = block
            stored.append(block_hash)
        if stored and self.record_events:
            self._events.append(BlockEvent(stored=True, block_hashes=tuple(stored)))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        if self._cached and self.record_events:
            self._events.append(BlockEvent(stored=False, block_hashes=tuple(self._cached)))
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        return True

    def take_events(self) -> list[BlockEvent]:
        events, self._events = self._events, []
        return events

    # -- invariants ----------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Assert free + used == total and that the queue, ref counts and cache map agree."""
        used = [b for b in self.blocks if b.ref_cnt > 0]
        assert all(b.ref_cnt >= 0 for b in self.blocks), "negative ref count"
        assert len(used) + len(self._free) == self.num_blocks, (
            f"free {len(self._free)} + used {len(used)} != total {self.num_blocks}"
        )
        for block_id, block in self._free.items():
            assert block.block_id == block_id and block.ref_cnt == 0, f"{block} in free queue"
        for block_hash, block in self._cached.items():
            assert block.block_hash == block_hash, f"cache map points at {block} for another hash"
        num_hashed = sum(1 for b in self.blocks if b.block_hash is not None)
        assert num_hashed == len(self._cached), "a hashed block is missing from the cache map"

"""Per-request block tables on top of the block pool, with prefix-cache lookups.

Free of tensors: it hands out block ids; the model runner owns the memory.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.engine.block_pool import BlockPool, KVCacheBlock
from pdserve.engine.request import Request
from pdserve.hashing import hash_block_chain
from pdserve.utils import cdiv


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        namespace: str = "",
        record_events: bool = False,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.namespace = namespace
        self.pool = BlockPool(num_blocks, enable_caching, record_events)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request have already been offered to the cache map.
        self._num_cached_blocks: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def update_block_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` over any newly full block of its tokens."""
        num_full = request.num_tokens // self.block_size
        if len(request.block_hashes) < num_full:
            request.block_hashes = hash_block_chain(
                request.all_token_ids, self.block_size, self.namespace, start=request.block_hashes
            )

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of a request that holds no blocks yet: (blocks, tokens).

        Leaves at least one token to compute so the step still produces logits. Does not
        take references: pass the blocks to ``allocate_slots`` in the same scheduling pass.
        """
        if not self.enable_caching or request.needs_prompt_logprobs:
            return [], 0
        self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        cache: bool = True,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens of ``request``; None if the pool is short.

        Block layout of the request after the call::

            | computed (own blocks) | new computed (prefix hits) | new tokens | unused tail slot(s) |
            |<- request.num_started_tokens -->|                   |
            |<------ num_computed + len(new_computed_blocks) * block_size + num_new_tokens ------>|

        ``new_computed_blocks`` are cache hits from ``get_computed_blocks`` that the request
        has not yet referenced; the caller adds their tokens to ``num_computed_tokens``.
        ``num_started_tokens`` counts tokens of steps still in flight (async scheduling) too.
        Full blocks covered by this step are registered in the cache map right away: the
        engine writes all of a step's KV before any attention reads it, so a later request
        in the same step may already share them. ``cache=False`` defers that for blocks whose
        KV arrives from elsewhere (a remote prefill): see ``cache_blocks``.
        """
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_started_tokens + len(new_computed_blocks) * self.block_size
        num_needed = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = num_needed - len(blocks) - len(new_computed_blocks)
        # Hits sitting in the free queue stop being free once touched.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_evictable_hits:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None

        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(max(num_new_blocks, 0))
        blocks.extend(new_blocks)

        if cache:
            self.cache_blocks(request, num_computed + num_new_tokens)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's full blocks among its first ``num_tokens`` tokens in the cache map."""
        if not self.enable_caching:
            return
        self.update_block_hashes(request)
        blocks = self.req_to_blocks[request.request_id]
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full > start:
            self.pool.cache_full_blocks(blocks[start:num_full], request.block_hashes[start:num_full])
            self._num_cached_blocks[request.request_id] = num_full

    def fork(self, parent: Request, child: Request, num_tokens: int) -> list[tuple[int, int]] | None:
        """Give ``child`` the KV of ``parent``'s first ``num_tokens`` tokens (parallel sampling).

        Full blocks are shared by reference count; the partial block holding the last of those
        tokens is copied into a block of the child's own (copy-on-write, done eagerly: the child
        writes its next token there). Returns the ``(src, dst)`` block copies the model runner must
        make before the child's next step, or None when the parent holds too few blocks (it was
        preempted) or the pool has none free for the copy; the child then holds nothing and
        computes its prompt again like a preempted request.
        """
        blocks = self.req_to_blocks.get(parent.request_id, [])
        num_full, partial = divmod(num_tokens, self.block_size)
        if len(blocks) < num_full + bool(partial) or (partial and self.pool.num_free_blocks < 1):
            return None
        assert child.request_id not in self.req_to_blocks, f"{child.request_id} holds blocks already"
        shared = blocks[:num_full]
        self.pool.touch(shared)
        own = list(shared)
        copies = []
        if partial:
            (block,) = self.pool.get_new_blocks(1)
            own.append(block)
            copies.append((blocks[num_full].block_id, block.block_id))
        self.req_to_blocks[child.request_id] = own
        num_parent_cached = self._num_cached_blocks.get(parent.request_id, 0)
        self._num_cached_blocks[child.request_id] = min(num_full, num_parent_cached)
        child.block_hashes = parent.block_hashes[:num_full]
        return copies

    def free(self, request: Request) -> None:
        """Release every block of the request, tail first so shared prefixes are evicted last."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        held: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            for b in blocks:
                held[b.block_id] = held.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            assert held.get(block.block_id, 0) == block.ref_cnt, (
                f"{block}: ref count {block.ref_cnt} but held by {held.get(block.block_id, 0)} requests"
            )

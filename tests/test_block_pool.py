"""BlockPool on tiny pools: exact block ids, free-queue order, cache map and events."""

from __future__ import annotations

import pytest

from pdserve.engine.block_pool import BlockPool
from pdserve.hashing import BlockEvent, hash_block_chain


def H(i: int) -> bytes:
    """A distinct, realistic 32-byte hash per integer."""
    return hash_block_chain([i], 1, "test-pool")[0]


def free_ids(pool: BlockPool) -> list[int]:
    """Block ids in eviction order (front first); the queue is private, tests read it on purpose."""
    return list(pool._free)


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_fresh_pool_hands_out_ids_in_order():
    pool = BlockPool(6)
    assert pool.num_free_blocks == 6 and pool.usage == 0.0
    assert free_ids(pool) == [0, 1, 2, 3, 4, 5]
    a = pool.get_new_blocks(2)
    b = pool.get_new_blocks(3)
    assert ids(a) == [0, 1] and ids(b) == [2, 3, 4]
    assert all(x.ref_cnt == 1 and x.block_hash is None for x in a + b)
    assert pool.num_free_blocks == 1 and pool.usage == pytest.approx(5 / 6)
    assert pool.get_new_blocks(0) == []
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1  # a refused request takes nothing
    pool.check_integrity()


def test_free_appends_to_back_in_given_order_and_reuse_is_lru():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(5)
    assert free_ids(pool) == []
    pool.free_blocks([blocks[3], blocks[1]])
    assert free_ids(pool) == [3, 1]
    pool.free_blocks([blocks[0]])
    assert free_ids(pool) == [3, 1, 0]
    # Reuse takes from the front: least recently freed first.
    assert ids(pool.get_new_blocks(2)) == [3, 1]
    assert free_ids(pool) == [0]
    pool.check_integrity()


def test_shared_block_joins_free_queue_only_at_zero_refs():
    pool = BlockPool(3)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_blocks([a], [H(0)])
    pool.touch([a])  # a second request shares block 0
    assert a.ref_cnt == 2
    pool.free_blocks([a])
    assert a.ref_cnt == 1 and free_ids(pool) == []
    pool.free_blocks([c, a])
    assert free_ids(pool) == [2, 0]
    pool.check_integrity()


def test_touch_free_cached_block_leaves_queue():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(blocks[:2], [H(0), H(1)])
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 2, 1, 0]
    hit = pool.get_cached_block(H(1))
    assert hit is blocks[1] and hit.ref_cnt == 0
    pool.touch([hit])
    assert hit.ref_cnt == 1 and hit.block_hash == H(1)
    assert free_ids(pool) == [3, 2, 0]
    assert pool.num_free_blocks == 3 and pool.num_cached_blocks == 2
    pool.check_integrity()
    # The touched block is not handed out again, even when the rest of the pool is taken.
    assert ids(pool.get_new_blocks(3)) == [3, 2, 0]
    assert pool.get_cached_block(H(1)) is hit
    pool.check_integrity()


def test_eviction_removes_hash_and_records_event():
    pool = BlockPool(4, record_events=True)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [H(0), H(1), H(2)])
    assert pool.take_events() == [BlockEvent(stored=True, block_hashes=(H(0), H(1), H(2)))]
    assert pool.take_events() == []
    pool.free_blocks(reversed(blocks))  # tail first: block 2 is evicted before block 0
    assert free_ids(pool) == [3, 2, 1, 0]
    new = pool.get_new_blocks(3)  # free empty block 3, then cached blocks 2 and 1
    assert ids(new) == [3, 2, 1]
    assert all(b.block_hash is None and b.ref_cnt == 1 for b in new)
    assert pool.get_cached_block(H(2)) is None and pool.get_cached_block(H(1)) is None
    assert pool.get_cached_block(H(0)) is blocks[0]
    assert pool.num_cached_blocks == 1
    assert pool.take_events() == [BlockEvent(stored=False, block_hashes=(H(2), H(1)))]
    pool.check_integrity()


def test_no_events_without_record_events():
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [H(0), H(1)])
    pool.free_blocks(blocks)
    pool.get_new_blocks(2)
    assert pool.take_events() == []
    assert pool.num_cached_blocks == 0


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(4, record_events=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [H(7)])
    pool.cache_full_blocks([b], [H(7)])  # same content computed again by another request
    assert pool.get_cached_block(H(7)) is a
    assert b.block_hash is None
    assert pool.num_cached_blocks == 1
    assert pool.take_events() == [BlockEvent(stored=True, block_hashes=(H(7),))]  # stored once
    # Freeing the uncached copy never touches the map; freeing the cached one keeps it cached.
    pool.free_blocks([b])
    assert pool.get_cached_block(H(7)) is a
    pool.free_blocks([a])
    assert pool.get_cached_block(H(7)) is a
    assert free_ids(pool) == [2, 3, 1, 0]
    pool.check_integrity()


def test_recaching_a_block_is_a_no_op_but_different_content_asserts():
    pool = BlockPool(2, record_events=True)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([a], [H(1)])
    pool.cache_full_blocks([a], [H(1)])
    assert pool.take_events() == [BlockEvent(stored=True, block_hashes=(H(1),))]
    with pytest.raises(AssertionError):
        pool.cache_full_blocks([a], [H(2)])


def test_caching_disabled_never_fills_the_map():
    pool = BlockPool(2, enable_caching=False, record_events=True)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [H(0), H(1)])
    assert pool.num_cached_blocks == 0 and pool.get_cached_block(H(0)) is None
    assert all(b.block_hash is None for b in blocks)
    assert pool.take_events() == []


def test_double_free_asserts():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([a])


def test_reset_prefix_cache_only_when_all_free():
    pool = BlockPool(3, record_events=True)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [H(0), H(1)])
    pool.take_events()
    assert pool.reset_prefix_cache() is False
    assert pool.num_cached_blocks == 2 and pool.take_events() == []
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.num_cached_blocks == 0
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.get_cached_block(H(0)) is None
    assert pool.take_events() == [BlockEvent(stored=False, block_hashes=(H(0), H(1)))]
    assert free_ids(pool) == [2, 0, 1]  # the queue order is untouched
    assert pool.reset_prefix_cache() is True
    assert pool.take_events() == []  # nothing left to remove
    pool.check_integrity()


def test_check_integrity_catches_corruption():
    def fresh() -> tuple[BlockPool, list]:
        pool = BlockPool(4)
        blocks = pool.get_new_blocks(2)
        pool.cache_full_blocks(blocks[:1], [H(0)])
        pool.check_integrity()
        return pool, blocks

    pool, blocks = fresh()
    pool.blocks[3].ref_cnt += 1  # a free block that claims an owner
    with pytest.raises(AssertionError):
        pool.check_integrity()

    pool, blocks = fresh()
    blocks[1].ref_cnt = 0  # a used block dropped to zero without joining the queue
    with pytest.raises(AssertionError):
        pool.check_integrity()

    pool, blocks = fresh()
    blocks[0].ref_cnt = -1
    with pytest.raises(AssertionError, match="negative"):
        pool.check_integrity()

    pool, blocks = fresh()
    blocks[1].block_hash = H(5)  # hashed but not in the map
    with pytest.raises(AssertionError):
        pool.check_integrity()

    pool, blocks = fresh()
    blocks[0].block_hash = H(9)  # the map points at a block holding another hash
    with pytest.raises(AssertionError):
        pool.check_integrity()

    pool, blocks = fresh()
    del pool._free[3]  # a free block lost from the queue
    with pytest.raises(AssertionError):
        pool.check_integrity()

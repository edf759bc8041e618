"""KVCacheManager on tiny pools: prefix hits, allocation without side effects on failure, reuse, freeing."""

from __future__ import annotations

import pytest

from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.sampling_params import SamplingParams

BS = 4


def make_request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, list(prompt), SamplingParams(max_tokens=16), eos_token_ids=(0,))


def free_ids(kv: KVCacheManager) -> list[int]:
    """Free queue in eviction order (front first); read from the pool's private queue on purpose."""
    return list(kv.pool._free)


def admit(kv: KVCacheManager, request: Request, num_new: int | None = None) -> list[int]:
    """What the scheduler does for a waiting request: take hits, allocate the rest, advance."""
    hits, num_hit_tokens = kv.get_computed_blocks(request)
    if num_new is None:
        num_new = request.num_tokens - num_hit_tokens
    assert kv.allocate_slots(request, num_new, hits) is not None
    request.num_computed_tokens = num_hit_tokens + num_new
    return kv.get_block_ids(request.request_id)


def test_allocate_fresh_request_exact_ids():
    kv = KVCacheManager(8, BS)
    r = make_request("a", list(range(10)))
    assert kv.get_computed_blocks(r) == ([], 0)
    new = kv.allocate_slots(r, 10)
    assert [b.block_id for b in new] == [0, 1, 2]
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert kv.num_free_blocks == 5
    # Only the two full blocks are cached; the third holds 2 of 4 tokens.
    assert len(r.block_hashes) == 2
    assert [kv.pool.get_cached_block(h).block_id for h in r.block_hashes] == [0, 1]
    assert kv.pool.num_cached_blocks == 2
    kv.check_integrity()


def test_get_computed_blocks_hit_lengths():
    kv = KVCacheManager(16, BS)
    a = make_request("a", list(range(13)))
    assert admit(kv, a) == [0, 1, 2, 3]  # 3 full blocks cached: tokens [0, 12)

    def hits(prompt: list[int]) -> tuple[list[int], int]:
        blocks, num_tokens = kv.get_computed_blocks(make_request("q", prompt))
        return [b.block_id for b in blocks], num_tokens

    assert hits(list(range(3))) == ([], 0)
    assert hits(list(range(4))) == ([], 0)  # one full block, but one token must stay to compute
    assert hits(list(range(5))) == ([0], 4)
    assert hits(list(range(8))) == ([0], 4)  # exactly 2 full blocks: only 1 block of hits
    assert hits(list(range(9))) == ([0, 1], 8)
    assert hits(list(range(12))) == ([0, 1], 8)
    assert hits(list(range(13))) == ([0, 1, 2], 12)
    assert hits(list(range(40))) == ([0, 1, 2], 12)  # the 4th block was never full in "a"
    assert hits([0, 1, 2, 3, 4, 5, 6, 99, 8, 9, 10, 11, 12]) == ([0], 4)  # diverges inside block 1
    assert hits([99, *range(1, 13)]) == ([], 0)  # diverges in block 0: the chain breaks everything
    # Lookups take no references.
    assert [b.ref_cnt for b in kv.pool.blocks[:4]] == [1, 1, 1, 1]
    kv.check_integrity()


def test_second_request_reuses_blocks_of_first():
    kv = KVCacheManager(8, BS)
    a = make_request("a", list(range(10)))
    assert admit(kv, a) == [0, 1, 2]
    b = make_request("b", [*range(8), 50, 51, 52])
    hits, num_hit_tokens = kv.get_computed_blocks(b)
    assert [x.block_id for x in hits] == [0, 1] and num_hit_tokens == 8
    new = kv.allocate_slots(b, 3, hits)
    assert [x.block_id for x in new] == [3]
    assert kv.get_block_ids("b") == [0, 1, 3]
    assert [blk.ref_cnt for blk in kv.pool.blocks[:4]] == [2, 2, 1, 1]
    assert kv.num_free_blocks == 4
    assert b.block_hashes[:2] == a.block_hashes
    kv.check_integrity()


def test_free_is_tail_first_and_shared_blocks_wait_for_last_owner():
    kv = KVCacheManager(8, BS)
    a = make_request("a", list(range(10)))
    b = make_request("b", [*range(8), 50, 51, 52])
    admit(kv, a)
    assert admit(kv, b) == [0, 1, 3]
    assert free_ids(kv) == [4, 5, 6, 7]
    kv.free(a)
    assert free_ids(kv) == [4, 5, 6, 7, 2]  # blocks 1 and 0 are still held by "b"
    kv.free(b)
    assert free_ids(kv) == [4, 5, 6, 7, 2, 3, 1, 0]  # tail first: the shared prefix is evicted last
    assert kv.num_free_blocks == 8 and kv.req_to_blocks == {}
    kv.check_integrity()
    # Freeing an unknown or already freed request is a no-op.
    kv.free(a)
    assert kv.num_free_blocks == 8


def test_allocate_returns_none_without_side_effects():
    kv = KVCacheManager(5, BS)
    a = make_request("a", list(range(13)))
    assert admit(kv, a) == [0, 1, 2, 3]
    b = make_request("b", list(range(100, 109)))  # 9 tokens: 3 blocks, 1 free
    before = (kv.num_free_blocks, free_ids(kv), kv.pool.num_cached_blocks)
    assert kv.allocate_slots(b, 9) is None
    assert (kv.num_free_blocks, free_ids(kv), kv.pool.num_cached_blocks) == before
    assert "b" not in kv.req_to_blocks and kv.get_block_ids("b") == []
    # A running request that cannot grow keeps what it has.
    a.append_output_token(1)
    a.num_computed_tokens = 13
    assert kv.allocate_slots(a, 1) == []  # 14 tokens still fit 4 blocks
    assert kv.allocate_slots(a, 8) is None  # 21 tokens would need 6 blocks
    assert kv.get_block_ids("a") == [0, 1, 2, 3] and kv.num_free_blocks == 1
    kv.check_integrity()


def test_free_cached_hits_count_against_free_pool():
    kv = KVCacheManager(5, BS)
    a = make_request("a", list(range(12)))
    assert admit(kv, a) == [0, 1, 2]
    kv.free(a)
    assert free_ids(kv) == [3, 4, 2, 1, 0]
    x = make_request("x", [77])
    assert admit(kv, x) == [3]
    assert free_ids(kv) == [4, 2, 1, 0]

    # "b" shares a's 3 cached (free) blocks and needs 2 more: 4 blocks are free, but 3 of them
    # are its own hits, so only 1 is left for new data.
    b = make_request("b", [*range(12), 20, 21, 22, 23, 24, 25])
    hits, num_hit_tokens = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1, 2] and num_hit_tokens == 12
    before = (kv.num_free_blocks, free_ids(kv), kv.pool.num_cached_blocks)
    assert kv.allocate_slots(b, 6, hits) is None
    assert (kv.num_free_blocks, free_ids(kv), kv.pool.num_cached_blocks) == before
    assert all(h.ref_cnt == 0 for h in hits) and "b" not in kv.req_to_blocks
    kv.check_integrity()

    kv.free(x)
    assert free_ids(kv) == [4, 2, 1, 0, 3]
    hits, num_hit_tokens = kv.get_computed_blocks(b)
    new = kv.allocate_slots(b, 6, hits)
    assert [blk.block_id for blk in new] == [4, 3]  # the hits left the queue before new blocks were taken
    assert kv.get_block_ids("b") == [0, 1, 2, 4, 3]
    assert kv.num_free_blocks == 0
    assert kv.pool.get_cached_block(b.block_hashes[3]).block_id == 4  # tokens [12, 16) now cached
    kv.check_integrity()


def test_hits_fill_exactly_the_free_pool():
    kv = KVCacheManager(3, BS)
    a = make_request("a", list(range(8)))
    admit(kv, a)
    kv.free(a)
    b = make_request("b", list(range(9)))  # 2 hits + 1 new block = the whole pool
    assert admit(kv, b) == [0, 1, 2]
    assert kv.num_free_blocks == 0
    kv.check_integrity()


def test_decode_tokens_fill_and_cache_blocks():
    kv = KVCacheManager(8, BS, record_events=True)
    r = make_request("r", [10, 11, 12, 13, 14, 15])
    assert admit(kv, r) == [0, 1]
    assert kv.pool.num_cached_blocks == 1
    for token, expect_ids, expect_cached in ((16, [0, 1], 1), (17, [0, 1], 2), (18, [0, 1, 2], 2)):
        r.append_output_token(token)
        kv.allocate_slots(r, 1)
        r.num_computed_tokens += 1
        assert kv.get_block_ids("r") == expect_ids
        assert kv.pool.num_cached_blocks == expect_cached
    events = kv.pool.take_events()
    assert [e.stored for e in events] == [True, True]
    assert [len(e.block_hashes) for e in events] == [1, 1]
    # Output tokens are part of the chain: a prompt equal to prompt + outputs hits both blocks.
    q = make_request("q", [10, 11, 12, 13, 14, 15, 16, 17, 18])
    blocks, num_tokens = kv.get_computed_blocks(q)
    assert [b.block_id for b in blocks] == [0, 1] and num_tokens == 8
    kv.check_integrity()


def test_chunked_prefill_caches_only_covered_full_blocks():
    kv = KVCacheManager(8, BS)
    r = make_request("r", list(range(14)))
    assert [b.block_id for b in kv.allocate_slots(r, 6)] == [0, 1]
    r.num_computed_tokens = 6
    assert kv.pool.num_cached_blocks == 1  # tokens [4, 6) of block 1 are not computed yet
    assert [b.block_id for b in kv.allocate_slots(r, 5)] == [2]
    r.num_computed_tokens = 11
    assert kv.pool.num_cached_blocks == 2
    assert [b.block_id for b in kv.allocate_slots(r, 3)] == [3]
    r.num_computed_tokens = 14
    assert kv.pool.num_cached_blocks == 3
    assert [kv.pool.get_cached_block(h).block_id for h in r.block_hashes] == [0, 1, 2]
    kv.check_integrity()


def test_preempted_request_takes_its_own_blocks_back():
    kv = KVCacheManager(6, BS)
    r = make_request("r", list(range(9)))
    assert admit(kv, r) == [0, 1, 2]
    r.append_output_token(5)
    kv.free(r)  # preemption by recompute
    r.num_computed_tokens = 0
    assert free_ids(kv) == [3, 4, 5, 2, 1, 0]
    assert admit(kv, r) == [0, 1, 3]  # 10 tokens: 2 hits (8 tokens), then 1 new block
    assert r.num_computed_tokens == 10
    kv.check_integrity()


def test_caching_disabled():
    kv = KVCacheManager(6, BS, enable_caching=False, record_events=True)
    a = make_request("a", list(range(9)))
    assert admit(kv, a) == [0, 1, 2]
    assert kv.pool.num_cached_blocks == 0 and a.block_hashes == []
    b = make_request("b", list(range(9)))
    assert kv.get_computed_blocks(b) == ([], 0)
    assert admit(kv, b) == [3, 4, 5]
    kv.free(a)
    kv.free(b)
    assert free_ids(kv) == [2, 1, 0, 5, 4, 3]
    c = make_request("c", list(range(9)))
    assert admit(kv, c) == [2, 1, 0]  # free order, not prefix hits
    assert all(blk.block_hash is None for blk in kv.pool.blocks)
    assert kv.pool.take_events() == []
    kv.check_integrity()


def test_check_integrity_catches_a_lost_reference():
    kv = KVCacheManager(4, BS)
    admit(kv, make_request("a", list(range(6))))
    kv.check_integrity()
    kv.pool.blocks[0].ref_cnt += 1  # a used block with a reference nobody holds
    with pytest.raises(AssertionError, match="held by"):
        kv.check_integrity()

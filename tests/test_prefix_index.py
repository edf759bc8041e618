"""The Redis prefix index against a real redis-server: publish, look up, expire, survive restarts."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from pdserve.hashing import BlockEvent, hash_block_chain
from pdserve.prefix_index import (
    IndexPublisher,
    IndexUnavailable,
    NodeRegistration,
    PrefixIndex,
    RecentRoutes,
    namespace,
)

MODEL = "test-model"


def chain(tokens: list[int]) -> list[bytes]:
    return hash_block_chain(tokens, 4, MODEL)


def publisher(url: str, node: str, ttl_s: float = 2.0) -> IndexPublisher:
    p = IndexPublisher(url, MODEL, NodeRegistration(node, "prefill", f"http://{node}"), ttl_s=ttl_s)
    p.start()
    return p


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def lookup(url: str, hashes: list[bytes], **kw) -> dict[str, int]:
    async def go():
        index = PrefixIndex(url, MODEL, **{"timeout_s": 2.0, **kw})
        try:
            return await index.lookup(hashes)
        finally:
            await index.close()

    return asyncio.run(go())


def test_longest_prefix_per_node(redis_server):
    a_tokens = list(range(40))  # 10 blocks
    h = chain(a_tokens)
    pa, pb = publisher(redis_server.url, "a"), publisher(redis_server.url, "b")
    try:
        pa.publish([BlockEvent(True, tuple(h[:10]))])
        pb.publish([BlockEvent(True, tuple(h[:3])), BlockEvent(True, tuple(h[5:8]))])  # a hole at 3-4
        wait_for(lambda: lookup(redis_server.url, h) == {"a": 10, "b": 3})
        pa.publish([BlockEvent(False, (h[6],))])  # evicted: the prefix stops before it
        wait_for(lambda: lookup(redis_server.url, h)["a"] == 6)
        other = chain([7] * 40)
        assert lookup(redis_server.url, other) == {"a": 0, "b": 0}
        assert lookup(redis_server.url, []) == {"a": 0, "b": 0}
        # Longer than one SMISMEMBER chunk: 2,500 blocks.
        long = chain(list(range(10_000)))
        pa.publish([BlockEvent(True, tuple(long))])
        wait_for(lambda: lookup(redis_server.url, long)["a"] == 2500)
    finally:
        pa.stop()
        pb.stop()
    assert lookup(redis_server.url, h) == {}  # stop() unregisters


def test_dead_node_expires_and_is_cleaned_up(redis_server):
    h = chain(list(range(16)))
    p = publisher(redis_server.url, "a", ttl_s=1.0)
    p.publish([BlockEvent(True, tuple(h))])
    wait_for(lambda: lookup(redis_server.url, h) == {"a": 4})
    p.stop(unregister=False)  # as if killed: the heartbeat just stops
    start = time.monotonic()
    wait_for(lambda: lookup(redis_server.url, h) == {}, timeout=5)
    assert time.monotonic() - start <= 2.5
    r = redis.Redis.from_url(redis_server.url)
    ns = namespace(MODEL)
    assert not r.exists(f"{ns}:blocks:a") and not r.sismember(f"{ns}:nodes", "a")


def test_redis_restart_is_republished_without_restarting_the_node(redis_server):
    h = chain(list(range(32)))
    p = publisher(redis_server.url, "a", ttl_s=1.5)
    try:
        p.publish([BlockEvent(True, tuple(h[:5]))])
        wait_for(lambda: lookup(redis_server.url, h) == {"a": 5})
        redis_server.kill()
        with pytest.raises(IndexUnavailable):
            lookup(redis_server.url, h)
        p.publish([BlockEvent(True, tuple(h[5:8]))])  # while Redis is down
        time.sleep(0.5)
        redis_server.start()  # empty: its data died with it
        wait_for(lambda: lookup(redis_server.url, h) == {"a": 8})
        assert p.num_full_syncs >= 2
    finally:
        p.stop()


def test_flushed_redis_is_noticed_by_the_heartbeat(redis_server):
    h = chain(list(range(16)))
    p = publisher(redis_server.url, "a", ttl_s=0.9)
    try:
        p.publish([BlockEvent(True, tuple(h))])
        wait_for(lambda: lookup(redis_server.url, h) == {"a": 4})
        redis.Redis.from_url(redis_server.url).flushall()  # Redis lost everything, connection kept
        wait_for(lambda: lookup(redis_server.url, h) == {"a": 4}, timeout=3)
    finally:
        p.stop()


def test_lookup_is_bounded_and_backs_off_when_redis_is_down(redis_server):
    redis_server.kill()

    async def go():
        index = PrefixIndex(redis_server.url, MODEL, timeout_s=0.05, retry_s=0.5)
        try:
            t = time.monotonic()
            with pytest.raises(IndexUnavailable):
                await index.lookup(chain(list(range(8))))
            first = time.monotonic() - t
            t = time.monotonic()
            with pytest.raises(IndexUnavailable):
                await index.lookup(chain(list(range(8))))
            return first, time.monotonic() - t
        finally:
            await index.close()

    first, second = asyncio.run(go())
    assert first < 0.5 and second < 0.005


def test_lookup_timeout_on_a_stalled_redis(redis_server):
    r = redis.Redis.from_url(redis_server.url)
    r.client_pause(1500)  # Redis stops answering clients for 1.5 s

    async def go():
        index = PrefixIndex(redis_server.url, MODEL, timeout_s=0.1, retry_s=0.2)
        try:
            t = time.monotonic()
            with pytest.raises(IndexUnavailable):
                await index.lookup(chain(list(range(8))))
            return time.monotonic() - t
        finally:
            await index.close()

    assert asyncio.run(go()) < 0.5


def test_recent_routes_count_leading_hashes_and_expire():
    h = chain(list(range(20)))
    routes = RecentRoutes(ttl_s=0.2)
    routes.note("a", h[:3])
    assert routes.hits("a", h) == 3 and routes.hits("b", h) == 0
    routes.note("b", h[1:5])  # no first block: no prefix
    assert routes.hits("b", h) == 0
    time.sleep(0.25)
    assert routes.hits("a", h) == 0
    small = RecentRoutes(max_entries=2)
    small.note("a", h[:3])
    assert small.hits("a", h) == 0  # the oldest entry was dropped

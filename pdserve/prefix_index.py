"""The cluster's prefix-cache index in Redis: nodes publish the block hashes they hold, the proxy
asks which node holds the longest prefix of a prompt.

Keys, all under ``pdserve:<model id>`` (the same namespace as the block hashes, docs/architecture.md
"Prefix hashing and the index")::

    <ns>:nodes           SET of registered node ids
    <ns>:hb:<node id>    the node's heartbeat: JSON {node_id, role, url}, expires after its TTL
    <ns>:blocks:<id>     SET of the raw 32-byte hashes of the full blocks the node holds

A node's ``IndexPublisher`` (its own thread) mirrors the engine's block events into its set
in pipelined batches and refreshes the heartbeat every third of the TTL. Whenever it cannot
be sure Redis has its whole set — first start, a failed write, a heartbeat that finds its key
gone (Redis restarted, or the node was presumed dead) — it rewrites the set from its mirror
in one transaction. The proxy's ``PrefixIndex.lookup`` runs one Lua script (EVALSHA): for
every node with a live heartbeat, the number of leading blocks of the prompt's chain in its
set; nodes whose heartbeat expired are dropped from ``nodes`` and their sets deleted there.

The index is a hint. A stale entry costs a cache miss, never a wrong answer: the node
computes whatever it does not hold. When Redis is down or slow, ``lookup`` gives up within
its timeout and stays away for ``retry_s``; the proxy then routes on load alone.
The scripts touch keys they do not declare, so they need a single Redis, not Redis Cluster.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import redis
import redis.asyncio

from pdserve.hashing import BlockEvent, BlockHash

logger = logging.getLogger(__name__)

CHUNK = 1000
"""Hashes per SADD/SREM/SMISMEMBER call (Lua's unpack has a stack limit)."""

LOOKUP_SCRIPT = """
local ns = ARGV[1]
local chunk = tonumber(ARGV[2])
local n = #ARGV - 2
local ids = redis.call('SMEMBERS', ns .. ':nodes')
local out = {}
for _, id in ipairs(ids) do
  if redis.call('EXISTS', ns .. ':hb:' .. id) == 1 then
    local key = ns .. ':blocks:' .. id
    local hit = 0
    local i = 1
    while i <= n do
      local j = math.min(i + chunk - 1, n)
      local found = redis.call('SMISMEMBER', key, unpack(ARGV, i + 2, j + 2))
      local all = true
      for k = 1, #found do
        if found[k] == 1 then hit = hit + 1 else all = false; break end
      end
      if not all then break end
      i = j + 1
    end
    out[#out + 1] = id
    out[#out + 1] = hit
  else
    redis.call('SREM', ns .. ':nodes', id)
    redis.call('DEL', ns .. ':blocks:' .. id)
  end
end
return out
"""


def redacted(url: str) -> str:
    """The Redis URL without its password, for logs."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def namespace(model_id: str) -> str:
    return f"pdserve:{model_id}"


def _chunks(items: Sequence[bytes], size: int = CHUNK):
    for i in range(0, len(items), size):
        yield items[i : i + size]


@dataclass(frozen=True)
class NodeRegistration:
    """What a node's heartbeat key holds."""

    node_id: str
    role: str
    url: str

    def encode(self) -> str:
        return json.dumps({"node_id": self.node_id, "role": self.role, "url": self.url})


class IndexPublisher:
    """Mirrors one node's cached block hashes into Redis and keeps its heartbeat alive.

    ``publish`` is called on the engine thread with the block pool's events; everything else
    happens on the publisher's own thread, so a slow or dead Redis never stalls the engine.
    """

    def __init__(
        self,
        url: str,
        model_id: str,
        registration: NodeRegistration,
        ttl_s: float = 5.0,
        flush_interval_s: float = 0.02,
        timeout_s: float = 1.0,
    ) -> None:
        self.ns = namespace(model_id)
        self.registration = registration
        self.ttl_s = ttl_s
        self.flush_interval_s = flush_interval_s
        self._redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        node = registration.node_id
        self._blocks_key = f"{self.ns}:blocks:{node}"
        self._hb_key = f"{self.ns}:hb:{node}"
        self._nodes_key = f"{self.ns}:nodes"
        self._pending: list[BlockEvent] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prefix-index", daemon=True)
        self.held: set[BlockHash] = set()
        """The hashes the node holds, as far as the events say (publisher thread only)."""
        self.in_sync = False
        """Whether Redis is known to hold exactly ``held`` (publisher thread only)."""
        self.num_full_syncs = 0
        self.num_errors = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self, unregister: bool = True) -> None:
        """Stop publishing; ``unregister`` removes the node from the index at once."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        if unregister:
            try:
                pipe = self._redis.pipeline(transaction=True)
                pipe.delete(self._hb_key, self._blocks_key)
                pipe.srem(self._nodes_key, self.registration.node_id)
                pipe.execute()
            except (redis.RedisError, OSError):
                pass
        self._redis.close()

    def publish(self, events: Sequence[BlockEvent]) -> None:
        """Queue block events (any thread); they reach Redis within ``flush_interval_s``."""
        if events:
            with self._lock:
                self._pending.extend(events)
            self._wake.set()

    # -- publisher thread ----------------------------------------------------------------------

    def _run(self) -> None:
        next_beat = 0.0
        backoff = 0.1
        while not self._stop.is_set():
            if self.in_sync:
                if self._wake.wait(timeout=max(0.0, next_beat - time.monotonic())):
                    self._stop.wait(self.flush_interval_s)  # let a batch gather
            else:
                self._stop.wait(backoff)
            self._wake.clear()
            with self._lock:
                events, self._pending = self._pending, []
            try:
                if self.in_sync:
                    self._write_events(events)
                else:
                    self._apply(events)
                now = time.monotonic()
                if not self.in_sync or now >= next_beat:
                    if not self._heartbeat():
                        self._full_sync()
                    next_beat = now + self.ttl_s / 3
                backoff = 0.1
            except (redis.RedisError, OSError) as e:
                if self.in_sync:
                    logger.warning("prefix index at %s unreachable (%s); will republish", self.ns, e)
                self.in_sync = False
                self.num_errors += 1
                backoff = min(2 * backoff, 2.0)

    def _apply(self, events: Sequence[BlockEvent]) -> None:
        for event in events:
            if event.stored:
                self.held.update(event.block_hashes)
            else:
                self.held.difference_update(event.block_hashes)

    def _write_events(self, events: Sequence[BlockEvent]) -> None:
        self._apply(events)  # first: if the write fails, the full sync starts from the truth
        if not events:
            return
        pipe = self._redis.pipeline(transaction=False)
        for event in events:
            op = pipe.sadd if event.stored else pipe.srem
            for chunk in _chunks(event.block_hashes):
                op(self._blocks_key, *chunk)
        pipe.execute()

    def _heartbeat(self) -> bool:
        """Refresh the heartbeat; False when the key had expired or vanished (Redis lost our set)."""
        pipe = self._redis.pipeline(transaction=True)
        pipe.set(self._hb_key, self.registration.encode(), ex=max(1, round(self.ttl_s)), get=True)
        pipe.sadd(self._nodes_key, self.registration.node_id)
        previous, _ = pipe.execute()
        return previous is not None and self.in_sync

    def _full_sync(self) -> None:
        pipe = self._redis.pipeline(transaction=True)
        pipe.delete(self._blocks_key)
        for chunk in _chunks(list(self.held)):
            pipe.sadd(self._blocks_key, *chunk)
        pipe.set(self._hb_key, self.registration.encode(), ex=max(1, round(self.ttl_s)))
        pipe.sadd(self._nodes_key, self.registration.node_id)
        pipe.execute()
        if not self.in_sync:
            logger.info("prefix index: published %d blocks of %s", len(self.held), self.registration.node_id)
        self.in_sync = True
        self.num_full_syncs += 1


class IndexUnavailable(Exception):
    """Redis did not answer the lookup in time (or is being left alone after a failure)."""


class PrefixIndex:
    """The proxy's side: one round trip per prompt, bounded by ``timeout_s``."""

    def __init__(self, url: str, model_id: str, timeout_s: float = 0.05, retry_s: float = 1.0) -> None:
        self.ns = namespace(model_id)
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._redis = redis.asyncio.Redis.from_url(
            url, socket_timeout=max(timeout_s, 0.5), socket_connect_timeout=max(timeout_s, 0.5)
        )
        self._script = self._redis.register_script(LOOKUP_SCRIPT)
        self._down_until = 0.0
        self.last_error = ""

    async def close(self) -> None:
        await self._redis.aclose()

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    async def lookup(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        """node id -> number of leading blocks of ``hashes`` the node holds, for live nodes.

        Raises IndexUnavailable when Redis fails or is slower than ``timeout_s``; after a
        failure, calls fail at once for ``retry_s`` so a dead Redis costs no request any time.
        """
        if not self.available:
            raise IndexUnavailable(self.last_error)
        try:
            flat = await asyncio.wait_for(self._script(args=[self.ns, CHUNK, *hashes]), self.timeout_s)
        except (redis.RedisError, OSError, asyncio.TimeoutError) as e:
            self.last_error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            self._down_until = time.monotonic() + self.retry_s
            raise IndexUnavailable(self.last_error) from None
        return {flat[i].decode(): int(flat[i + 1]) for i in range(0, len(flat), 2)}


class RecentRoutes:
    """The proxy's own memory of where it sent prompts lately, per node.

    Covers the gap between routing a prompt and its blocks reaching Redis (the prefill may
    take a while), so a burst of prompts with one prefix follows the first one. It only
    adds to what Redis answered, and is not used when Redis is unavailable.
    """

    def __init__(self, ttl_s: float = 30.0, max_entries: int = 200_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, BlockHash], float] = OrderedDict()

    def note(self, node_id: str, hashes: Sequence[BlockHash]) -> None:
        expiry = time.monotonic() + self.ttl_s
        for h in hashes:
            key = (node_id, h)
            self._entries[key] = expiry
            self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def forget(self, node_id: str) -> None:
        for key in [k for k in self._entries if k[0] == node_id]:
            del self._entries[key]

    def hits(self, node_id: str, hashes: Sequence[BlockHash]) -> int:
        now = time.monotonic()
        n = 0
        for h in hashes:
            expiry = self._entries.get((node_id, h))
            if expiry is None or expiry < now:
                break
            n += 1
        return n

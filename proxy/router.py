"""The proxy's view of the cluster: which nodes exist, whether they are up and compatible,
how loaded they are, and a policy that orders them for each request.

Start-up waits for every node's ``NodeInfo`` and refuses a cluster whose prefill and decode
nodes disagree on anything that shapes the KV cache (docs/architecture.md, compatibility checks): a
block-size mismatch must stop the proxy, never fail every request later. Afterwards a
poller reads each node's ``NodeLoad``; a node that stops answering leaves the candidate
lists until it answers again, and a node that comes back is checked again before it is used.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import httpx

from pdserve.config import Role
from pdserve.hashing import BlockHash, hash_block_chain
from pdserve.messages import NodeInfo, NodeLoad, mismatches
from pdserve.prefix_index import IndexUnavailable, PrefixIndex, RecentRoutes
from pdserve.proxy.channel import NodeError
from pdserve.proxy.node_client import NodeClient, make_http_client

logger = logging.getLogger(__name__)


class ClusterError(RuntimeError):
    """The cluster cannot be served: nodes unreachable at start-up, or incompatible."""


@dataclass(eq=False)
class NodeState:
    """One node as the proxy sees it. Mutated only on the event loop."""

    url: str
    role: Role  # the part the proxy uses it for: PREFILL or DECODE
    client: NodeClient
    info: NodeInfo | None = None
    load: NodeLoad | None = None
    colocated: bool = False  # listed as a co-located (both) node: it serves whole requests
    num_inflight: int = 0  # this proxy's requests on the node now
    inflight_prefill_tokens: int = 0  # uncached prompt tokens of this proxy's prefills on it now
    up: bool = False
    incompatible: str = ""  # why the node is kept out of routing, if it is
    last_error: str = ""

    def heard_load(self, load: NodeLoad) -> None:
        """The node's load as a poll or its reply to a call said (the newest wins)."""
        self.load = load

    @property
    def available(self) -> bool:
        return self.up and self.info is not None and not self.incompatible

    @property
    def load_score(self) -> int:
        """Requests on the node: our own in-flight count is exact and current, the polled load
        also counts other proxies' requests but is up to a poll interval old; take the larger."""
        polled = self.load.running + self.load.waiting + self.load.waiting_for_kv if self.load else 0
        return max(self.num_inflight, polled)

    @property
    def node_id(self) -> str:
        return self.info.node_id if self.info is not None else ""

    @property
    def queued_prefill_tokens(self) -> int:
        """Prompt tokens the node still has to compute: exact for this proxy's own prefills,
        up to a poll interval old for everyone's; take the larger."""
        polled = self.load.pending_prompt_tokens if self.load else 0
        return max(self.inflight_prefill_tokens, polled)

    @property
    def free_block_fraction(self) -> float:
        if self.load is None or self.load.total_blocks <= 0:
            return 1.0
        return self.load.free_blocks / self.load.total_blocks


@dataclass(frozen=True)
class RouteRequest:
    """What a policy may look at to place a request."""

    request_id: str
    prompt_token_ids: Sequence[int] = field(repr=False)
    block_hashes: Sequence[BlockHash] = field(default=(), repr=False)
    """The prompt's block-hash chain (empty when the cluster is not known yet)."""
    cached_blocks: Mapping[str, int] = field(default_factory=dict)
    """node id -> leading blocks of the prompt the node holds, per the prefix index; empty
    when there is no index or it did not answer."""
    block_size: int = 16
    index: str = "none"
    """What the prefix index said: ok, unavailable (down or slow), none (not configured)."""
    lookup_s: float = 0.0
    """How long the prefix-index lookup took."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def cached_tokens(self, node: NodeState) -> int:
        return min(self.cached_blocks.get(node.node_id, 0) * self.block_size, self.num_tokens)


class RoutingPolicy(ABC):
    """Orders candidate nodes of one role for one request, best first.

    Called on the event loop for every request: it must not block or do I/O. ``candidates``
    is non-empty; the result holds each candidate at most once, and the proxy tries them in
    that order while one is full or unreachable. Policies read ``NodeState`` (in-flight
    counts, last polled load, info) and never modify it.
    """

    @abstractmethod
    def rank(self, role: Role, candidates: Sequence[NodeState], route: RouteRequest) -> list[NodeState]: ...


class LeastLoaded(RoutingPolicy):
    """Fewest requests first; decode ties go to the node with the most free KV blocks, and
    remaining ties rotate so idle nodes share the work."""

    def __init__(self) -> None:
        self._turn = {Role.PREFILL: itertools.count(), Role.DECODE: itertools.count()}

    def rank(self, role: Role, candidates: Sequence[NodeState], route: RouteRequest) -> list[NodeState]:
        n = len(candidates)
        start = next(self._turn[role]) % n

        def key(i: int) -> tuple:
            node = candidates[i]
            free = -node.free_block_fraction if role == Role.DECODE else 0.0
            return (node.load_score, free, (i - start) % n)

        return [candidates[i] for i in sorted(range(n), key=key)]


class RoundRobin(RoutingPolicy):
    """Each request starts one node further along the list."""

    def __init__(self) -> None:
        self._turn = {Role.PREFILL: itertools.count(), Role.DECODE: itertools.count()}

    def rank(self, role: Role, candidates: Sequence[NodeState], route: RouteRequest) -> list[NodeState]:
        start = next(self._turn[role]) % len(candidates)
        return list(candidates[start:]) + list(candidates[:start])


class PrefixAware(RoutingPolicy):
    """Prefill nodes by ``UNCACHED_WEIGHT x`` (the prompt's uncached part there) ``+`` (their
    queued prefill tokens). The queue term is the wait before this prompt's first token; the
    uncached term also counts as work taken from every later prompt on that node (and cache
    space spent on a second copy), hence its weight. A node holding the prefix wins until its
    queue outweighs about twice the prefix; then another node computes the prefix too, so one
    hot prefix spreads instead of melting one node. Decode nodes: those within
    ``decode_slack(least load)`` requests of the least loaded one count as equally loaded and
    go by how much of the prompt they hold (blocks that need not move, or be computed there),
    then by load and free blocks; a multi-turn conversation thus returns to the node that holds
    its history unless that node is clearly busier. Without index hits this is least-loaded."""

    UNCACHED_WEIGHT = 2

    @staticmethod
    def decode_slack(least_load: int) -> int:
        return max(2, least_load // 8)

    def __init__(self) -> None:
        self._turn = {Role.PREFILL: itertools.count(), Role.DECODE: itertools.count()}

    def rank(self, role: Role, candidates: Sequence[NodeState], route: RouteRequest) -> list[NodeState]:
        n = len(candidates)
        start = next(self._turn[role]) % n
        if role == Role.DECODE and candidates:
            least = min(node.load_score for node in candidates)
            busy_above = least + self.decode_slack(least)

        def key(i: int) -> tuple:
            node = candidates[i]
            cached = route.cached_tokens(node)
            if role == Role.PREFILL:
                cost = self.UNCACHED_WEIGHT * (route.num_tokens - cached) + node.queued_prefill_tokens
                return (cost, -cached, (i - start) % n)
            load = node.load_score
            tier = 0 if load <= busy_above else load
            return (tier, -cached, load, -node.free_block_fraction, (i - start) % n)

        return [candidates[i] for i in sorted(range(n), key=key)]


POLICIES: dict[str, type[RoutingPolicy]] = {
    "prefix-aware": PrefixAware,
    "least-loaded": LeastLoaded,
    "round-robin": RoundRobin,
}


class Router:
    """Node registry, start-up compatibility check, load poller and the routing policy."""

    def __init__(
        self,
        prefill_urls: Sequence[str],
        decode_urls: Sequence[str],
        http: Callable[[], httpx.AsyncClient] = make_http_client,
        cluster_token: str = "",
        policy: RoutingPolicy | None = None,
        poll_interval_s: float = 1.0,
        both_urls: Sequence[str] = (),
        redis_url: str = "",
        index_timeout_s: float = 0.1,
    ) -> None:
        # One HTTP client (connection pool) per node: httpcore scans its whole pool, a poll() per idle
        # connection, whenever a request takes or gives back a connection, so one pool shared by every
        # node cost each call in proportion to the cluster's connections (9 % of a busy proxy's time).
        def state(url: str, role: Role, colocated: bool = False) -> NodeState:
            node = NodeState(url, role, NodeClient(url, http(), cluster_token), colocated=colocated)
            node.client.on_load = node.heard_load
            return node

        self.prefill = [state(u, Role.PREFILL) for u in prefill_urls]
        self.decode = [state(u, Role.DECODE) for u in decode_urls]
        self.decode += [state(u, Role.DECODE, colocated=True) for u in both_urls]
        self.policy = policy or LeastLoaded()
        self.poll_interval_s = poll_interval_s
        self.redis_url = redis_url
        self.index_timeout_s = index_timeout_s
        self.index: PrefixIndex | None = None  # set up at start, once the model id is known
        self.recent = RecentRoutes()
        self.reference: NodeInfo | None = None  # the info every node is checked against
        self._poller: asyncio.Task | None = None

    @property
    def nodes(self) -> list[NodeState]:
        return self.prefill + self.decode

    @property
    def max_model_len(self) -> int:
        """The longest prompt + output every node accepts."""
        lens = [n.info.max_model_len for n in self.nodes if n.info is not None and not n.incompatible]
        return min(lens) if lens else 0

    @property
    def vocab_size(self) -> int:
        return self.reference.vocab_size if self.reference is not None else 0

    # -- start-up ----------------------------------------------------------------------------

    async def start(self, model_id: str | None, timeout_s: float) -> None:
        """Wait for every node's info, check the cluster, start polling; raises ClusterError."""
        await self._fetch_all_info(timeout_s)
        self.check_cluster(model_id)
        self.reference = self.nodes[0].info
        for node in self.nodes:
            node.up = True
        if self.redis_url:
            self.index = PrefixIndex(self.redis_url, self.reference.model_id, self.index_timeout_s)
        self._poller = asyncio.ensure_future(self._poll_forever())

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
            self._poller = None
        if self.index is not None:
            await self.index.close()
        await asyncio.gather(*(node.client.close() for node in self.nodes), return_exceptions=True)

    async def _fetch_all_info(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(self.nodes)
        next_log = time.monotonic() + 5.0
        while True:
            results = await asyncio.gather(
                *(n.client.info(timeout=min(5.0, timeout_s)) for n in pending), return_exceptions=True
            )
            still = []
            for node, result in zip(pending, results):
                if isinstance(result, NodeInfo):
                    node.info = result
                    if result.channel_port:
                        await node.client.use_info(result)
                    continue
                if isinstance(result, NodeError) and 400 <= result.status < 500:
                    hint = " (check --cluster-token)" if result.status in (401, 403) else ""
                    raise ClusterError(
                        f"{node.role} node {node.url} refused /internal/info with HTTP {result.status}: "
                        f"{result.message}{hint}"
                    )
                if not isinstance(result, Exception):
                    raise result  # CancelledError and friends
                node.last_error = str(result)
                still.append(node)
            pending = still
            if not pending:
                return
            now = time.monotonic()
            if now >= deadline:
                details = "; ".join(f"{n.role} node {n.url}: {n.last_error}" for n in pending)
                raise ClusterError(f"nodes did not answer /internal/info within {timeout_s:g} s: {details}")
            if now >= next_log:
                logger.info("waiting for %s", ", ".join(f"{n.role} node {n.url}" for n in pending))
                next_log = now + 10.0
            await asyncio.sleep(min(0.5, max(0.0, deadline - now)))

    def check_cluster(self, model_id: str | None) -> None:
        """Raise ClusterError naming the field and both values of any disagreement."""
        problems = []
        for node in self.nodes:
            assert node.info is not None
            if not Role(node.info.role).serves(node.role):
                problems.append(
                    f"{node.url} is listed as a {node.role} node but reports role {node.info.role!r}"
                )
            if not node.info.channel_port:
                problems.append(f"{node.url} reports no request channel (a node of an older pdserve?)")
            if node.colocated and node.info.role != Role.BOTH:
                problems.append(f"{node.url} is listed as co-located but reports role {node.info.role!r}")
            if model_id is not None and node.info.model_id != model_id:
                problems.append(
                    f"model_id: the proxy's --model gives {model_id!r} but {node.role} node {node.url} "
                    f"serves {node.info.model_id!r}"
                )
        for p in self.prefill:
            for d in self.decode:
                for name, pv, dv in mismatches(p.info, d.info):
                    if name == "model_id" and model_id is not None:
                        continue  # already reported against the proxy's model
                    problems.append(
                        f"{name}: prefill node {p.url} has {pv!r} but decode node {d.url} has {dv!r}"
                    )
        if problems:
            raise ClusterError("incompatible cluster: " + "; ".join(problems))

    # -- polling -----------------------------------------------------------------------------

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            await asyncio.gather(*(self._poll(n) for n in self.nodes), return_exceptions=True)

    async def _poll(self, node: NodeState) -> None:
        try:
            load = await node.client.load(timeout=max(1.0, 2 * self.poll_interval_s))
            if not node.up:
                await self._recheck(node)
        except NodeError as exc:
            self.mark_down(node, exc.message)
            return
        node.heard_load(load)
        if not node.up:
            node.up = True
            logger.info("%s node %s is back", node.role, node.url)

    async def _recheck(self, node: NodeState) -> None:
        """A node that comes back may have restarted with other settings: compare it again."""
        info = await node.client.info()
        problems = [f"{f}: {v!r} instead of {r!r}" for f, v, r in mismatches(info, self.reference)]
        if not Role(info.role).serves(node.role):
            problems.append(f"role {info.role!r}")
        if not info.channel_port:
            problems.append("no request channel")
        else:
            await node.client.use_info(info)
        node.info = info
        reason = "; ".join(problems)
        if reason and reason != node.incompatible:
            logger.error("%s node %s came back incompatible, not using it: %s", node.role, node.url, reason)
        node.incompatible = reason

    def mark_down(self, node: NodeState, error: str) -> None:
        if node.up:
            logger.warning("%s node %s is down: %s", node.role, node.url, error)
            self.recent.forget(node.node_id)  # it may come back with an empty cache
        node.up = False
        node.last_error = error

    # -- routing -----------------------------------------------------------------------------

    async def route(self, request_id: str, prompt_token_ids: Sequence[int]) -> RouteRequest:
        """The request with its block-hash chain and what each node holds of it.

        One prefix-index round trip, bounded by ``index_timeout_s``; on failure the request is
        routed on load alone (``index="unavailable"``), never failed.
        """
        ref = self.reference
        if ref is None:
            return RouteRequest(request_id, prompt_token_ids)
        hashes = hash_block_chain(prompt_token_ids, ref.block_size, ref.model_id)
        cached: dict[str, int] = {}
        state = "none"
        elapsed = 0.0
        if self.index is not None:
            start = time.monotonic()
            try:
                cached = await self.index.lookup(hashes)
                state = "ok"
            except IndexUnavailable as e:
                state = "unavailable"
                logger.debug("prefix index unavailable: %s", e)
            elapsed = time.monotonic() - start
        if state == "ok":
            for node in self.nodes:
                node_id = node.node_id
                cached[node_id] = max(cached.get(node_id, 0), self.recent.hits(node_id, hashes))
        return RouteRequest(request_id, prompt_token_ids, hashes, cached, ref.block_size, state, elapsed)

    def rank(self, role: Role, route: RouteRequest) -> list[NodeState]:
        """Candidates of ``role`` for this request, best first; empty when no node is usable."""
        nodes = self.prefill if role == Role.PREFILL else self.decode
        candidates = [n for n in nodes if n.available]
        if not candidates:
            # All marked down: they may be back before the next poll, so try them anyway.
            candidates = [n for n in nodes if n.info is not None and not n.incompatible]
        if not candidates:
            return []
        return self.policy.rank(role, candidates, route)

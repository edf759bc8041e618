"""One request's trip through the cluster (docs/architecture.md, life of a request, steps 2-6).

Every call below travels on the node's request channel (pdserve.proxy.channel).

1. Reserve KV blocks on a decode node (``ReserveRequest``), trying nodes in the policy's
   order; a node with no free blocks (503) sends us to the next, and when every node is
   full the request waits up to ``admission_wait_s`` before it gets a 429.
2. Send the prompt and the landing descriptor to a prefill node (``PrefillRequest``). Its
   reply is control-plane only (ok or an error).
3. At the same time open the decode node's token stream (``StreamRequest``): the decode
   node keeps the request's outputs from its reservation on, so no token can be missed, and
   the prefill need not wait for the stream's round trip.
4. Relay ``TokenEvent``s until one carries ``finish_reason``.

Every way out releases what was taken: a failed prefill, a dead or misbehaving node, the
deadline or the client leaving aborts the request on each node still holding it
(``AbortRequest``; a proxy worker that goes away altogether loses its requests on every
node). Aborts run as background tasks so that they survive the cancellation that triggered them.

Migration (as NVIDIA Dynamo does it): when a node dies under a request (its connection drops,
or the token stream ends before the final event) the request starts over on the surviving
nodes, at most ``max_migrations`` times, under a node request id of its own
(``<id>-m<n>``) so that nothing the dead attempt left behind can be mistaken for it. The new
attempt's prompt is the original prompt plus the tokens already streamed and its
``max_tokens``/``min_tokens`` are what is left, so the client sees one uninterrupted stream and
greedy output equals an undisturbed run. (A seeded sampled request continues with a fresh
generator; stop strings that straddle the cut are not seen.) A parallel-sampling request (``n`` or
``best_of`` > 1) that had streamed tokens moves sequence by sequence: each one not yet ended goes on
as a request of its own from its tokens so far, its events relayed under its index.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import Coroutine
from typing import Any

import msgspec

from pdserve.config import Role
from pdserve.messages import (
    LandingDescriptor,
    PrefillLanding,
    PrefillRequest,
    PrefillResult,
    ReserveRequest,
    StreamRequest,
    TokenEvent,
)
from pdserve.metrics import LATENCY_BUCKETS, Registry
from pdserve.proxy.channel import NodeError
from pdserve.proxy.early_prefills import EarlyPrefills, Ticket
from pdserve.proxy.protocol import ProxyError
from pdserve.proxy.router import NodeState, Router, RouteRequest
from pdserve.sampling_params import SamplingParams
from pdserve.utils import cdiv, wait_at_most

logger = logging.getLogger(__name__)

INDEX_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)


class Dispatcher:
    """Starts ``Generation``s and owns the background abort tasks they leave behind."""

    def __init__(
        self,
        router: Router,
        registry: Registry,
        lease_s: float = 30.0,
        admission_wait_s: float = 5.0,
        min_remote_prefill_tokens: int = 0,
        policy_name: str = "",
        max_migrations: int = 2,
        overlap_reserve: bool = True,
    ) -> None:
        self.router = router
        self.max_migrations = max_migrations
        self.overlap_reserve = overlap_reserve
        self.lease_s = lease_s
        self.admission_wait_s = admission_wait_s
        self.min_remote_prefill_tokens = min_remote_prefill_tokens
        self.policy_name = policy_name
        self._background: set[asyncio.Task] = set()
        self.early = EarlyPrefills()
        self.decisions = registry.counter(
            "pdserve_routing_decisions_total",
            "Where each request's prompt was computed, and why: remote_prefill(_cached) on a prefill "
            "node; on the decode node for colocated, no_prefill_node, short_prompt, decode_holds_prefix.",
            ["policy", "reason"],
        )
        self.index_lookup = registry.histogram(
            "pdserve_prefix_index_lookup_seconds",
            "Round trip of one prefix-index lookup in Redis (failures included).",
            buckets=INDEX_BUCKETS,
        )
        self.index_unavailable = registry.counter(
            "pdserve_prefix_index_unavailable_total",
            "Requests routed on load alone because the prefix index failed or was too slow.",
        )
        self.aborts = registry.counter(
            "pdserve_node_aborts_total", "Abort requests the proxy sent to nodes.", ["role"]
        )
        self.full_rejections = registry.counter(
            "pdserve_decode_full_total", "Reservations a decode node refused for lack of free KV blocks."
        )
        self.early_prefills_dropped = registry.counter(
            "pdserve_early_prefills_dropped_total",
            "Prompts sent to a prefill node while their decode node reserved (the overlap) and dropped "
            "before a landing came: the reservation failed, the request ended, or the decode node "
            "computes the prompt itself. Prefill work thrown away.",
            ["reason"],
        )
        self.migrations = registry.counter(
            "pdserve_request_migrations_total",
            "Requests restarted on other nodes because a node died under them, by the dead node's role.",
            ["role"],
        )
        self.reserve_latency = registry.histogram(
            "pdserve_reserve_seconds",
            "From routing a request to its KV blocks reserved on a decode node (admission waits included).",
            buckets=LATENCY_BUCKETS,
        )
        self.prefill_latency = registry.histogram(
            "pdserve_prefill_call_seconds",
            "From sending a prefill request to its result (KV committed on the decode node).",
            buckets=LATENCY_BUCKETS,
        )

    def start(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, deadline: float
    ) -> Generation:
        """Begin a request; ``deadline`` is on the ``time.monotonic()`` clock."""
        return Generation(self, request_id, prompt_token_ids, params, deadline)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._reap)
        return task

    def _reap(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("background task failed: %r", task.exception())

    def plan_prefill(self, decode: NodeState, route: RouteRequest) -> str:
        """Why the prompt should be computed on ``decode`` itself, or "" to use a prefill node.

        Conditional disaggregation: a remote prefill costs a hop and a KV transfer, and pays off
        only when the decode node would otherwise compute many prompt tokens between its
        decode steps.
        """
        if decode.colocated:
            return "colocated"
        if not any(n.available for n in self.router.prefill):
            return "no_prefill_node"
        cached = route.cached_tokens(decode)
        if route.num_tokens - cached < self.min_remote_prefill_tokens:
            return "decode_holds_prefix" if cached > 0 else "short_prompt"
        return ""

    def decide(self, reason: str) -> None:
        self.decisions.labels(self.policy_name, reason).inc()

    def abort(self, node: NodeState, request_id: str) -> asyncio.Task:
        self.aborts.labels(node.role).inc()
        return self.spawn(self._abort(node, request_id))

    async def _abort(self, node: NodeState, request_id: str) -> None:
        try:
            await node.client.abort(request_id)
        except NodeError as exc:
            # The node may be dead (its blocks die with it) or have finished the request already.
            logger.info("abort of %s on %s node %s failed: %s", request_id, node.role, node.url, exc.message)

    async def close(self, timeout: float = 5.0) -> None:
        """Let pending aborts finish (bounded) at shutdown."""
        if self._background:
            await asyncio.wait(list(self._background), timeout=timeout)


class NodeDied(Exception):
    """A node stopped answering in the middle of a request (connection lost, stream cut short)."""

    def __init__(self, node: NodeState, message: str) -> None:
        super().__init__(f"{node.role} node {node.url}: {message}")
        self.node = node
        self.message = message


def _has_room(decode: NodeState, route: RouteRequest) -> bool:
    """Whether ``decode``, as it last said, has free KV blocks for the part of the prompt it does
    not hold (unknown: yes)."""
    load = decode.load
    if load is None:
        return True
    return load.free_blocks >= cdiv(route.num_tokens - route.cached_tokens(decode), route.block_size)


def _node_failure(node: NodeState, exc: NodeError, what: str) -> ProxyError:
    """What the client is told when a node call fails."""
    if exc.status == 400:
        return ProxyError(400, exc.message)  # the node judged the request itself (prompt too long...)
    if exc.unreachable:
        return ProxyError(503, f"{what}: {node.role} node {node.url} is unreachable ({exc.message})")
    return ProxyError(502, f"{what}: {node.role} node {node.url} answered {exc.status}: {exc.message}")


class Generation:
    """A request in flight: read events with ``next()``; ``cancel()`` aborts it everywhere.

    The protocol runs in its own task, so the deadline and the cleanup do not depend on how (or
    whether) the caller keeps reading. Token events do not pass through that task: the channel's
    reader hands each one to ``_on_event``, which checks it and queues it for the caller, so a
    token costs one task switch in the proxy (the caller's).
    """

    def __init__(
        self,
        dispatcher: Dispatcher,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        deadline: float,
        migrations: int = 0,
    ) -> None:
        self.d = dispatcher
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.deadline = deadline
        self.node_request_id = request_id  # this attempt's id on the nodes
        self.emitted: list[int] = []  # output tokens handed to the caller so far
        self.migrations = migrations  # times the request moved (its sequences' own requests count on)
        self._several = params.num_sequences > 1  # parallel sampling: sequences move one by one
        self._by_index: dict[int, list[int]] = {}  # parallel sampling: tokens streamed per sequence
        self._ended: set[int] = set()  # parallel sampling: sequences whose final event was streamed
        self.decode_node: NodeState | None = None
        self.prefill_node: NodeState | None = None
        self.prefill_result: PrefillResult | None = None
        self.finished = False  # the decode node sent the final event
        self._prefill_pending = False  # a prefill call was sent and not answered
        self._prefill_task: asyncio.Future | None = None  # this attempt's prefill call
        self._prefill_settled = False  # the prefill call was handed to ``_generate``, which settles it
        self._prefill_counted = False
        self._early_ticket: Ticket | None = None  # a dropped early prefill's, settled by its abort
        # What the caller reads: events, then None or a ProxyError (one reader, no bound: the
        # node's pace bounds it).
        self._items: collections.deque[TokenEvent | ProxyError | None] = collections.deque()
        self._waiter: asyncio.Future | None = None
        # This attempt's token stream: ends with the final events, or with what failed it.
        self._stream_end: asyncio.Future | None = None
        self._num_open = 0  # sequences of this attempt still streaming
        self._held: list[TokenEvent] | None = None  # events waiting for the prefill's prompt logprobs
        self._first = True  # the next event is the attempt's first
        self._timed_out = False  # the deadline cancelled ``_task``
        self._task = asyncio.ensure_future(self._run())

    def _put(self, item: TokenEvent | ProxyError | None) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next(self) -> TokenEvent | None:
        """The next event; None after the final one; raises ProxyError if the request failed."""
        items = self._items
        while not items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = items.popleft()
        if isinstance(item, ProxyError):
            raise item
        return item

    def cancel(self) -> None:
        """The client is gone: stop, aborting on every node that holds the request."""
        if not self.finished:
            self._task.cancel()

    # -- the protocol --------------------------------------------------------------------------

    def _time_out(self) -> None:
        """The deadline passed: cancel the protocol, whose cleanup runs, and answer 504."""
        if not self._task.done():
            self._timed_out = True
            self._task.cancel()

    async def _run(self) -> None:
        # The deadline is a timer that cancels this task, not asyncio.wait_for, which on Python 3.11
        # runs the protocol in a second task: a cost every request would pay.
        timeout = max(0.0, self.deadline - time.monotonic())
        timer = asyncio.get_running_loop().call_later(timeout, self._time_out)
        try:
            await self._protocol()
            self._put(None)
        except asyncio.CancelledError:
            if not self._timed_out:
                raise
            self._task.uncancel()
            self._put(ProxyError(504, f"the request did not finish within {timeout:.0f} s"))
        except ProxyError as exc:
            self._put(exc)
        except Exception as exc:  # a bug: tell the client, keep the server up
            logger.exception("request %s failed", self.request_id)
            self._put(ProxyError(500, f"internal error: {type(exc).__name__}: {exc}"))
        finally:
            timer.cancel()
            if self._early_ticket is not None:  # every path settles it; this is the backstop
                self.d.early.settle(self._early_ticket)

    async def _protocol(self) -> None:
        while True:
            try:
                await self._attempt()
                return
            except NodeDied as exc:
                several = self._several and bool(self.emitted)
                limit = self.params.max_tokens
                if not several and limit is not None and len(self.emitted) >= limit:  # after the last token
                    self.finished = True
                    n = len(self.prompt_token_ids)
                    self._put(
                        TokenEvent(self.request_id, [], "", finish_reason="length", num_prompt_tokens=n)
                    )
                    return
                if self.migrations >= self.d.max_migrations:
                    raise ProxyError(
                        503, f"{exc}; the request already moved {self.migrations} time(s), giving up"
                    ) from None
                self.migrations += 1
                self.d.migrations.labels(exc.node.role).inc()
                self.d.router.mark_down(exc.node, exc.message)
                self.node_request_id = f"{self.request_id}-m{self.migrations}"
                logger.warning(
                    "request %s moves to other nodes (%d output tokens so far): %s",
                    self.request_id,
                    len(self.emitted),
                    exc,
                )
                if several:
                    await self._resume_sequences()
                    return

    async def _resume_sequences(self) -> None:
        """A parallel-sampling request whose node died mid-stream: each sequence not yet ended goes
        on as a request of its own (the prompt and that sequence's tokens so far, its parameters as
        ``SamplingParams.for_sequence`` gives them, what is left of its budget), routed afresh; their
        events come out under the sequence's index, as one stream. Greedy sequences go on as if
        unmoved; sampled ones with a fresh generator (seeded ``seed + index`` when the request was).
        The first failure of one ends the request (the others are aborted)."""
        p, n = self.params, len(self.prompt_token_ids)
        loop = asyncio.get_running_loop()
        self._stream_end = loop.create_future()
        self._num_open = p.num_sequences - len(self._ended)
        resumed: dict[int, Generation] = {}
        for i in range(p.num_sequences):
            if i in self._ended:
                continue
            done = self._by_index.get(i, [])
            q = p.for_sequence(i)
            if q.max_tokens is not None and len(done) >= q.max_tokens:  # died after its last token
                self._deliver(
                    TokenEvent(self.request_id, [], "", finish_reason="length", num_prompt_tokens=n, index=i)
                )
                continue
            q = dataclasses.replace(
                q,
                max_tokens=None if q.max_tokens is None else q.max_tokens - len(done),
                min_tokens=max(0, q.min_tokens - len(done)),
                resumed_tokens=len(done),
                prompt_logprobs=None,  # the client had them with the first events
            )
            rid = f"{self.request_id}-m{self.migrations}-s{i}"
            resumed[i] = Generation(
                self.d, rid, self.prompt_token_ids + done, q, self.deadline, self.migrations
            )

        async def relay(i: int, gen: Generation) -> None:
            while (event := await gen.next()) is not None:
                self._deliver(
                    msgspec.structs.replace(
                        event,
                        request_id=self.request_id,
                        index=i,
                        num_prompt_tokens=n,
                        num_cached_tokens=min(event.num_cached_tokens, n),
                    )
                )

        relays = [asyncio.ensure_future(relay(i, gen)) for i, gen in resumed.items()]
        try:
            await asyncio.gather(*relays)
        finally:
            for gen in resumed.values():
                gen.cancel()
            for task in relays:
                task.cancel()
            await asyncio.gather(*relays, return_exceptions=True)

    @property
    def _wall_deadline(self) -> float:
        """The deadline on the nodes' clock (``time.time()``): they drop the request after it."""
        return time.time() + (self.deadline - time.monotonic())

    @property
    def _prompt(self) -> list[int]:
        return self.prompt_token_ids + self.emitted if self.emitted else self.prompt_token_ids

    @property
    def _params(self) -> SamplingParams:
        """What is left of the request's sampling parameters after the tokens already streamed."""
        n = len(self.emitted)
        p = self.params
        if not n or (p.max_tokens is not None and p.max_tokens <= n):
            return p
        return dataclasses.replace(
            p,
            max_tokens=None if p.max_tokens is None else p.max_tokens - n,
            min_tokens=max(0, p.min_tokens - n),
            resumed_tokens=n,  # the grammar and the output penalties go on from where they were
        )

    async def _attempt(self) -> None:
        self.prefill_node = None
        self.prefill_result = None
        self._prefill_pending = False
        self._prefill_settled = False
        self._prefill_counted = False  # this attempt's prefill decision was counted
        route = await self.d.router.route(self.node_request_id, self._prompt)
        if route.index != "none":
            self.d.index_lookup.observe(route.lookup_s)
            if route.index == "unavailable":
                self.d.index_unavailable.inc()
        # The prompt goes to a prefill node while the decode node reserves (its landing follows),
        # when the decode node first in line would have it computed on a prefill node and, as it
        # last said, has the blocks for it (a full one may keep the reservation waiting, and a
        # prompt computed for a reservation that never comes is work lost). The ranking is taken
        # once (``_reserve`` starts with it): a policy's rotation turns at each.
        ranked = self.d.router.rank(Role.DECODE, route)
        landing_now: asyncio.Future | None = None
        prefill = None
        if (
            self.d.overlap_reserve
            and ranked
            and not self.d.plan_prefill(ranked[0], route)
            and _has_room(ranked[0], route)
        ):
            landing_now = asyncio.get_running_loop().create_future()
            prefill = asyncio.ensure_future(self._prefill(route, None, landing_now))
        self._prefill_task = prefill
        reserving = time.monotonic()
        try:
            decode, landing = await self._reserve(route, ranked)
        except BaseException as exc:
            if prefill is not None:
                ended = isinstance(exc, asyncio.CancelledError)
                await self._drop_prefill(prefill, "request_ended" if ended else "reservation_failed")
            raise
        self.d.reserve_latency.observe(time.monotonic() - reserving)
        self.decode_node = decode
        rid = self.node_request_id
        if not landing.local_prefill:
            self.d.router.recent.note(decode.node_id, route.block_hashes)  # it will hold the prompt
            if prefill is None:
                prefill = asyncio.ensure_future(self._prefill(route, landing))
            else:
                landing_now.set_result(landing)
        elif prefill is not None:  # the decode node that took it computes the prompt itself
            await self._drop_prefill(prefill, "decode_computes")
            prefill = None
        self._prefill_task = prefill
        end = self._stream_end = asyncio.get_running_loop().create_future()
        self._num_open = self.params.num_sequences  # each sequence ends with an event of its own
        self._held = None
        self._first = True
        try:
            try:
                stream = decode.client.stream(
                    StreamRequest(rid), self._on_event, num_sequences=self.params.num_sequences
                )
                async with stream:
                    if prefill is None:
                        await end
                    else:
                        await self._generate(prefill, end)
            except NodeError as exc:
                if exc.unreachable:
                    raise NodeDied(decode, f"token stream lost: {exc.message}") from None
                raise _node_failure(decode, exc, "token stream failed") from None
        finally:
            if not end.done():
                end.cancel()
            elif not end.cancelled():
                end.exception()  # retrieved: a failure that lost the race to another is no news
            decode.num_inflight -= 1
            if prefill is not None and not self._prefill_settled:  # the stream never opened
                prefill.cancel()
                await asyncio.gather(prefill, return_exceptions=True)
                self._abort_pending_prefill()
            if not self.finished:
                self.d.abort(decode, rid)

    async def _drop_prefill(self, prefill: asyncio.Future, reason: str) -> None:
        """Cancel a prefill started before its landing was known (the request goes no further, or
        the decode node computes it): the node aborts it and frees its blocks. Counted (``reason``)
        when a prefill node had the prompt."""
        if self._prefill_pending:
            self.d.early_prefills_dropped.labels(reason).inc()
        prefill.cancel()
        await asyncio.gather(prefill, return_exceptions=True)
        self._abort_pending_prefill()
        self._prefill_task = None

    def _abort_pending_prefill(self) -> None:
        ticket, self._early_ticket = self._early_ticket, None
        if self._prefill_pending and not self.finished and self.prefill_node is not None:
            task = self.d.abort(self.prefill_node, self.node_request_id)
            if ticket is not None:  # the node's queue counts the prompt until it has the abort
                task.add_done_callback(lambda _: self.d.early.settle(ticket))
        elif ticket is not None:
            self.d.early.settle(ticket)

    async def _generate(self, prefill: asyncio.Future, end: asyncio.Future) -> None:
        """Wait for the stream's end while the prefill runs; every way out settles the prefill call."""
        self._prefill_settled = True
        try:
            done, _ = await asyncio.wait({prefill, end}, return_when=asyncio.FIRST_COMPLETED)
            if prefill in done and prefill.exception() is not None:
                # A transfer fails when its decode node dies: if the stream breaks too, the
                # decode node is the one to blame (and the request can move). A refusal (a full
                # queue, a bad request) is not a transfer's failure: no need to wait for that.
                failure = prefill.exception()
                decode_may_be_dead = isinstance(failure, ProxyError) and failure.status == 502
                if decode_may_be_dead and await wait_at_most(end, 1.0) and not end.cancelled():
                    with contextlib.suppress(ProxyError):
                        end.result()  # raises a broken stream's NodeError
                prefill.result()  # raises the prefill's failure
            await end
        finally:
            if not prefill.done() and self.finished:
                # The decode node has everything; let the prefill reply arrive on its own.
                self.d.spawn(prefill)
            else:
                prefill.cancel()
                await asyncio.gather(prefill, return_exceptions=True)  # also retrieves its exception
            self._abort_pending_prefill()

    # -- the per-token path: called by the channel's reader for each event of the stream ----------

    def _on_event(self, item: TokenEvent | NodeError) -> None:
        end = self._stream_end
        if end is None or end.done():
            return  # the attempt is over (failed or left): what still arrives is nobody's
        try:
            if isinstance(item, NodeError):
                end.set_exception(item)
            elif self._held is not None:
                self._held.append(item)
            else:
                self._relay(item)
        except Exception as exc:  # a bug or a bad event: fail this request, not the channel's reader
            if not end.done():
                end.set_exception(exc)

    def _relay(self, event: TokenEvent) -> None:
        decode = self.decode_node
        if event.error or event.finish_reason in ("abort", "error"):
            reason = event.error or f"finish_reason {event.finish_reason}"
            raise ProxyError(502, f"decode node {decode.url} failed the request: {reason}")
        if event.request_id != self.node_request_id:
            raise ProxyError(502, f"decode node {decode.url} sent an event of {event.request_id!r}")
        if self.migrations:
            # The client asked about its own prompt: the tokens prepended on resumption
            # are neither prompt tokens nor cached ones to it.
            n = len(self.prompt_token_ids)
            event = msgspec.structs.replace(
                event,
                request_id=self.request_id,
                num_prompt_tokens=n,
                num_cached_tokens=min(event.num_cached_tokens, n),
            )
        if self._first:
            self._first = False
            prefill = self._prefill_task
            if self.params.prompt_logprobs is not None and prefill is not None:
                # The prefill node computed the prompt, and its logprobs come with its result:
                # hold the stream until it is there.
                if not prefill.done():
                    self._held = [event]
                    prefill.add_done_callback(self._release_held)
                    return
                if prefill.cancelled() or prefill.exception() is not None:
                    return  # the prefill's failure ends the request (``_generate``)
                event = msgspec.structs.replace(event, prompt_logprobs=prefill.result().prompt_logprobs)
        self._deliver(event)

    def _deliver(self, event: TokenEvent) -> None:
        self.emitted.extend(event.token_ids)
        if self._several:  # each sequence's own, should it have to move
            self._by_index.setdefault(event.index, []).extend(event.token_ids)
            if event.finish_reason is not None:
                self._ended.add(event.index)
        self._put(event)
        if event.finish_reason is not None:
            self._num_open -= 1
            if not self._num_open:
                self.finished = True
                self._put(None)  # the caller need not wait for the cleanup
                self._stream_end.set_result(None)

    def _release_held(self, prefill: asyncio.Future) -> None:
        held, self._held = self._held or [], None
        end = self._stream_end
        if prefill is not self._prefill_task or end is None or end.done():
            return
        if prefill.cancelled() or prefill.exception() is not None:
            return  # the prefill's failure ends the request (``_generate``)
        first, *rest = held  # the first was checked already
        try:
            self._deliver(msgspec.structs.replace(first, prompt_logprobs=prefill.result().prompt_logprobs))
            for event in rest:
                if end.done():
                    return
                self._relay(event)
        except Exception as exc:
            if not end.done():
                end.set_exception(exc)

    async def _reserve(
        self, route: RouteRequest, ranked: list[NodeState]
    ) -> tuple[NodeState, LandingDescriptor]:
        """Reserve on the first decode node of ``ranked`` that takes the request; while every one
        is full, wait and rank them again (up to ``admission_wait_s``)."""
        router = self.d.router
        give_up = time.monotonic() + self.d.admission_wait_s
        backoff = 0.01
        while True:
            if not ranked:
                raise ProxyError(503, "no compatible decode node is available", retry_after=1)
            full: list[NodeError] = []
            failed: list[str] = []
            status = 503  # 502 once some node answered with an error
            for node in ranked:
                local = self.d.plan_prefill(node, route)
                rid = self.node_request_id
                msg = ReserveRequest(
                    rid, self._prompt, self._params, self.d.lease_s, bool(local), deadline=self._wall_deadline
                )
                try:
                    landing = await node.client.reserve(msg)
                except asyncio.CancelledError:
                    self.d.abort(node, rid)  # it may have reserved before we left
                    raise
                except NodeError as exc:
                    if exc.status in (429, 503):
                        self.d.full_rejections.inc()
                        full.append(exc)
                        continue
                    if exc.status == 400:
                        raise _node_failure(node, exc, "reserve failed") from None
                    if exc.connect_failed:
                        router.mark_down(node, exc.message)
                    else:
                        if exc.unreachable or exc.status == 200:  # timed out, or garbled landing:
                            self.d.abort(node, rid)  # it may hold a reservation
                        if not exc.unreachable:
                            status = 502
                    failed.append(f"{node.url}: {exc.message}")
                    continue
                if landing.request_id != rid:
                    self.d.abort(node, rid)
                    raise ProxyError(502, f"decode node {node.url} reserved for {landing.request_id!r}")
                node.num_inflight += 1
                if local:
                    self.d.decide(local)
                    router.recent.note(node.node_id, route.block_hashes)
                return node, landing
            now = time.monotonic()
            if not full:
                raise ProxyError(status, "no decode node could reserve: " + "; ".join(failed), retry_after=1)
            if now >= give_up:
                retry_after = max([e.retry_after or 1.0 for e in full])
                raise ProxyError(
                    429,
                    "the cluster is at capacity: no decode node has free KV blocks for this request now",
                    retry_after=retry_after,
                )
            await asyncio.sleep(min(backoff, give_up - now))
            backoff = min(2 * backoff, 0.2)
            ranked = router.rank(Role.DECODE, route)

    async def _prefill(
        self,
        route: RouteRequest,
        landing: LandingDescriptor | None,
        landing_soon: asyncio.Future | None = None,
        ask_again: bool = True,
    ) -> PrefillResult:
        """Compute the prompt on a prefill node (the first in rank that takes it) and send its KV
        to ``landing``, or, None, to the landing ``landing_soon`` resolves to (it is sent to the
        node in a ``PrefillLanding`` once known). Refused by every queue, it asks once more when
        the refusal may have been the overlap's doing (``ask_again``)."""
        router = self.d.router
        msg = PrefillRequest(
            self.node_request_id, self._prompt, self._params, landing, deadline=self._wall_deadline
        )
        failed: list[str] = []
        full: list[float] = []  # Retry-After of the nodes that answered 429 (queue full)
        full_urls: list[str] = []
        for node in router.rank(Role.PREFILL, route):
            self.prefill_node = node
            self._prefill_pending = True
            cached = route.cached_tokens(node)
            if not failed and not self._prefill_counted:
                self._prefill_counted = True
                reason = "remote_prefill_cached" if cached else "remote_prefill"
                if landing_soon is None:
                    self.d.decide(reason)
                else:  # counted once the reservation says so (not if the decode node computes it)
                    landing_soon.add_done_callback(lambda f, reason=reason: self.d.decide(reason))
            router.recent.note(node.node_id, route.block_hashes)  # it will hold the prompt's blocks
            uncached = route.num_tokens - cached
            node.num_inflight += 1
            node.inflight_prefill_tokens += uncached
            start = time.monotonic()
            try:
                if landing_soon is None:
                    result = await node.client.prefill(msg, timeout=None)
                else:
                    result = await self._prefill_then_land(node, msg, landing_soon)
            except NodeError as exc:
                if exc.connect_failed or exc.status in (429, 503):
                    # It never took the request: another prefill node may.
                    self._prefill_pending = False
                    if exc.connect_failed:
                        router.mark_down(node, exc.message)
                    if exc.status == 429:
                        full.append(exc.retry_after or 1.0)
                        full_urls.append(node.url)
                    failed.append(f"{node.url}: {exc.message}")
                    continue
                if exc.status:
                    self._prefill_pending = False  # it answered, so it let go of the request
                else:
                    # The connection dropped with the prompt in flight: the node died (or its link
                    # did). The decode node's reservation is aborted and the request starts over.
                    raise NodeDied(node, f"prefill lost: {exc.message}") from None
                raise _node_failure(node, exc, "prefill failed") from None
            finally:
                node.num_inflight -= 1
                node.inflight_prefill_tokens -= uncached
            self._prefill_pending = False
            self.d.prefill_latency.observe(time.monotonic() - start)
            if self.migrations:  # the tokens prepended on resumption are not the client's prompt
                n = min(result.num_cached_tokens, len(self.prompt_token_ids))
                result = msgspec.structs.replace(result, num_cached_tokens=n)
            self.prefill_result = result
            if not result.ok:
                raise ProxyError(502, f"prefill failed on {node.url}: {result.error or 'no reason given'}")
            return result
        if not failed:
            raise ProxyError(503, "no compatible prefill node is available", retry_after=1)
        early = self.d.early
        crowded = [url for url in full_urls if early.num_open(url)]
        if len(full) == len(failed) and ask_again and (landing_soon is not None or crowded):
            # Every queue was full, with early prompts of this proxy in it or while the decode node
            # reserved. Once reserved, and once the early prompts those queues held have settled
            # (landed, or dropped with their failed reservations and aborted), ask again with the
            # landing: else admissions on the two sides could miss each other and refuse every
            # request of a burst that the cluster could partly serve. Not for long: nobody renews
            # the decode node's lease until a prefill node has the prompt.
            mark = early.last()
            if landing_soon is not None:
                landing = await landing_soon
            give_up = time.monotonic() + self.d.lease_s / 3
            for url in crowded:
                if not await early.settled(url, mark, max(0.0, give_up - time.monotonic())):
                    break
            return await self._prefill(route, landing, ask_again=False)
        if len(full) == len(failed):  # every prefill node's queue is full: the client may retry
            raise ProxyError(
                429, "every prefill node's queue is full: " + "; ".join(failed), retry_after=max(full)
            )
        raise ProxyError(503, "no prefill node took the request: " + "; ".join(failed), retry_after=1)

    async def _prefill_then_land(
        self, node: NodeState, msg: PrefillRequest, landing_soon: asyncio.Future
    ) -> PrefillResult:
        """The prefill call without its landing, then the landing once the reservation made it and
        the call is on the wire (the channel keeps their order: the landing reaches the node after
        the call, whose handler waits for it). A failed landing fails the call on the node, whose
        reply is the answer; leaving early cancels the call (the node aborts)."""
        sent = asyncio.get_running_loop().create_future()
        call = asyncio.ensure_future(node.client.prefill(msg, timeout=None, sent=sent))
        ticket = self.d.early.open(node.url)
        handed = False  # to ``_abort_pending_prefill``: settled once the node has the abort
        try:
            # Not ``asyncio.gather``: cancelling it would cancel ``landing_soon``, which the next
            # prefill node (after a refusal here) still waits for.
            await asyncio.wait({call, sent}, return_when=asyncio.FIRST_COMPLETED)
            if not call.done():
                await asyncio.wait({call, landing_soon}, return_when=asyncio.FIRST_COMPLETED)
            if not call.done():
                try:
                    # No timeout of its own: the node answers after its handshake with the decode
                    # node (a first one may take long; its KV timeout bounds it), and the channel's
                    # heartbeat tells a dead node.
                    await node.client.land(PrefillLanding(landing_soon.result()), timeout=None)
                except NodeError as exc:
                    if exc.unreachable:
                        raise
                    # The node ends the prefill with the reason (or already did): its answer says it.
                self.d.early.settle(ticket)  # landed: an ordinary prefill from now on
            return await call
        except BaseException:
            if not call.done():  # left early: the node holds the prompt until it has the abort
                self._early_ticket, handed = ticket, True
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)
            raise
        finally:
            if not handed:
                self.d.early.settle(ticket)

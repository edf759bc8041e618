"""The proxy's early prefills: prompts sent to a prefill node while their decode node reserved
(the overlap), counted until they settle.

An early prefill takes a place in its prefill node's queue before anyone knows whether its
request will be served: a burst of requests fills the queue with prompts whose reservations may
then fail. A request whose reservation succeeded but whose early prompt found the queue full asks
again once reserved; it must not be refused because of prompts that are about to leave. So each
early prefill holds a ticket until it settles: its landing is sent (it is an ordinary prefill
from then on), its call is answered or refused, or it is dropped and its node has answered the
abort (the node's core has let it go, so its queue no longer counts it). ``settled`` waits for
every ticket a node held at some moment to settle, for a bounded time: the waiting request's decode
lease runs meanwhile, renewed by nobody, so a ticket that never settles (an abort the node does
not answer) delays it by at most a third of the lease, after which it asks again regardless.

Mutated only on the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses

from pdserve.utils import wait_at_most


@dataclasses.dataclass(frozen=True)
class Ticket:
    node_url: str
    number: int


class EarlyPrefills:
    def __init__(self) -> None:
        self._last = 0
        self._open: dict[str, set[int]] = {}  # node url -> numbers of its unsettled tickets
        self._waiters: list[tuple[str, int, asyncio.Future]] = []

    def open(self, node_url: str) -> Ticket:
        self._last += 1
        self._open.setdefault(node_url, set()).add(self._last)
        return Ticket(node_url, self._last)

    def settle(self, ticket: Ticket) -> None:
        """The early prefill no longer holds a queue place for nothing (idempotent)."""
        numbers = self._open.get(ticket.node_url)
        if numbers is None or ticket.number not in numbers:
            return
        numbers.discard(ticket.number)
        if not numbers:
            del self._open[ticket.node_url]
        waiting, self._waiters = self._waiters, []
        for url, upto, future in waiting:
            if future.done():
                continue
            if self._before(url, upto):
                self._waiters.append((url, upto, future))
            else:
                future.set_result(None)

    def last(self) -> int:
        """A mark: ``settled(url, mark)`` waits for the tickets opened up to now."""
        return self._last

    def num_open(self, node_url: str) -> int:
        return len(self._open.get(node_url, ()))

    def _before(self, node_url: str, upto: int) -> bool:
        return any(n <= upto for n in self._open.get(node_url, ()))

    async def settled(self, node_url: str, upto: int, timeout: float | None = None) -> bool:
        """Wait until every ticket on ``node_url`` numbered up to ``upto`` has settled (True), or
        ``timeout`` seconds (False)."""
        if not self._before(node_url, upto):
            return True
        future = asyncio.get_running_loop().create_future()
        self._waiters.append((node_url, upto, future))
        try:
            return await wait_at_most(future, timeout)
        finally:
            if not future.done():
                future.cancel()

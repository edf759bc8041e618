"""The decode leases a prefill node keeps alive: which prompts' reservations it renews, and when.

A decode node frees a reservation whose lease runs out before its KV arrives; the prefill node
renews the lease of every prompt it holds, three times per lease length, from the moment it
knows the prompt's landing (the decode node's address and blocks) until its call handler is done
with the prompt. The landing reaches the engine core as a command (``AddPrefill`` with it, or
``LandPrefill`` after the prompt), which the engine loop takes between steps; a step can be long
(a big batch of prompts, a host that stalls), so the renewals start when the command is read off
the node's socket (``keep`` with ``confirmed=False``), not when the engine loop gets to it: a
prefill node stopped 0.6 s in every 0.8 s took its landings 9-25 s after they came, and the leases
(8 s) ran out meanwhile. The engine loop then confirms the prompt (``keep`` once more) or drops it;
an entry it never confirms is dropped after ``unconfirmed_s``.

Thread-safe: the command reader keeps, the engine loop keeps and drops, the renewer asks what is
``due``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.messages import LandingDescriptor

MIN_PERIOD_S = 0.1
"""Renewals of one lease are at least this far apart (a landing that came with little time left)."""


@dataclass
class _Lease:
    address: str  # the decode node's KV address, where the renewals go
    every: float  # a third of the lease's length when the landing came
    next_at: float  # monotonic: the next renewal
    unconfirmed_until: float | None  # monotonic; None once the engine loop confirmed it


class LeaseKeeper:
    def __init__(self, unconfirmed_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.unconfirmed_s = unconfirmed_s
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, _Lease] = {}

    def keep(self, landing: LandingDescriptor, confirmed: bool) -> None:
        """Renew ``landing``'s lease from now on. Unconfirmed (read off the socket, not yet taken
        by the engine loop): at most ``unconfirmed_s`` unless confirmed. A lease kept already keeps
        its schedule."""
        now = self._clock()
        with self._lock:
            lease = self._leases.get(landing.request_id)
            if lease is None:
                every = max(MIN_PERIOD_S, (landing.lease_deadline - time.time()) / 3)
                until = None if confirmed else now + self.unconfirmed_s
                self._leases[landing.request_id] = _Lease(landing.kv_address, every, now + every, until)
            elif confirmed:
                lease.unconfirmed_until = None

    def drop(self, request_id: str) -> None:
        """No more renewals for ``request_id`` (its call handler is done, or it never came)."""
        with self._lock:
            self._leases.pop(request_id, None)

    def due(self) -> dict[str, list[str]]:
        """Decode KV address -> the request ids whose renewal is due now (each then scheduled a
        period later); unconfirmed leases past their time are dropped."""
        now = self._clock()
        due: dict[str, list[str]] = {}
        with self._lock:
            for rid, lease in list(self._leases.items()):
                if lease.unconfirmed_until is not None and now > lease.unconfirmed_until:
                    del self._leases[rid]
                elif now >= lease.next_at:
                    due.setdefault(lease.address, []).append(rid)
                    lease.next_at = now + lease.every
        return due

    def __contains__(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._leases

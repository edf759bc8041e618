"""``free_port``: a port outside the kernel's ephemeral range, free, and never handed out twice."""

from __future__ import annotations

import socket

from pdserve import utils
from pdserve.utils import _ephemeral_range, free_port


def test_ports_are_free_distinct_and_outside_the_ephemeral_range():
    lo, hi = _ephemeral_range()
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(not lo <= p <= hi for p in ports)
    for p in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # raises if it was not free


def test_a_taken_port_is_not_handed_out(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        # every random pick lands on the taken port first, then on a free one
        picks = iter([taken, taken, 0])
        real = utils._ports.randrange

        def pick(a, b):
            p = next(picks, None)
            return p if p else real(a, b)

        monkeypatch.setattr(utils._ports, "randrange", pick)
        assert free_port() != taken

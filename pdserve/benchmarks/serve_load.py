"""Offering a workload to a server: arrival times, a concurrency cap, conversations turn by turn.

Conversations start at their arrival times (Poisson: exponential gaps of mean 1/rate;
constant: exactly 1/rate apart; rate inf: all at once). A conversation's later turns go out
when the previous answer has arrived, with that answer in their history. ``--max-concurrency``
caps requests in flight, whatever the rate: a request that arrives while the cap is reached
waits for a slot, and its latencies count from when it is sent, as in vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.benchmarks.serve_client import RequestOptions, send
from pdserve.benchmarks.serve_datasets import Conversation, Message
from pdserve.benchmarks.serve_http import Client
from pdserve.benchmarks.serve_metrics import RequestRecord

ARRIVALS = ("poisson", "constant")


def arrival_times(num: int, rate: float, arrival: str = "poisson", seed: int = 0) -> list[float]:
    """Start offsets (seconds) of ``num`` conversations offered at ``rate`` per second; the first at 0."""
    if arrival not in ARRIVALS:
        raise ValueError(f"unknown arrival process {arrival!r}; choose from {', '.join(ARRIVALS)}")
    if not rate > 0:
        raise ValueError(f"the request rate must be positive, got {rate}")
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(num):
        out.append(t)
        t += rng.expovariate(rate) if arrival == "poisson" else 1.0 / rate
    return out


@dataclass(frozen=True)
class LoadResult:
    records: tuple[RequestRecord, ...]
    duration_s: float
    num_skipped: int
    """Turns never sent because an earlier turn of their conversation failed."""


async def offer(
    client: Client,
    opts: RequestOptions,
    conversations: list[Conversation],
    starts: list[float],
    max_concurrency: int | None = None,
    count_prompt: Callable[[list[Message]], int] | None = None,
    on_done: Callable[[RequestRecord], None] = lambda r: None,
) -> LoadResult:
    """Run every conversation against the server; returns records in completion order."""
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    records: list[RequestRecord] = []
    skipped = 0
    t0 = time.perf_counter()

    async def converse(index: int, conv: Conversation) -> None:
        nonlocal skipped
        await asyncio.sleep(max(0.0, t0 + starts[index] - time.perf_counter()))
        history = list(conv.preamble)
        for turn_index, turn in enumerate(conv.turns):
            history.append(Message("user", turn.content))
            async with slots if slots is not None else contextlib.nullcontext():
                reply = await send(
                    client,
                    opts,
                    history,
                    turn.output_len,
                    t0,
                    count_prompt,
                    conversation=index,
                    turn=turn_index,
                )
            records.append(reply.record)
            on_done(reply.record)
            if not reply.record.success:
                skipped += len(conv.turns) - turn_index - 1
                return
            tokens = isinstance(turn.content, tuple)
            history.append(Message("assistant", reply.token_ids if tokens else reply.text))

    await asyncio.gather(*(converse(i, c) for i, c in enumerate(conversations)))
    return LoadResult(tuple(records), time.perf_counter() - t0, skipped)

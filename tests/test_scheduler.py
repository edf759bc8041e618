"""Scheduler driven step by step with fake sampler outputs: no model, exact token and block accounting."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.config import CacheConfig, SchedulerConfig
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampler import SamplerOutput
from pdserve.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from pdserve.sampling_params import SamplingParams
from pdserve.utils import cdiv

EOS = 0


def make_scheduler(
    *,
    block_size: int = 4,
    num_blocks: int = 16,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    enable_prefix_caching: bool = True,
    enable_chunked_prefill: bool = True,
    max_model_len: int = 64,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill,
        ),
        CacheConfig(
            block_size=block_size, num_kv_blocks=num_blocks, enable_prefix_caching=enable_prefix_caching
        ),
        num_blocks,
        max_model_len,
    )


def make_request(request_id: str, prompt: list[int], max_tokens: int = 4, **params) -> Request:
    params.setdefault("ignore_eos", True)
    return Request(
        request_id, list(prompt), SamplingParams(max_tokens=max_tokens, **params), eos_token_ids=(EOS,)
    )


def count_token(s: ScheduledRequest) -> int:
    """Deterministic fake sample: 100 + the output index, so recomputation cannot hide lost tokens."""
    return 100 + s.request.num_output_tokens


@dataclass
class Step:
    """One step's schedule with ``needs_sample`` read before the sampled tokens were applied.

    ``ScheduledRequest.needs_sample`` compares against the request's live token count, so
    after ``update_from_output`` appends a token it reads False: snapshot it first.
    """

    out: SchedulerOutput
    rows: list[tuple[str, int, int, bool]]

    @property
    def scheduled(self) -> list[ScheduledRequest]:
        return self.out.scheduled

    @property
    def preempted(self) -> list[str]:
        return self.out.preempted

    @property
    def block_ids(self) -> list[tuple[int, ...]]:
        return [s.block_ids for s in self.out.scheduled]


def step(sched: Scheduler, sample: Callable[[ScheduledRequest], int] = count_token) -> Step:
    out = sched.schedule()
    rows = [(s.request.request_id, s.start, s.num_tokens, s.needs_sample) for s in out.scheduled]
    tokens = [sample(s) for s in out.scheduled if s.needs_sample]
    sched.update_from_output(out, SamplerOutput(token_ids=tokens, logprobs=[None] * len(tokens)))
    sched.check_integrity()
    return Step(out, rows)


def run_to_idle(sched: Scheduler, max_steps: int = 1000) -> int:
    for n in range(max_steps):
        if not sched.has_unfinished():
            return n
        step(sched)
    raise AssertionError("scheduler did not drain")


# ------------------------------------------------------------------------ chunked prefill


def test_chunked_prefill_splits_prompt_and_samples_when_caught_up():
    sched = make_scheduler(max_num_batched_tokens=8)
    a = make_request("a", list(range(1, 21)), max_tokens=2)  # 20 tokens
    b = make_request("b", [7, 8, 9], max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)

    out = step(sched)
    assert out.rows == [("a", 0, 8, False)]  # budget spent: "b" waits
    assert out.scheduled[0].block_ids == (0, 1)
    assert out.scheduled[0].token_ids == list(range(1, 9))
    assert a.num_computed_tokens == 8 and a.output_token_ids == [] and list(sched.waiting) == [b]

    out = step(sched)
    assert out.rows == [("a", 8, 8, False)]
    assert out.scheduled[0].block_ids == (0, 1, 2, 3)

    out = step(sched)
    assert out.rows == [("a", 16, 4, True), ("b", 0, 3, True)]
    assert [s.block_ids for s in out.scheduled] == [(0, 1, 2, 3, 4), (5,)]
    assert a.output_token_ids == [100] and b.output_token_ids == [100]

    out = step(sched)
    assert out.rows == [("a", 20, 1, True), ("b", 3, 1, True)]
    assert [s.block_ids for s in out.scheduled] == [(0, 1, 2, 3, 4, 6), (5,)]
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert a.output_token_ids == b.output_token_ids == [100, 101]
    assert not sched.has_unfinished() and sched.kv.num_free_blocks == 16


def test_running_prefill_gets_budget_before_new_requests():
    sched = make_scheduler(max_num_batched_tokens=6)
    sched.add_request(make_request("a", list(range(1, 11)), max_tokens=1))
    sched.add_request(make_request("b", list(range(50, 60)), max_tokens=1))
    assert step(sched).rows == [("a", 0, 6, False)]
    assert step(sched).rows == [("a", 6, 4, True), ("b", 0, 2, False)]
    assert step(sched).rows == [("b", 2, 6, False)]
    assert step(sched).rows == [("b", 8, 2, True)]
    assert not sched.has_unfinished()


def test_without_chunked_prefill_a_long_prompt_waits_for_a_whole_budget():
    sched = make_scheduler(max_num_batched_tokens=10, enable_chunked_prefill=False)
    sched.add_request(make_request("a", list(range(1, 5)), max_tokens=3))
    sched.add_request(make_request("b", list(range(10, 20)), max_tokens=1))
    assert step(sched).rows == [("a", 0, 4, True)]  # "b" needs 10 > 6 left: not split
    assert step(sched).rows == [("a", 4, 1, True)]  # 1 + 10 > 10 still
    assert step(sched).rows == [("a", 5, 1, True)]
    assert step(sched).rows == [("b", 0, 10, True)]
    assert not sched.has_unfinished()


# ------------------------------------------------------------------------ batch limits


def test_max_num_seqs_caps_running_batch():
    sched = make_scheduler(max_num_seqs=2, num_blocks=32)
    reqs = [make_request(f"r{i}", [10 * i + 1, 10 * i + 2], max_tokens=3) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    out = step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["r0", "r1"]
    seen = []
    while sched.has_unfinished():
        out = step(sched)
        assert len(out.scheduled) <= 2 and len(sched.running) <= 2
        seen += [s.request.request_id for s in out.scheduled if s.start == 0]
    assert seen == ["r2", "r3", "r4"]  # admitted in arrival order as slots open
    assert all(r.output_token_ids == [100, 101, 102] for r in reqs)


def test_budget_caps_tokens_per_step():
    sched = make_scheduler(max_num_batched_tokens=5, num_blocks=32)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", [1, 2, 3], max_tokens=5))
    while sched.has_unfinished():
        assert step(sched).out.num_batched_tokens <= 5


# ------------------------------------------------------------------------ preemption


def test_preemption_when_blocks_run_out_and_resume():
    # 4 blocks of 4 tokens = 16 tokens, exactly max_model_len: two requests cannot both grow.
    sched = make_scheduler(num_blocks=4, max_model_len=16, enable_prefix_caching=False)
    a = make_request("a", [1, 2, 3, 4, 5, 6], max_tokens=6)
    b = make_request("b", [11, 12, 13, 14, 15, 16], max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    out = step(sched)
    assert [s.block_ids for s in out.scheduled] == [(0, 1), (2, 3)]
    step(sched)
    step(sched)  # both at 9 tokens now: the 9th token needs a third block each
    assert a.num_tokens == b.num_tokens == 9 and sched.kv.num_free_blocks == 0

    out = step(sched)
    assert out.preempted == ["b"]
    assert out.rows == [("a", 8, 1, True)]
    assert out.scheduled[0].block_ids == (0, 1, 3)  # b's blocks were freed tail first: 3, then 2
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and sched.num_preemptions == 1
    assert list(sched.waiting) == [b] and sched.running == [a]
    assert b.output_token_ids == [100, 101, 102]  # sampled tokens survive preemption

    run_to_idle(sched)
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH_CAPPED
    expected = [100, 101, 102, 103, 104, 105]
    assert a.output_token_ids == expected and b.output_token_ids == expected
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    assert sched.kv.num_free_blocks == 4


def test_preempted_request_recomputes_prompt_and_outputs():
    sched = make_scheduler(num_blocks=4, max_model_len=16, enable_prefix_caching=False)
    a = make_request("a", [1, 2, 3, 4, 5, 6], max_tokens=6)
    b = make_request("b", [11, 12, 13, 14, 15, 16], max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(4):
        step(sched)
    assert b.status == RequestStatus.PREEMPTED
    resumed = None
    while resumed is None:
        out = step(sched)
        resumed = next((s for s in out.scheduled if s.request is b), None)
    # Prompt and the 3 sampled tokens are recomputed in one prefill, then the 4th is sampled.
    assert ("b", 0, 9, True) in out.rows
    assert resumed.token_ids == [11, 12, 13, 14, 15, 16, 100, 101, 102]
    assert b.output_token_ids == [100, 101, 102, 103]
    run_to_idle(sched)


def test_preemption_with_prefix_caching_takes_blocks_back():
    sched = make_scheduler(num_blocks=4, max_model_len=16, enable_prefix_caching=True)
    a = make_request("a", [1, 2, 3, 4, 5, 6], max_tokens=6)
    b = make_request("b", [11, 12, 13, 14, 15, 16], max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(4):
        step(sched)
    assert b.status == RequestStatus.PREEMPTED
    run_to_idle(sched)
    assert a.output_token_ids == b.output_token_ids == [100, 101, 102, 103, 104, 105]
    assert sched.kv.num_free_blocks == 4
    assert b.num_cached_tokens == 0  # set once, at first scheduling


def test_newest_is_preempted_first_and_queue_order_is_kept():
    sched = make_scheduler(num_blocks=6, max_model_len=24, max_num_seqs=3, enable_prefix_caching=False)
    reqs = [make_request(f"r{i}", [10 * i + j for j in range(1, 8)], max_tokens=8) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    out = step(sched)  # 7 tokens each: 2 blocks each, the pool is full
    assert [s.block_ids for s in out.scheduled] == [(0, 1), (2, 3), (4, 5)]
    out = step(sched)  # the 8th token still fits
    assert out.preempted == []
    out = step(sched)  # every request needs a third block: r2 frees two, enough for r0 and r1
    assert out.preempted == ["r2"]
    assert out.rows == [("r0", 8, 1, True), ("r1", 8, 1, True)]
    assert out.block_ids == [(0, 1, 5), (2, 3, 4)]  # r2 freed tail first: 5, then 4
    for _ in range(3):
        assert step(sched).preempted == []
    out = step(sched)  # 13 tokens each: a fourth block each, none free
    assert out.preempted == ["r1"]
    assert out.rows == [("r0", 12, 1, True)]
    assert list(sched.waiting) == [reqs[1], reqs[2]]  # back in arrival order
    assert [r.status for r in reqs] == [RequestStatus.RUNNING] + [RequestStatus.PREEMPTED] * 2
    run_to_idle(sched)
    assert all(r.output_token_ids == [100 + k for k in range(8)] for r in reqs)


# ------------------------------------------------------------------------ prefix cache


def test_prefix_cache_hits_set_num_cached_tokens():
    sched = make_scheduler(num_blocks=16)
    prompt = list(range(1, 11))  # 10 tokens: 2 full blocks of 4
    a = make_request("a", prompt, max_tokens=2)
    sched.add_request(a)
    out = step(sched)
    assert a.num_cached_tokens == 0 and out.scheduled[0].block_ids == (0, 1, 2)

    b = make_request("b", [*prompt[:8], 90, 91, 92], max_tokens=2)  # shares 2 live blocks
    sched.add_request(b)
    out = step(sched)
    assert out.rows == [("a", 10, 1, True), ("b", 8, 3, True)]
    assert out.scheduled[1].block_ids == (0, 1, 3)
    assert b.num_cached_tokens == 8
    run_to_idle(sched)

    c = make_request("c", prompt, max_tokens=1)  # a's blocks are free now but still cached
    sched.add_request(c)
    out = step(sched)
    assert out.rows == [("c", 8, 2, True)]
    assert out.scheduled[0].block_ids[:2] == (0, 1)
    assert c.num_cached_tokens == 8

    d = make_request("d", prompt[:8], max_tokens=1)  # exactly 2 full blocks: 1 block of hits
    sched.add_request(d)
    out = step(sched)
    assert out.rows == [("d", 4, 4, True)] and d.num_cached_tokens == 4
    assert not sched.has_unfinished() and sched.kv.num_free_blocks == 16


def test_no_hits_with_prefix_caching_disabled():
    sched = make_scheduler(enable_prefix_caching=False)
    for rid in ("a", "b"):
        r = make_request(rid, list(range(1, 11)), max_tokens=1)
        sched.add_request(r)
        out = step(sched)
        assert out.rows == [(rid, 0, 10, True)] and r.num_cached_tokens == 0
    assert sched.kv.pool.num_cached_blocks == 0


def test_namespace_separates_models():
    def serve(sched: Scheduler, request_id: str) -> Request:
        r = make_request(request_id, list(range(1, 10)), max_tokens=1)
        sched.add_request(r)
        run_to_idle(sched)
        return r

    config = (SchedulerConfig(), CacheConfig(block_size=4, num_kv_blocks=8), 8, 32)
    a = Scheduler(*config, namespace="model-a")
    b = Scheduler(*config, namespace="model-b")
    first, second = serve(a, "first"), serve(a, "second")
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 8)
    other = serve(b, "other")
    assert len(other.block_hashes) == len(first.block_hashes) == 2
    assert not set(other.block_hashes) & set(first.block_hashes)
    assert all(a.kv.pool.get_cached_block(h) is None for h in other.block_hashes)


# ------------------------------------------------------------------------ finishing and aborts


def test_eos_stops_unless_ignored_and_respects_min_tokens():
    sched = make_scheduler()
    stop = make_request("stop", [1, 2, 3], max_tokens=10, ignore_eos=False)
    keep = make_request("keep", [4, 5, 6], max_tokens=3, ignore_eos=True)
    late = make_request("late", [7, 8, 9], max_tokens=10, ignore_eos=False, min_tokens=2)
    for r in (stop, keep, late):
        sched.add_request(r)
    while sched.has_unfinished():
        step(sched, sample=lambda s: EOS)
    assert stop.status == RequestStatus.FINISHED_STOPPED and stop.output_token_ids == [EOS]
    assert keep.status == RequestStatus.FINISHED_LENGTH_CAPPED and keep.output_token_ids == [EOS] * 3
    assert late.status == RequestStatus.FINISHED_STOPPED and late.output_token_ids == [EOS] * 2
    assert sched.kv.num_free_blocks == 16


def test_stop_token_ids_and_max_model_len():
    sched = make_scheduler(max_model_len=8)
    s = make_request("s", [1, 2], max_tokens=10, stop_token_ids=(100 + 2,))
    m = make_request("m", [1, 2, 3, 4, 5], max_tokens=10)
    sched.add_request(s)
    sched.add_request(m)
    run_to_idle(sched)
    assert s.status == RequestStatus.FINISHED_STOPPED and s.stop_reason == 102
    assert s.output_token_ids == [100, 101, 102]
    assert m.status == RequestStatus.FINISHED_LENGTH_CAPPED and m.num_tokens == 8


def test_add_request_rejects_bad_prompts():
    sched = make_scheduler(num_blocks=4, max_model_len=16)
    sched.add_request(make_request("a", [1]))
    with pytest.raises(ValueError, match="duplicate"):
        sched.add_request(make_request("a", [1]))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(make_request("long", list(range(17))))
    with pytest.raises(ValueError, match="KV blocks"):
        make_scheduler(num_blocks=3, max_model_len=16).add_request(make_request("big", list(range(12))))
    assert sched.num_unfinished == 1


def test_prompt_of_max_model_len_fits_an_exact_cache():
    # The engine sizes the cache to hold max_model_len tokens; such a prompt needs no more
    # blocks than that: its first sampled token ends it and never gets KV.
    sched = make_scheduler(num_blocks=4, max_model_len=16)
    r = make_request("full", list(range(1, 17)), max_tokens=5)
    sched.add_request(r)
    assert step(sched).rows == [("full", 0, 16, True)]
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED and r.output_token_ids == [100]
    assert sched.kv.num_free_blocks == 4


def test_abort_waiting_and_running_frees_blocks():
    sched = make_scheduler(num_blocks=8, max_num_seqs=2)
    a = make_request("a", list(range(1, 10)), max_tokens=8)
    b = make_request("b", list(range(20, 26)), max_tokens=8)
    c = make_request("c", list(range(30, 33)), max_tokens=8)
    for r in (a, b, c):
        sched.add_request(r)
    step(sched)
    assert sched.running == [a, b] and list(sched.waiting) == [c]
    assert sched.kv.num_free_blocks == 8 - 3 - 2

    done = sched.finish_requests(["c", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert done == [c] and c.status == RequestStatus.FINISHED_ABORTED and not sched.waiting
    assert c.status.finish_reason == "abort"
    done = sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert done == [a] and sched.running == [b]
    assert sched.kv.num_free_blocks == 8 - 2 and "a" not in sched.kv.req_to_blocks
    sched.check_integrity()
    assert sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED) == []  # twice is harmless

    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    sched.check_integrity()
    assert not sched.has_unfinished() and sched.kv.num_free_blocks == 8
    assert step(sched).out.is_empty


def test_abort_while_step_runs_drops_its_token():
    sched = make_scheduler(num_blocks=8)
    a = make_request("a", [1, 2, 3], max_tokens=4)
    b = make_request("b", [4, 5, 6], max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)  # arrives between schedule and update
    updated = sched.update_from_output(out, SamplerOutput(token_ids=[7, 8], logprobs=[None, None]))
    assert updated == [b] and a.output_token_ids == [] and b.output_token_ids == [8]
    sched.check_integrity()
    run_to_idle(sched)
    assert sched.kv.num_free_blocks == 8


def test_abort_preempted_request():
    sched = make_scheduler(num_blocks=4, max_model_len=16, enable_prefix_caching=False)
    a = make_request("a", [1, 2, 3, 4, 5, 6], max_tokens=6)
    b = make_request("b", [11, 12, 13, 14, 15, 16], max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(4):
        step(sched)
    assert b.status == RequestStatus.PREEMPTED
    assert sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED) == [b]
    sched.check_integrity()
    run_to_idle(sched)
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED and sched.kv.num_free_blocks == 4


def test_sampled_token_count_must_match():
    sched = make_scheduler()
    sched.add_request(make_request("a", [1, 2, 3]))
    out = sched.schedule()
    for n in (0, 2):
        with pytest.raises(ValueError, match=f"{n} sampled tokens for 1 sampling"):
            sched.update_from_output(out, SamplerOutput(token_ids=[5] * n, logprobs=[None] * n))
    # Nothing moved: the request still needs its whole prompt.
    assert sched.requests["a"].num_computed_tokens == 0


# ------------------------------------------------------------------------ randomized


class FakeKV:
    """Slot contents of the paged cache as the engine would write them: checks every read.

    Each step first writes every scheduled token into its slot, then checks that every
    scheduled request can read its whole prefix back — what attention would see. Prefix
    hits, eviction and preemption all have to keep this true.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[tuple[int, int], int] = {}

    def run(self, out: SchedulerOutput, device_tokens: dict[str, int] | None = None) -> None:
        """``device_tokens``: what the step in flight sampled, by request (async scheduling)."""
        bs = self.block_size
        for s in out.scheduled:
            assert len(s.block_ids) == cdiv(s.start + s.num_tokens, bs), "blocks beyond the step's tokens"
            assert len(set(s.block_ids)) == len(s.block_ids)
            ids = s.token_ids + [device_tokens[s.request.request_id] for _ in range(s.num_device_inputs)]
            for pos, token in zip(range(s.start, s.start + s.num_tokens), ids, strict=True):
                self.slots[s.block_ids[pos // bs], pos % bs] = token
        for s in out.scheduled:
            want = s.request.all_token_ids[: s.start + s.num_tokens]
            want += [device_tokens[s.request.request_id] for _ in range(s.num_device_inputs)]
            got = [self.slots.get((s.block_ids[p // bs], p % bs)) for p in range(len(want))]
            assert got == want, f"request {s.request.request_id} reads a corrupted prefix"


def run_random(
    seed: int,
    block_size: int,
    extra_blocks: int,
    budget: int,
    max_num_seqs: int,
    caching: bool,
    lag: bool = False,
):
    """``lag``: async scheduling, each step applied after the next one was scheduled."""
    rng = random.Random(seed)
    max_model_len = rng.choice([block_size * 2, 24, 40, 64])
    num_blocks = cdiv(max_model_len, block_size) + extra_blocks  # the engine guarantees one full request
    # Without chunked prefill a resumed request may need max_model_len tokens in one step.
    chunked = budget < max_model_len or rng.random() < 0.7
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked
        ),
        CacheConfig(block_size=block_size, num_kv_blocks=num_blocks, enable_prefix_caching=caching),
        num_blocks,
        max_model_len,
    )
    kv = FakeKV(block_size)
    bases = [[rng.randrange(1, 50) for _ in range(max_model_len)] for _ in range(3)]
    num_requests = rng.randint(4, 30)
    p_eos = rng.choice([0.0, 0.05, 0.3])
    all_reqs: list[Request] = []

    def new_request(i: int) -> Request:
        length = rng.randint(1, max_model_len)
        if rng.random() < 0.7:
            base = rng.choice(bases)
            shared = length if rng.random() < 0.3 else rng.randint(0, length)
            prompt = base[:shared] + [rng.randrange(1, 50) for _ in range(length - shared)]
        else:
            prompt = [rng.randrange(1, 50) for _ in range(length)]
        max_tokens = rng.randint(1, 12)
        params = SamplingParams(
            max_tokens=max_tokens,
            ignore_eos=rng.random() < 0.3,
            min_tokens=rng.choice([0, 0, 0, min(2, max_tokens)]),
            stop_token_ids=(rng.randrange(1, 50),) if rng.random() < 0.2 else (),
        )
        r = Request(f"r{i}", prompt, params, eos_token_ids=(EOS,))
        sched.add_request(r)  # every prompt up to max_model_len fits a pool of max_model_len tokens
        return r

    def sample(s: ScheduledRequest) -> int:
        return EOS if rng.random() < p_eos else rng.randrange(1, 50)

    first_start: dict[str, int] = {}  # where each request's first scheduled chunk began
    next_id = 0
    in_flight: tuple[SchedulerOutput, list[int]] | None = None
    device_tokens: dict[str, int] = {}  # what the step in flight sampled, by request
    for _ in range(2000):
        # Arrivals, in bursts.
        while next_id < num_requests and rng.random() < 0.4:
            all_reqs.append(new_request(next_id))
            next_id += 1
        # Aborts of waiting, preempted or running requests between steps.
        if sched.requests and rng.random() < 0.03:
            sched.finish_requests([rng.choice(list(sched.requests))], RequestStatus.FINISHED_ABORTED)
            sched.check_integrity()
        if next_id >= num_requests and not sched.has_unfinished() and in_flight is None:
            break
        out = sched.schedule()
        assert out.num_batched_tokens <= budget
        assert len(sched.running) <= max_num_seqs
        assert all(s.num_tokens > 0 for s in out.scheduled)
        assert len({s.request.request_id for s in out.scheduled}) == len(out.scheduled)
        if sched.running and not out.preempted:
            # Under lag, every running request may be waiting for a token that ends it by length.
            assert not out.is_empty or in_flight is not None, "running requests but nothing scheduled"
        kv.run(out, device_tokens)
        for s in out.scheduled:
            first_start.setdefault(s.request.request_id, s.start)
        tokens = [sample(s) for s in out.scheduled if s.needs_sample]
        device_tokens = {
            s.request.request_id: t for s, t in zip([s for s in out.scheduled if s.needs_sample], tokens)
        }
        if out.scheduled and rng.random() < 0.03:  # an abort lands while the step runs
            victim = rng.choice(out.scheduled).request
            sched.finish_requests([victim.request_id], RequestStatus.FINISHED_ABORTED)
        if in_flight is not None:  # the previous step is applied after this one was launched
            sched.update_from_output(in_flight[0], SamplerOutput(in_flight[1], [None] * len(in_flight[1])))
            in_flight = None
        if not out.is_empty:
            in_flight = (out, tokens)
        if not lag and in_flight is not None:
            sched.update_from_output(out, SamplerOutput(token_ids=tokens, logprobs=[None] * len(tokens)))
            in_flight = None
        sched.check_integrity()
    else:
        raise AssertionError(f"seed {seed}: requests never finished")

    assert not sched.requests and not sched.running and not sched.waiting
    assert sched.kv.num_free_blocks == num_blocks
    assert sched.kv.req_to_blocks == {}
    for r in all_reqs:
        assert r.is_finished
        assert r.num_cached_tokens == first_start.get(r.request_id, -1)
        assert caching or r.num_cached_tokens <= 0
        p = r.sampling_params
        assert r.num_output_tokens <= p.max_tokens
        assert r.num_tokens <= max_model_len or r.num_output_tokens == 1
        if r.status == RequestStatus.FINISHED_LENGTH_CAPPED:
            assert r.num_output_tokens == p.max_tokens or r.num_tokens >= max_model_len
        elif r.status == RequestStatus.FINISHED_STOPPED:
            last = r.output_token_ids[-1]
            assert r.num_output_tokens >= p.min_tokens
            assert (last == EOS and not p.ignore_eos) or last in p.stop_token_ids
        else:
            assert r.status == RequestStatus.FINISHED_ABORTED
        # No stop condition fired early: every earlier token was a legal continuation.
        for k, t in enumerate(r.output_token_ids[:-1]):
            if k + 1 >= p.min_tokens:
                assert t not in p.stop_token_ids and (p.ignore_eos or t != EOS)
    if caching:
        assert sched.kv.pool.reset_prefix_cache()


@pytest.mark.parametrize("lag", [False, True], ids=["sync", "async"])
def test_randomized_seeds(lag):
    for seed in range(300):
        rng = random.Random(seed)
        run_random(
            seed,
            block_size=rng.choice([4, 8, 16]),
            extra_blocks=rng.choice([0, 0, 1, 2, 5, 20]),
            budget=rng.choice([1, 3, 4, 7, 16, 33, 128]),
            max_num_seqs=rng.randint(1, 6),
            caching=rng.random() < 0.7,
            lag=lag,
        )


@settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    seed=st.integers(0, 2**32 - 1),
    block_size=st.sampled_from([4, 8, 16]),
    extra_blocks=st.integers(0, 6),
    budget=st.integers(1, 80),
    max_num_seqs=st.integers(1, 8),
    caching=st.booleans(),
    lag=st.booleans(),
)
def test_randomized_hypothesis(seed, block_size, extra_blocks, budget, max_num_seqs, caching, lag):
    run_random(seed, block_size, extra_blocks, budget, max_num_seqs, caching, lag)


def test_remote_reservation_shares_the_cached_prefix_and_lands():
    sched = make_scheduler(num_blocks=16)
    prompt = list(range(1, 11))  # 10 tokens: 2 full blocks of 4
    a = make_request("a", prompt, max_tokens=1)
    sched.add_request(a)
    run_to_idle(sched)  # a's two full blocks stay cached

    b = make_request("b", [*prompt[:8], 90, 91, 92, 93, 94], max_tokens=2)
    block_ids = sched.reserve_remote(b)
    assert block_ids[:2] == [0, 1] and len(block_ids) == 4  # 2 shared + 2 fresh for 13 tokens
    assert b.num_computed_tokens == 8 and b.status == RequestStatus.WAITING_FOR_REMOTE_KV
    sched.check_integrity()
    c = make_request("c", [*prompt[:8], 90, 91, 92, 93, 94], max_tokens=1)
    c_ids = sched.reserve_remote(c)
    assert c_ids[:2] == [0, 1] and set(c_ids[2:]).isdisjoint(
        block_ids
    )  # b's fresh blocks: not before landing
    sched.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)

    landed = sched.remote_kv_landed("b", 7, None, num_cached_tokens=0)
    assert landed is b and b.num_computed_tokens == 13
    run_to_idle(sched)
    sched.check_integrity()
    d = make_request("d", [*prompt[:8], 90, 91, 92, 93, 94], max_tokens=1)
    assert sched.reserve_remote(d)[:3] == block_ids[:3]  # b's landed block is cached now
    sched.finish_requests(["d"], RequestStatus.FINISHED_ABORTED)
    sched.check_integrity()
    assert not sched.has_unfinished() and sched.kv.num_free_blocks == 16


# ------------------------------------------------------------------------ async scheduling (lag 1)


def _apply(sched: Scheduler, out: SchedulerOutput, tokens: list[int]) -> list[Request]:
    return sched.update_from_output(out, SamplerOutput(token_ids=tokens, logprobs=[None] * len(tokens)))


def test_async_placeholders_feed_the_next_step_and_max_tokens_is_known_ahead():
    sched = make_scheduler()
    a = make_request("a", [1, 2, 3, 4, 5], max_tokens=3)
    sched.add_request(a)
    first = sched.schedule()
    assert [(s.start, s.num_tokens, s.needs_sample, s.num_device_inputs) for s in first.scheduled] == [
        (0, 5, True, 0)
    ]
    assert (a.num_computed_tokens, a.num_inflight_tokens, a.num_output_placeholders) == (0, 5, 1)
    # Step 2 is scheduled before step 1's token is on the host: its input is the placeholder.
    second = sched.schedule()
    s = second.scheduled[0]
    assert (s.start, s.num_tokens, s.needs_sample, s.num_device_inputs, s.token_ids) == (5, 1, True, 1, [])
    assert second.scheduled[0].block_ids == (0, 1)  # position 5 needs a second block
    assert _apply(sched, first, [100]) == [a]
    assert (a.num_computed_tokens, a.num_inflight_tokens, a.num_output_placeholders) == (5, 1, 1)
    third = sched.schedule()
    assert [(s.start, s.num_device_inputs) for s in third.scheduled] == [(6, 1)]
    _apply(sched, second, [101])
    # Two tokens on the host and the third in flight: max_tokens=3 is reached, nothing to schedule.
    assert sched.schedule().is_empty and a.status == RequestStatus.RUNNING
    _apply(sched, third, [102])
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED and a.output_token_ids == [100, 101, 102]
    sched.check_integrity()
    assert sched.kv.num_free_blocks == 16


def test_async_stop_found_a_step_late_drops_the_extra_token():
    sched = make_scheduler()
    a = make_request("a", [1, 2, 3], max_tokens=10, ignore_eos=False)
    sched.add_request(a)
    first = sched.schedule()
    second = sched.schedule()  # computes the placeholder, samples one more
    assert _apply(sched, first, [EOS]) == [a]
    assert a.status == RequestStatus.FINISHED_STOPPED and sched.kv.num_free_blocks == 16
    assert _apply(sched, second, [55]) == []  # the step that ran past EOS: its token is dropped
    assert a.output_token_ids == [EOS]
    sched.check_integrity()


def test_async_preempted_with_a_token_in_flight_keeps_it():
    sched = make_scheduler(num_blocks=4, max_model_len=16, enable_prefix_caching=False)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8], max_tokens=6)
    b = make_request("b", [11, 12, 13, 14, 15, 16, 17], max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    first = sched.schedule()  # a: blocks 0, 1; b: blocks 2, 3; the pool is full
    # a's placeholder (position 8) needs a third block: b, the newest, is preempted while its
    # first token is in flight.
    second = sched.schedule()
    assert second.preempted == ["b"] and [s.request for s in second.scheduled] == [a]
    assert b.status == RequestStatus.PREEMPTED and b.num_output_placeholders == 1
    _apply(sched, first, [100, 200])
    assert b.output_token_ids == [200] and b.num_output_placeholders == 0 and b.num_computed_tokens == 0
    sched.check_integrity()
    _apply(sched, second, [101])
    run_to_idle(sched)
    assert a.output_token_ids == [100, 101, 102, 103, 104, 105]
    assert b.output_token_ids == [200, 101, 102, 103, 104, 105]  # count_token: 100 + output index
    assert sched.kv.num_free_blocks == 4

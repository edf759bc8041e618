"""The proxy's cluster view: compatibility check at start-up and routing policies (no I/O)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from pdserve.messages import NodeInfo, NodeLoad, Reply, encode
from pdserve.proxy.router import (
    ClusterError,
    LeastLoaded,
    PrefixAware,
    RoundRobin,
    Router,
    RouteRequest,
    mismatches,
)


def info(role: str, **kw) -> NodeInfo:
    fields = dict(
        node_id=role,
        role=role,
        model_id="m",
        dtype="float32",
        block_size=16,
        num_layers=2,
        num_kv_heads=2,
        head_dim=64,
        kv_layout="LBTHD",
        kv_transport="zmq",
        kv_address="",
        max_model_len=4096,
        vocab_size=100,
        channel_port=1,
    )
    fields.update(kw)
    return NodeInfo(**fields)


def router(prefill: list[NodeInfo], decode: list[NodeInfo]) -> Router:
    r = Router(
        [f"http://p{i}" for i in range(len(prefill))],
        [f"http://d{i}" for i in range(len(decode))],
        httpx.AsyncClient,
    )
    for node, i in zip(r.nodes, prefill + decode):
        node.info = i
        node.up = True
    return r


def test_compatible_cluster_passes_and_takes_the_smallest_max_model_len():
    r = router([info("prefill", max_model_len=2048)], [info("decode"), info("both", node_id="x")])
    r.check_cluster("m")
    assert r.max_model_len == 2048


def test_mismatch_names_the_field_both_values_and_both_nodes():
    assert mismatches(info("prefill"), info("decode", block_size=32)) == [("block_size", 16, 32)]
    r = router([info("prefill")], [info("decode"), info("decode", block_size=32, dtype="bfloat16")])
    with pytest.raises(ClusterError) as e:
        r.check_cluster("m")
    msg = str(e.value)
    assert "block_size: prefill node http://p0 has 16 but decode node http://d1 has 32" in msg
    assert "dtype: prefill node http://p0 has 'float32' but decode node http://d1 has 'bfloat16'" in msg
    assert "http://d0" not in msg


def test_model_and_role_mismatches():
    r = router([info("prefill", model_id="other")], [info("decode")])
    expected = "the proxy's --model gives 'm' but prefill node http://p0 serves 'other'"
    with pytest.raises(ClusterError, match=expected):
        r.check_cluster("m")
    r = router([info("decode")], [info("decode")])
    with pytest.raises(ClusterError, match="http://p0 is listed as a prefill node but reports role 'decode'"):
        r.check_cluster("m")


def test_least_loaded_prefers_fewer_requests_then_free_blocks_then_rotates():
    r = router([info("prefill")], [info("decode"), info("decode"), info("decode")])
    d0, d1, d2 = r.decode
    route = RouteRequest("r", [1, 2, 3])
    d0.num_inflight = 2
    d1.load = NodeLoad(running=1, waiting=0, waiting_for_kv=0, free_blocks=10, total_blocks=100)
    d2.load = NodeLoad(running=0, waiting=1, waiting_for_kv=0, free_blocks=50, total_blocks=100)
    assert LeastLoaded().rank("decode", r.decode, route) == [d2, d1, d0]
    # Polled load from other proxies counts when it exceeds our own in-flight count.
    d2.load = NodeLoad(running=5, waiting=0, waiting_for_kv=0, free_blocks=50, total_blocks=100)
    assert LeastLoaded().rank("decode", r.decode, route)[0] is d1
    # Idle ties rotate per role, so prefill routing does not skew decode routing.
    for n in r.decode:
        n.num_inflight, n.load = 0, None
    policy = LeastLoaded()
    firsts = []
    for _ in range(3):
        firsts.append(policy.rank("decode", r.decode, route)[0])
        policy.rank("prefill", r.prefill, route)
    assert firsts == [d0, d1, d2]


def test_round_robin_and_unavailable_nodes():
    r = router([info("prefill")], [info("decode"), info("decode")])
    r.policy = RoundRobin()
    route = RouteRequest("r", [1])
    d0, d1 = r.decode
    assert r.rank("decode", route) == [d0, d1]
    assert r.rank("decode", route) == [d1, d0]
    d1.up = False
    assert r.rank("decode", route) == [d0]
    d0.incompatible = "block_size: 32 instead of 16"
    assert r.rank("decode", route) == [d1]  # all down: try the compatible ones anyway
    d1.incompatible = "dtype"
    assert r.rank("decode", route) == []


def test_prefix_aware_prefers_the_cached_node_until_its_queue_outweighs_the_prefix():
    r = router([info("prefill", node_id="p0"), info("prefill", node_id="p1")], [info("decode")])
    p0, p1 = r.prefill
    prompt = list(range(1000))
    route = RouteRequest("r", prompt, cached_blocks={"p1": 50}, block_size=16)  # p1 holds 800 tokens
    policy = PrefixAware()
    assert route.cached_tokens(p1) == 800 and route.cached_tokens(p0) == 0
    assert policy.rank("prefill", r.prefill, route) == [p1, p0]
    p1.inflight_prefill_tokens = 1500  # 2 x 200 + 1500 < 2 x 1000 + 0: still p1
    assert policy.rank("prefill", r.prefill, route)[0] is p1
    p1.load = NodeLoad(0, 3, 0, 10, 100, pending_prompt_tokens=1700)  # polled backlog of all proxies
    assert policy.rank("prefill", r.prefill, route)[0] is p0  # 400 + 1700 > 2000: spread the prefix
    # No index answer: least queued prompt tokens.
    assert policy.rank("prefill", r.prefill, RouteRequest("r", prompt))[0] is p0


def test_prefix_aware_decode_ranking_is_cached_prefix_within_load_slack():
    r = router([info("prefill")], [info("decode", node_id="d0"), info("decode", node_id="d1")])
    d0, d1 = r.decode
    route = RouteRequest("r", list(range(64)), cached_blocks={"d1": 3}, block_size=16)
    policy = PrefixAware()
    for _ in range(2):  # rotation does not override the cached prefix
        assert policy.rank("decode", r.decode, route) == [d1, d0]
    d1.num_inflight = 2  # within the slack (2 at light load): the prefix holder still wins
    assert policy.rank("decode", r.decode, route) == [d1, d0]
    d1.num_inflight = 3  # clearly busier: load wins
    assert policy.rank("decode", r.decode, route) == [d0, d1]
    d0.num_inflight, d1.num_inflight = 80, 89  # slack grows with load (80 // 8 = 10)
    assert policy.rank("decode", r.decode, route) == [d1, d0]
    d1.num_inflight = 91
    assert policy.rank("decode", r.decode, route) == [d0, d1]
    uncached = RouteRequest("r", list(range(64)), block_size=16)
    d0.num_inflight, d1.num_inflight = 1, 0  # no prefix anywhere: least loaded
    assert policy.rank("decode", r.decode, uncached) == [d1, d0]


def test_conditional_disaggregation_plan():
    from pdserve.metrics import Registry
    from pdserve.proxy.dispatch import Dispatcher

    r = Router(["http://p0"], ["http://d0"], httpx.AsyncClient, both_urls=["http://b0"])
    for node, i in zip(r.nodes, [info("prefill"), info("decode", node_id="d0"), info("both", node_id="b0")]):
        node.info, node.up = i, True
    p0, (d0, b0) = r.prefill[0], r.decode
    d = Dispatcher(r, Registry(), min_remote_prefill_tokens=64, policy_name="prefix-aware")
    long_prompt = list(range(200))
    assert d.plan_prefill(b0, RouteRequest("r", long_prompt)) == "colocated"
    assert d.plan_prefill(d0, RouteRequest("r", long_prompt)) == ""  # remote prefill
    assert d.plan_prefill(d0, RouteRequest("r", list(range(40)))) == "short_prompt"
    held = RouteRequest("r", long_prompt, cached_blocks={"d0": 9}, block_size=16)  # 144 of 200 held
    assert d.plan_prefill(d0, held) == "decode_holds_prefix"
    p0.up = False
    assert d.plan_prefill(d0, RouteRequest("r", long_prompt)) == "no_prefill_node"


def test_transports_must_overlap_not_match():
    a = info("prefill", kv_transports=["nixl", "zmq"])
    assert mismatches(a, info("decode", kv_transports=["zmq"])) == []
    assert mismatches(a, info("decode", kv_transports=["nccl"])) == [
        ("kv_transports", ["nixl", "zmq"], ["nccl"])
    ]


def test_the_load_a_reply_carries_is_the_router_s_view_of_the_node_at_once():
    """With several proxy workers each one's in-flight counts miss the others' requests: the load
    the node sends with every reply replaces the poll's, which may be an interval old."""
    r = router([info("prefill")], [info("decode")])
    node = r.decode[0]

    async def main() -> None:
        await node.client.use_info(node.info)
        channel = node.client.channel
        fut = asyncio.get_running_loop().create_future()
        channel._calls[7] = fut
        channel._receive(encode(Reply(7, load=NodeLoad(3, 2, 1, 10, 100, 480))))
        assert fut.done() and fut.result().status == 200
        channel._receive(encode(Reply(8, 429, error="full")))  # no load said: the view stays
        await node.client.close()

    node.num_inflight = 1
    asyncio.run(main())
    assert node.load == NodeLoad(3, 2, 1, 10, 100, 480)
    assert node.load_score == 6 and node.queued_prefill_tokens == 480 and node.free_block_fraction == 0.1


class _Stream:
    """A decode node's token stream that opens and says nothing (the tests end the request
    another way)."""

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False


def _open_stream(*args, **kwargs) -> _Stream:
    return _Stream()


def _four_failed_reservations(overlap: bool, free_blocks: int | None = None):
    """Four requests through a dispatcher whose two decode nodes (round-robin) refuse every
    reservation with a 400 after 10 ms, and whose prefill node takes prefills it never ends;
    ``free_blocks``: the decode nodes' last load said this many free blocks. The decode node of
    each reservation, the prefills sent, the aborts the prefill node got."""
    from pdserve.metrics import Registry
    from pdserve.proxy.channel import NodeError
    from pdserve.proxy.dispatch import Dispatcher
    from pdserve.proxy.protocol import ProxyError
    from pdserve.sampling_params import SamplingParams

    r = router([info("prefill")], [info("decode", node_id="d0"), info("decode", node_id="d1")])
    r.policy = RoundRobin()
    reserved_on: list[str] = []
    prefills: list[str] = []
    aborted: list[str] = []

    def refuse_on(node):
        async def reserve(msg, timeout=None):
            reserved_on.append(node.node_id)
            await asyncio.sleep(0.01)
            raise NodeError(node.url, "bad request", 400)  # ends the attempt after its reserve

        return reserve

    async def prefill(msg, timeout=None, sent=None):
        prefills.append(msg.request_id)
        assert msg.landing is None  # it follows the reservation
        await asyncio.sleep(3600)  # cancelled when the reservation fails

    async def abort(request_id, timeout=5.0):
        aborted.append(request_id)

    for node in r.decode:
        node.client.reserve = refuse_on(node)
        if free_blocks is not None:
            node.load = NodeLoad(0, 0, 0, free_blocks, 100, 0)
    r.prefill[0].client.prefill = prefill
    r.prefill[0].client.abort = abort
    d = Dispatcher(r, Registry(), overlap_reserve=overlap)

    async def main() -> None:
        for i in range(4):
            gen = d.start(f"r{i}", list(range(64)), SamplingParams(max_tokens=2), 1e9)
            with pytest.raises(ProxyError):
                await gen.next()
        await asyncio.sleep(0.01)  # the aborts, spawned in the background

    asyncio.run(main())
    return reserved_on, prefills, aborted


@pytest.mark.parametrize("overlap", [True, False])
def test_each_request_ranks_the_decode_nodes_once(overlap):
    """A policy's rotation turns once per ranking: with the prefill sent while the decode node
    reserves, the proxy still ranks the decode nodes once a request, so round-robin alternates
    (ranked twice, every request started on the same node)."""
    reserved_on, prefills, aborted = _four_failed_reservations(overlap)
    assert reserved_on == ["d0", "d1", "d0", "d1"]
    # Sent early with the prefill, then dropped with the reservation: aborted on the prefill node.
    assert prefills == aborted == (["r0", "r1", "r2", "r3"] if overlap else [])


def test_no_early_prefill_for_a_decode_node_without_room():
    """The 64-token prompt needs 4 blocks: a decode node that last said it had 3 free gets the
    reservation first and the prefill after it; one with 4 gets both at once."""
    assert _four_failed_reservations(True, free_blocks=3)[1] == []
    assert _four_failed_reservations(True, free_blocks=4)[1] == ["r0", "r1", "r2", "r3"]


def test_an_early_prefill_refused_by_full_queues_is_asked_again_once_reserved():
    """The prompt went to the prefill node while the decode node reserved, and every prefill queue
    was full (429): once the reservation is made, the proxy asks again with the landing (prompts
    sent early for reservations that failed have left the queues by then), instead of refusing a
    request the cluster can serve. Counted as one remote-prefill decision."""
    from pdserve.messages import LandingDescriptor
    from pdserve.metrics import Registry
    from pdserve.proxy.channel import NodeError
    from pdserve.proxy.dispatch import Dispatcher
    from pdserve.proxy.protocol import ProxyError
    from pdserve.sampling_params import SamplingParams

    r = router([info("prefill")], [info("decode", node_id="d0")])
    decode_node, prefill_node = r.decode[0], r.prefill[0]
    decode_node.load = NodeLoad(0, 0, 0, 100, 100, 0)  # room: the prompt goes out early
    calls: list[tuple[str, bool]] = []

    async def reserve(msg, timeout=None):
        await asyncio.sleep(0.05)  # the early prefill's refusal comes first
        return LandingDescriptor(msg.request_id, "d0", "tcp://127.0.0.1:1", list(range(4)), 64, 1e12)

    async def prefill(msg, timeout=None, sent=None):
        calls.append((msg.request_id, msg.landing is not None))
        if msg.landing is None:
            raise NodeError(prefill_node.url, "queue full", 429, retry_after=1.0)
        raise NodeError(prefill_node.url, "bad request", 400)  # ends the attempt: enough here

    decode_node.client.reserve = reserve
    decode_node.client.stream = _open_stream
    decode_node.client.abort = prefill_node.client.abort = lambda *a, **k: asyncio.sleep(0)
    prefill_node.client.prefill = prefill
    d = Dispatcher(r, Registry(), overlap_reserve=True)

    async def main() -> None:
        gen = d.start("r0", list(range(64)), SamplingParams(max_tokens=2), 1e9)
        with pytest.raises(ProxyError, match="bad request"):
            await gen.next()
        await asyncio.sleep(0.01)

    decided: list[str] = []
    d.decide = decided.append
    asyncio.run(main())
    assert calls == [("r0", False), ("r0", True)]
    assert decided == ["remote_prefill"]


def _early_prompt_burst(abort_answered: bool, lease_s: float = 30.0):
    """A prefill queue of one place: r1's prompt goes out early and takes it while r1's decode node
    reserves; r0's early prompt finds the queue full. r0 is reserved first and asks again, while
    r1's prompt is still queued (its reservation is refused only later, with a 429). The prefill
    node answers the abort of r1's prompt after 20 ms (``abort_answered``) or never; it refuses
    r0's prompt with its landing with a 400 once queued (that ends r0: enough here). What the
    prefill node saw, r0's outcome and how long r0 took after r1 started."""
    from pdserve.messages import LandingDescriptor
    from pdserve.metrics import Registry
    from pdserve.proxy.channel import NodeError
    from pdserve.proxy.dispatch import Dispatcher
    from pdserve.proxy.protocol import ProxyError
    from pdserve.sampling_params import SamplingParams

    r = router([info("prefill")], [info("decode", node_id="d0")])
    decode_node, prefill_node = r.decode[0], r.prefill[0]
    decode_node.load = NodeLoad(0, 0, 0, 100, 100, 0)  # room: prompts go out early
    queue: set[str] = set()  # the prefill node's one place
    events: list[str] = []

    async def reserve(msg, timeout=None):
        if msg.request_id == "r1":
            await asyncio.sleep(0.15)  # refused after r0 was reserved and asked again
            raise NodeError(decode_node.url, "no free blocks", 429, retry_after=1.0)
        await asyncio.sleep(0.05)
        return LandingDescriptor(msg.request_id, "d0", "tcp://127.0.0.1:1", list(range(4)), 64, 1e12)

    async def prefill(msg, timeout=None, sent=None):
        landed = " with its landing" if msg.landing else ""
        if queue:
            events.append(f"{msg.request_id} refused{landed}")
            raise NodeError(prefill_node.url, "the node already queues 1 requests", 429, retry_after=1.0)
        queue.add(msg.request_id)
        events.append(f"{msg.request_id} queued{landed}")
        if sent is not None:
            sent.set_result(None)
        if msg.landing is not None:
            raise NodeError(prefill_node.url, "bad request", 400)
        await asyncio.sleep(3600)  # waits for a landing that never comes (r1)

    async def abort(request_id, timeout=5.0):
        await asyncio.sleep(0.02 if abort_answered else 3600)  # the node's core lets the prompt go
        queue.discard(request_id)
        events.append(f"{request_id} aborted")

    decode_node.client.reserve = reserve
    decode_node.client.stream = _open_stream
    decode_node.client.abort = lambda *a, **k: asyncio.sleep(0)
    prefill_node.client.prefill = prefill
    prefill_node.client.abort = abort
    d = Dispatcher(r, Registry(), overlap_reserve=True, admission_wait_s=0, lease_s=lease_s)

    async def main() -> tuple[ProxyError, float]:
        start = time.monotonic()
        first = d.start("r1", list(range(64)), SamplingParams(max_tokens=2), 1e9)
        await asyncio.sleep(0.01)
        second = d.start("r0", list(range(100, 164)), SamplingParams(max_tokens=2), 1e9)
        with pytest.raises(ProxyError) as refused:
            await first.next()
        assert refused.value.status == 429
        with pytest.raises(ProxyError) as ended:
            await second.next()
        took = time.monotonic() - start
        await asyncio.sleep(0.05)
        return ended.value, took

    ended, took = asyncio.run(asyncio.wait_for(main(), 5.0))  # r0 must not wait forever
    return events, ended, took, d.early.num_open(prefill_node.url)


def test_a_reserved_request_waits_for_the_early_prompts_that_filled_the_queue():
    """r0 waits until r1's early prompt has settled (dropped, and its abort answered by the node)
    and then gets the place: a burst is not refused whole because the proxy's own early prompts
    filled the queue (the race that made every request of a burst answer 429 on a slow machine)."""
    events, ended, _, still_open = _early_prompt_burst(abort_answered=True)
    assert events == ["r1 queued", "r0 refused", "r1 aborted", "r0 queued with its landing"]
    assert ended.status == 400 and still_open == 0


def test_a_reserved_request_waits_for_early_prompts_a_third_of_its_lease_at_most():
    """The prefill node never answers the abort of r1's prompt: r1's ticket never settles. r0,
    whose decode lease nobody renews until a prefill node has its prompt, waits a third of the
    lease (0.3 s of 0.9) and asks again anyway; the place is still taken, so r0 is refused with a
    429 (the client may retry) long before its lease runs out, rather than waiting on with it. A
    refused prefill is answered at once (not after the 1 s a failed transfer waits for its decode
    stream to break)."""
    events, ended, took, _ = _early_prompt_burst(abort_answered=False, lease_s=0.9)
    assert events == ["r1 queued", "r0 refused", "r0 refused with its landing"]
    assert ended.status == 429 and "queue is full" in ended.message
    assert 0.3 < took < 0.7, took


def test_early_prefill_tickets_settle_in_any_order():
    """``settled(url, mark)`` returns once the tickets of that node opened up to the mark have
    settled, whatever came after; settling twice is harmless."""
    from pdserve.proxy.early_prefills import EarlyPrefills

    early = EarlyPrefills()

    async def main() -> list[str]:
        done: list[str] = []
        a, b = early.open("p0"), early.open("p0")
        other = early.open("p1")
        mark = early.last()
        later = early.open("p0")
        waiter = asyncio.ensure_future(early.settled("p0", mark))
        waiter.add_done_callback(lambda _: done.append("p0 up to the mark"))
        await asyncio.sleep(0)
        early.settle(b)
        early.settle(other)
        await asyncio.sleep(0)
        assert not done
        early.settle(a)
        early.settle(a)
        await asyncio.wait_for(waiter, 1)
        assert done and early.num_open("p0") == 1  # ``later`` is still open
        await early.settled("p1", mark)  # nothing open there: at once
        cancelled = asyncio.ensure_future(early.settled("p0", early.last()))
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        early.settle(later)
        return done

    assert asyncio.run(main()) == ["p0 up to the mark"]
    assert early.num_open("p0") == 0


@pytest.mark.parametrize("how", ["reservation_failed", "decode_computes", "request_ended"])
def test_an_early_prefill_dropped_before_its_landing_is_counted_by_why(how):
    """The prompt went to the prefill node while the decode node reserved; the reservation then
    failed, the decode node chose to compute the prompt itself, or the client left: the prefill is
    aborted on its node and counted as thrown away (``pdserve_early_prefills_dropped_total``)."""
    from pdserve.messages import LandingDescriptor
    from pdserve.metrics import Registry
    from pdserve.proxy.channel import NodeError
    from pdserve.proxy.dispatch import Dispatcher
    from pdserve.proxy.protocol import ProxyError
    from pdserve.sampling_params import SamplingParams

    r = router([info("prefill")], [info("decode", node_id="d0")])
    decode_node, prefill_node = r.decode[0], r.prefill[0]
    decode_node.load = NodeLoad(0, 0, 0, 100, 100, 0)  # room: the prompt goes out early
    prefill_started = asyncio.Event()
    aborted: list[str] = []

    async def reserve(msg, timeout=None):
        await prefill_started.wait()  # the prompt is on the prefill node first
        if how == "reservation_failed":
            raise NodeError(decode_node.url, "bad reservation", 400)
        if how == "request_ended":
            await asyncio.sleep(10)  # cancelled by the client leaving
        return LandingDescriptor(msg.request_id, "d0", "tcp://127.0.0.1:1", [], 64, 1e12, local_prefill=True)

    async def prefill(msg, timeout=None, sent=None):
        if sent is not None:
            sent.set_result(None)
        prefill_started.set()
        await asyncio.sleep(10)  # computing, then waiting for its landing

    async def abort(*a, **k):
        aborted.append(a[0] if a else "")

    decode_node.client.reserve = reserve
    decode_node.client.stream = _open_stream
    decode_node.client.abort = lambda *a, **k: asyncio.sleep(0)
    prefill_node.client.abort = abort
    prefill_node.client.prefill = prefill
    registry = Registry()
    d = Dispatcher(r, registry, overlap_reserve=True)

    async def main() -> None:
        gen = d.start("r0", list(range(64)), SamplingParams(max_tokens=2), 1e9)
        if how == "reservation_failed":
            with pytest.raises(ProxyError, match="bad reservation"):
                await gen.next()
        elif how == "request_ended":
            task = asyncio.ensure_future(gen.next())
            await prefill_started.wait()
            await asyncio.sleep(0.01)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        else:  # the decode node computes it: the stream (a fake here) ends the request its own way
            task = asyncio.ensure_future(gen.next())
            await prefill_started.wait()
            await asyncio.sleep(0.05)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.01)

    asyncio.run(main())
    counts = {
        reason: d.early_prefills_dropped.labels(reason).value
        for reason in ("reservation_failed", "decode_computes", "request_ended")
    }
    assert counts == {reason: float(reason == how) for reason in counts}
    assert aborted, "the prefill node was told to abort"
    assert f'pdserve_early_prefills_dropped_total{{reason="{how}"}} 1.0' in registry.render()


@pytest.mark.parametrize("streamed", [[5, 6], [5, 6, 7, 8]])
def test_a_parallel_request_moves_sequence_by_sequence(streamed):
    """n = 2, max_tokens 4: the decode node dies after sequence 0 ended (it stays as it was) and
    sequence 1 streamed ``streamed``. With tokens left, sequence 1 goes on as a request of its own
    (the prompt and its tokens, 2 more, ``resumed_tokens`` 2) on the other decode node, its events
    under index 1; with its budget spent, it just ends ("length"), nothing moves."""
    from pdserve.messages import LandingDescriptor, PrefillResult, TokenEvent
    from pdserve.metrics import Registry
    from pdserve.proxy.channel import NodeError
    from pdserve.proxy.dispatch import Dispatcher
    from pdserve.sampling_params import SamplingParams

    r = router([info("prefill")], [info("decode", node_id="d0"), info("decode", node_id="d1")])
    dying, survivor = r.decode
    reserved: list[tuple[str, str, list[int], SamplingParams]] = []

    def reserve_on(node):
        async def reserve(msg, timeout=None):
            reserved.append((node.node_id, msg.request_id, list(msg.prompt_token_ids), msg.params))
            return LandingDescriptor(msg.request_id, node.node_id, "tcp://127.0.0.1:1", [0], 16, 1e12)

        return reserve

    class _Events:
        def __init__(self, request, sink, events):
            self.request, self.sink, self.events = request, sink, events

        async def __aenter__(self):
            loop = asyncio.get_running_loop()
            for item in self.events(self.request.request_id):
                loop.call_soon(self.sink, item)
            return self

        async def __aexit__(self, *exc):
            return False

    def first_attempt(rid):
        return [
            TokenEvent(rid, [1], "a", index=0),
            TokenEvent(rid, streamed[:1], "b", index=1),
            TokenEvent(rid, [2], "c", index=0, finish_reason="stop"),
            TokenEvent(rid, streamed[1:], "d", index=1),
            NodeError(dying.url, "connection lost"),
        ]

    def resumed(rid):
        return [TokenEvent(rid, [8], "e"), TokenEvent(rid, [9], "f", finish_reason="length")]

    async def prefill(msg, timeout=None, sent=None):
        return PrefillResult(msg.request_id, ok=True)

    dying.client.reserve, survivor.client.reserve = reserve_on(dying), reserve_on(survivor)
    dying.client.stream = lambda request, sink, **k: _Events(request, sink, first_attempt)
    survivor.client.stream = lambda request, sink, **k: _Events(request, sink, resumed)
    for node in (dying, survivor, r.prefill[0]):
        node.client.abort = lambda *a, **k: asyncio.sleep(0)
    r.prefill[0].client.prefill = prefill
    r.policy = RoundRobin()  # d0 first
    d = Dispatcher(r, Registry(), overlap_reserve=False)

    async def main() -> list:
        gen = d.start("r0", [100] * 16, SamplingParams(n=2, max_tokens=4, temperature=0.0), 1e9)
        out = []
        while (event := await gen.next()) is not None:
            out.append(
                (event.request_id, event.index, event.token_ids, event.finish_reason, event.num_prompt_tokens)
            )
        await asyncio.sleep(0.01)
        return out

    out = asyncio.run(main())
    by_index = {i: [t for _, j, ts, _, _ in out if j == i for t in ts] for i in (0, 1)}
    assert {rid for rid, *_ in out} == {"r0"} and by_index[0] == [1, 2]
    assert [e[3] for e in out if e[1] == 0 and e[3]] == ["stop"]
    if len(streamed) == 2:
        assert by_index[1] == [5, 6, 8, 9] and [e[3] for e in out if e[1] == 1 and e[3]] == ["length"]
        ((node, rid, prompt, params),) = reserved[1:]
        assert (node, rid, prompt) == ("d1", "r0-m1-s1", [100] * 16 + [5, 6])
        assert (params.n, params.max_tokens, params.resumed_tokens) == (1, 2, 2)
        assert [e[4] for e in out if e[2] in ([8], [9])] == [
            16,
            16,
        ]  # the client's prompt, not the resumed one
    else:
        assert by_index[1] == [5, 6, 7, 8] and out[-1][1:4] == (1, [], "length")
        assert [node for node, *_ in reserved] == ["d0"]  # nothing moved

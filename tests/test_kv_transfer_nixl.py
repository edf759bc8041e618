"""nixl reads the blocks in place out of the prefill node's registered cache (DRAM via UCX here):
block ids in any order and number, caches of different sizes, a reservation released while its
READ is running, a prefill node killed mid-READ; and the prefill node keeping the source blocks
until the sender released them, even when the request is aborted or its send failed meanwhile."""

from __future__ import annotations

import dataclasses
import itertools
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
import types
from concurrent.futures import Future

import msgspec
import pytest
import torch

from pdserve import kv_transfer
from pdserve.kv_transfer import KVSendFuture, KVTransferError, ReservationTable
from pdserve.kv_transfer.messages import KVCommit, KVReady
from pdserve.messages import NodeInfo, decode

nixl_only = pytest.mark.skipif("nixl" not in kv_transfer.available_transports(), reason="nixl not installed")

SMALL = (3, 2, 4, 8)  # layers, KV heads, block size, head dim: 512-byte slabs in float32
LARGE = (3, 8, 16, 128)  # 128 KiB slabs: a READ of a few hundred blocks takes tens of milliseconds


def info(node_id: str, shape: tuple) -> NodeInfo:
    layers, heads, block, dim = shape
    return NodeInfo(node_id, "decode", "m", "float32", block, layers, heads, dim, "LNB2SHD", "", "", 64, 100)


def cache(shape: tuple, num_blocks: int, fill: bool, block_major: bool = True) -> torch.Tensor:
    """[L, NB, 2, BS, H, D], block-major in memory as an engine's cache (``KVLayout``), or layer-major."""
    layers, heads, block, dim = shape
    make = torch.randn if fill else torch.zeros
    if block_major:
        return make(num_blocks, layers, 2, block, heads, dim).transpose(0, 1)
    return make(layers, num_blocks, 2, block, heads, dim)


class Pair:
    """A nixl receiver (decode) and sender (prefill) in this process, each with its own cache."""

    def __init__(
        self,
        shape: tuple,
        src_blocks: int,
        dst_blocks: int,
        options: tuple = (),
        layouts: str = "block-major",
    ) -> None:
        self.shape = shape
        self.src = cache(shape, src_blocks, fill=True, block_major=layouts != "layer-major")
        self.dst = cache(shape, dst_blocks, fill=False, block_major=layouts == "block-major")
        self.table = ReservationTable(shape[0])
        self.commits: list[str] = []
        self.receiver = kv_transfer.create_receiver("nixl", options=options)
        self.receiver.register_kv_cache(self.dst)
        self.address = self.receiver.start(info("decode", shape), self.table, self._commit)
        self.sender = kv_transfer.create_sender("nixl", options=options)
        self.sender.register_kv_cache(self.src)

    def _commit(self, commit: KVCommit) -> None:
        self.commits.append(commit.request_id)

    def send(self, rid: str, src_ids, dst_ids, commit: bool = True, timeout: float = 30.0) -> Future:
        c = KVCommit(rid, first_token=1) if commit else None
        return self.sender.send(self.address, info("prefill", self.shape), rid, src_ids, dst_ids, c, timeout)

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()


@nixl_only
@pytest.mark.parametrize("layouts", ["block-major", "layer-major", "block-major into layer-major"])
def test_non_contiguous_ids_and_caches_of_different_sizes(layouts):
    pair = Pair(SMALL, src_blocks=16, dst_blocks=40, layouts=layouts)
    try:
        # Runs on both sides, runs on one side only, descending ids, a jump across the cache.
        src_ids = [0, 1, 2, 5, 6, 9, 8, 15, 3]
        dst_ids = [10, 11, 12, 20, 30, 31, 32, 39, 0]
        pair.table.add("mix", dst_ids, time.time() + 30)
        assert pair.send("mix", src_ids, dst_ids).result().ok and pair.commits == ["mix"]
        assert torch.equal(pair.dst[:, dst_ids], pair.src[:, src_ids])
        # The sender's whole cache, contiguous across its layers, into a run that is not.
        dst_ids = list(range(24, 40))
        pair.table.add("all", dst_ids, time.time() + 30)
        assert pair.send("all", range(16), dst_ids).result().ok
        assert torch.equal(pair.dst[:, dst_ids], pair.src)
        untouched = sorted(set(range(40)) - {10, 11, 12, 20, 0, *range(24, 40)})
        assert pair.dst[:, untouched].abs().sum() == 0
        n = 9 + 16
        assert pair.sender.bytes_sent == pair.receiver.bytes_received == n * 3 * pair.dst[0, 0].numel() * 4
    finally:
        pair.close()


@nixl_only
def test_cuda_ipc_reads_are_turned_on_unless_the_operator_chose():
    """UCX leaves CUDA IPC READs off without NVLink (one GPU, PCIe): the agents turn them on, since
    the decode node READs, but an operator's own UCX_CUDA_IPC_ENABLE_GET_ZCOPY stands. The choice
    is made in ``pdserve.envs`` (``ucx_environment``) and written once per process, before its
    first agent (``set_up_ucx``): each case runs in a fresh process."""
    from pdserve import envs

    assert envs.ucx_environment(environ={})["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "on"
    chosen = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "off"}
    assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" not in envs.ucx_environment(environ=chosen)
    code = (
        "import os\n"
        "from pdserve.kv_transfer.nixl_common import NixlOptions, make_agent\n"
        "make_agent('test', NixlOptions())\n"
        "print(os.environ['UCX_CUDA_IPC_ENABLE_GET_ZCOPY'])\n"
    )
    for operator, expected in ((None, "on"), ("off", "off")):
        env = {k: v for k, v in os.environ.items() if k != "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"}
        if operator is not None:
            env["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] = operator
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True
        )
        assert out.stdout.split()[-1] == expected, out.stderr[-2000:]


@nixl_only
def test_the_nixl_version_is_read_from_the_build_installed():
    """Where a per-CUDA build is installed without the meta package ``nixl`` (as the tests install
    it), its version is still read (the kv_transfer benchmark wrote it and failed on
    ``importlib.metadata.version("nixl")`` after its runs): that of the distribution whose module
    the transport imports."""
    from importlib.metadata import packages_distributions, version

    from pdserve.kv_transfer.nixl_common import nixl_api, nixl_version

    module = nixl_api().__name__.split(".")[0]
    (dist,) = packages_distributions()[module][:1]
    assert nixl_version() == version(dist)


@nixl_only
def test_agents_with_nixls_progress_thread_move_the_blocks():
    """``NixlOptions.progress_thread`` (off by default) runs NIXL's own progress thread in both
    agents: the blocks land as without it, the ack follows."""
    pair = Pair(SMALL, src_blocks=8, dst_blocks=8, options=(kv_transfer.NixlOptions(progress_thread=True),))
    try:
        assert pair.sender.planes["nixl"].options.progress_thread
        sends = (("runs", [0, 1, 2, 3], [4, 5, 6, 7]), ("scattered", [7, 2, 5], [0, 3, 1]))
        for rid, src_ids, dst_ids in sends:
            pair.table.add(rid, dst_ids, time.time() + 30)
            assert pair.send(rid, src_ids, dst_ids).result().ok
            assert torch.equal(pair.dst[:, dst_ids], pair.src[:, src_ids])
        assert pair.commits == ["runs", "scattered"]
    finally:
        pair.close()


@nixl_only
def test_many_blocks_in_one_read():
    pair = Pair(SMALL, src_blocks=4096, dst_blocks=4096)
    try:
        gen = torch.Generator().manual_seed(0)
        src_ids = torch.randperm(4096, generator=gen)[:3000].tolist()  # ~9000 descriptors
        dst_ids = torch.randperm(4096, generator=gen)[:3000].tolist()
        pair.table.add("many", dst_ids, time.time() + 30)
        assert pair.send("many", src_ids, dst_ids).result().ok
        assert torch.equal(pair.dst[:, dst_ids], pair.src[:, src_ids])
        # And in chunks, as a prompt computed in several steps is shipped.
        pair.dst.zero_()
        pair.table.add("chunks", dst_ids, time.time() + 30)
        for i in range(0, 3000, 1000):
            last = i + 1000 == 3000
            fut = pair.send("chunks", src_ids[i : i + 1000], dst_ids[i : i + 1000], commit=last)
            assert fut.result() is None or (last and fut.result().ok)
        assert torch.equal(pair.dst[:, dst_ids], pair.src[:, src_ids])
        assert pair.commits == ["many", "chunks"]
    finally:
        pair.close()


def _pinned(table: ReservationTable, rid: str) -> bool:
    return bool(table._inflight.get(rid))


@nixl_only
@pytest.mark.parametrize("order", ["in place", "packed"])
def test_release_mid_read_waits_for_it_and_the_sender_holds_its_blocks_until_then(order):
    """An abort on the decode node while its READ runs: ``release`` returns only once the READ is
    over, nothing lands after it, and the sender's future resolves only after the READ ended (the
    prefill node frees its source blocks then). Blocks in order are READ in place; shuffled ones
    are packed into staging slots, READ and scattered (the scatter, too, happens pinned)."""
    as_on_cuda = (kv_transfer.NixlOptions(pack_on_cpu=True),)
    pair = Pair(LARGE, src_blocks=512, dst_blocks=512, options=as_on_cuda)
    ids = list(range(512))
    if order == "packed":
        ids = torch.randperm(512, generator=torch.Generator().manual_seed(1)).tolist()
    try:
        pair.sender.handshake(pair.address, info("prefill", LARGE), 10)
        for attempt in range(5):  # until the abort lands while the READ is in flight
            rid = f"abort-{attempt}"
            pair.table.add(rid, ids, time.time() + 30)
            fut = pair.send(rid, ids, ids)
            pinned_when_resolved: list[bool] = []
            fut.add_done_callback(
                lambda f, rid=rid, out=pinned_when_resolved: out.append(_pinned(pair.table, rid))
            )
            while not _pinned(pair.table, rid) and not fut.done():
                time.sleep(0.0005)
            if fut.done():
                continue  # the READ finished before it was seen: try again
            pair.table.release(rid)
            assert not _pinned(pair.table, rid), "release returned while the READ was in flight"
            after = pair.dst.clone()
            with pytest.raises(KVTransferError, match="no reservation"):
                fut.result(timeout=30)
            assert pinned_when_resolved == [False]
            time.sleep(0.2)
            assert torch.equal(pair.dst, after), "bytes landed after the release"
            assert pair.commits == []
            break
        else:
            pytest.fail("never caught a READ in flight")
        # The pair still serves the next request.
        pair.dst.zero_()
        pair.table.add("next", ids[:8], time.time() + 30)
        assert pair.send("next", ids[100:108], ids[:8]).result().ok
        assert torch.equal(pair.dst[:, ids[:8]], pair.src[:, ids[100:108]])
    finally:
        pair.close()


@nixl_only
def test_packed_sends_larger_than_the_staging_pools():
    """Fragmented blocks are packed into staging slots; a send of more pieces than either node has
    slots takes them in turns (the sender waits for its own READs, the receiver queues READs until
    a slot is free), and sends from several threads share the slots."""
    from pdserve.kv_transfer.nixl_common import NixlOptions
    from pdserve.kv_transfer.nixl_sender import packs
    from pdserve.kv_transfer.staging import StagingOptions

    slab = 2 * SMALL[2] * SMALL[1] * SMALL[3] * 4
    staging = StagingOptions(num_slots=2, slot_bytes=5 * slab)  # 5 blocks of one layer
    kv = cache(SMALL, 64, fill=False, block_major=False)  # 3 layers, layer-major
    options = NixlOptions(descriptors_per_piece=3, staging=staging)
    assert not packs(kv, [4, 9, 2], [0, 1, 2], 1, options)  # DRAM: in place
    options = dataclasses.replace(options, pack_on_cpu=True)  # as on CUDA: packed when in place takes many
    assert packs(kv, [4, 9, 2], [0, 1, 2], 1, options)  # 9 descriptors in place > 3 for 1 piece
    assert not packs(kv, [4, 9, 2], [0, 1, 2], 5, options)
    assert not packs(kv, [1, 2, 3], [5, 6, 7], 1, options)  # one run: 3 descriptors
    kv = cache(SMALL, 64, fill=False)  # block-major: a descriptor per run of every layer
    assert not packs(kv, [4, 9, 2], [0, 1, 2], 1, options)  # 3 descriptors
    assert packs(kv, [4, 9, 2, 7], [0, 1, 2, 3], 1, options)  # 4 > 3
    options = (dataclasses.replace(options, descriptors_per_piece=0),)  # always packed from here
    pair = Pair(SMALL, src_blocks=64, dst_blocks=64, options=options)
    try:
        gen = torch.Generator().manual_seed(0)
        jobs = []
        for k in range(4):  # 4 requests of 12 blocks: 3 layers x 3 pieces each, 2 slots a node
            src = torch.randperm(64, generator=gen)[:12].tolist()
            dst = list(range(12 * k, 12 * k + 12))
            pair.table.add(f"r{k}", dst, time.time() + 30)
            jobs.append((src, dst))
        results = [None] * 4

        def run(k):
            sender = kv_transfer.create_sender("nixl", options=options)  # one sender (and pool) per thread
            sender.register_kv_cache(pair.src)
            try:
                results[k] = sender.send(
                    pair.address,
                    info("prefill", SMALL),
                    f"r{k}",
                    jobs[k][0],
                    jobs[k][1],
                    KVCommit(f"r{k}", first_token=1),
                    30,
                ).result()
            finally:
                sender.close()

        threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert all(r is not None and r.ok for r in results), results
        for src, dst in jobs:
            assert torch.equal(pair.dst[:, dst], pair.src[:, src])
        assert sorted(pair.commits) == ["r0", "r1", "r2", "r3"]
        assert pair.receiver.planes["nixl"].pool.num_slots == 2 and not pair.receiver.planes["nixl"]._waiting
    finally:
        pair.close()


@nixl_only
def test_packed_reads_outside_the_staging_region_are_refused():
    """A packed KVReady may only name bytes inside the sender's registered staging region, and no
    more than one of this node's slots."""
    from pdserve.kv_transfer.messages import KVReady
    from pdserve.kv_transfer.nixl_common import NixlOptions
    from pdserve.kv_transfer.nixl_receiver import _Remote
    from pdserve.kv_transfer.staging import StagingOptions

    slab = 2 * SMALL[2] * SMALL[1] * SMALL[3] * 4
    options = (NixlOptions(staging=StagingOptions(slot_bytes=4 * slab)),)
    pair = Pair(SMALL, src_blocks=16, dst_blocks=16, options=options)
    try:
        plane = pair.receiver.planes["nixl"]
        assert plane.slab_bytes == slab and plane.pool.slot_bytes == 4 * slab
        remote = _Remote("peer", 1 << 20, 16, 0, "DRAM", stage_address=1 << 30, stage_bytes=4 * slab)

        def ready(offset: int, blocks: list[int], layers: tuple[int, int]) -> KVReady:
            return KVReady("r", 1, [], blocks, layers[0], layers[1], 5.0, src_offset=offset)

        assert plane._refusal(remote, ready(0, [1, 2], (0, 2))) == ""  # 4 slabs from offset 0
        assert "reaches past" in plane._refusal(remote, ready(slab, [1, 2], (0, 2)))
        assert "reaches past" in plane._refusal(
            _Remote("peer", 1 << 20, 16, 0, "DRAM"), ready(0, [1], (0, 1))
        )
        assert "exceeds" in plane._refusal(remote, ready(0, [1, 2], (0, 3)))  # 6 slabs, slots of 4
    finally:
        pair.close()


def _prefill_child(address: str, conn) -> None:
    """A prefill node's sender in its own process: offers 512 large blocks, then waits to be killed."""
    torch.set_num_threads(1)
    sender = kv_transfer.create_sender("nixl")
    sender.register_kv_cache(cache(LARGE, 512, fill=True))
    sender.handshake(address, info("prefill", LARGE), 30)
    conn.send("ready")
    conn.recv()
    sender.send(address, info("prefill", LARGE), "doomed", range(512), range(512), None, 30)
    time.sleep(60)


@nixl_only
def test_prefill_node_killed_mid_read():
    dst = cache(LARGE, 512, fill=False)
    table = ReservationTable(LARGE[0])
    commits: list[KVCommit] = []
    receiver = kv_transfer.create_receiver("nixl", options=[kv_transfer.NixlOptions(max_read_s=3.0)])
    receiver.register_kv_cache(dst)
    address = receiver.start(info("decode", LARGE), table, commits.append)
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_prefill_child, args=(address, child_conn), daemon=True)
    child.start()
    sender = None
    try:
        assert conn.poll(120) and conn.recv() == "ready"
        table.add("doomed", list(range(512)), time.time() + 30)
        conn.send("go")
        deadline = time.monotonic() + 30
        while not _pinned(table, "doomed"):
            assert time.monotonic() < deadline, "the READ never started"
            time.sleep(0.0005)
        os.kill(child.pid, signal.SIGKILL)
        child.join(timeout=10)
        start = time.monotonic()
        while _pinned(table, "doomed"):  # failed, cancelled at its deadline, or (rarely) finished
            assert time.monotonic() - start < 10, "the READ from a dead node never ended"
            time.sleep(0.01)
        assert commits == [] and table.commit("doomed") != ""  # never committed without its sender
        released = threading.Thread(target=table.release, args=("doomed",))
        released.start()
        released.join(timeout=2)
        assert not released.is_alive()
        # A new prefill node is served as before.
        src = cache(LARGE, 64, fill=True)
        sender = kv_transfer.create_sender("nixl")
        sender.register_kv_cache(src)
        table.add("next", [5, 9], time.time() + 30)
        commit = KVCommit("next", first_token=1)
        assert sender.send(address, info("prefill", LARGE), "next", [1, 2], [5, 9], commit, 30).result().ok
        assert torch.equal(dst[:, [5, 9]], src[:, [1, 2]]) and [c.request_id for c in commits] == ["next"]
    finally:
        if child.is_alive():
            os.kill(child.pid, signal.SIGKILL)
        if sender is not None:
            sender.close()
        receiver.close()


# -- the prefill node keeps the source blocks until the sender released them -----------------------


class _Sender:
    """Records sends; the test resolves their futures."""

    bytes_sent = 0

    def __init__(self) -> None:
        self.sends: list[tuple[str, list[int], KVSendFuture]] = []

    def send(
        self, address, info, request_id, src_block_ids, dst_block_ids, commit, timeout, written=False
    ) -> KVSendFuture:
        # The last send follows the first token read back: its blocks are written.
        assert written, "the last send of a prompt must say its blocks are written"
        fut = KVSendFuture()
        self.sends.append((request_id, list(src_block_ids), fut))
        return fut


def _over(fut: KVSendFuture, error: Exception | None = None) -> None:
    """The send's outcome and the release of its blocks at once (every transport when it succeeds)."""
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)
    fut.released.set_result(None)


class _Loop:
    """The engine loop's surface the prefill service uses; commands run when the test says."""

    def __init__(self) -> None:
        self.commands: list = []

    def submit(self, fn) -> None:
        self.commands.append(fn)


@pytest.fixture(scope="module")
def engine():
    from pdserve.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    config = EngineConfig.from_kwargs(
        model="random:tiny", num_kv_blocks=32, block_size=16, max_model_len=256, num_threads=1
    )
    return LLMEngine(config)


@pytest.mark.parametrize(
    "case", ["done", "aborted", "aborted, done at once", "done, aborted at once", "failed, read later"]
)
def test_prefill_service_frees_the_blocks_only_when_the_send_is_over(engine, case):
    """The blocks stay pinned until the sender released them (``KVSendFuture.released``), through an
    abort; a send that fails while the peer may still READ (nixl, a dead or stuck decode node)
    reports its failure at once and frees its blocks only at the release."""
    from pdserve.messages import LandingDescriptor
    from pdserve.prefill_node.server import PrefillService, Shipment, Stage
    from pdserve.sampling_params import SamplingParams

    loop = _Loop()
    state = types.SimpleNamespace(
        engine=engine,
        loop=loop,
        info=None,
        node=types.SimpleNamespace(kv_transfer_timeout_s=5.0),
        transfers=[],
    )
    service = PrefillService(state)
    service.sender = _Sender()
    pool = engine.scheduler.kv.pool
    total = pool.num_free_blocks
    rid = f"p-{case}"
    prompt = list(range(5, 45))  # 40 tokens: 3 blocks
    engine.add_request(rid, None, SamplingParams(max_tokens=1), prompt_token_ids=prompt, hold_blocks=True)
    landing = LandingDescriptor(rid, "decode", "tcp://decode", [7, 8, 9], 40, time.time() + 30)
    service.shipments[rid] = Shipment(rid, landing, stage=Stage.PREFILLING)  # the engine runs its prompt
    while rid not in engine.scheduler.held:
        service.after_step(engine.step())
    ((sent_rid, src, fut),) = service.sender.sends
    assert sent_rid == rid and src == engine.held_block_ids(rid) and len(src) == 3

    def still_pinned() -> None:
        assert pool.num_free_blocks == total - 3
        assert all(pool.blocks[b].ref_cnt == 1 for b in src) and engine.held_block_ids(rid) == src
        engine.scheduler.check_integrity()

    if case == "done, aborted at once":  # the send ends, and an abort runs before its release
        _over(fut)
    if "aborted" in case:  # NodeState.end_request, run by a command when the proxy gives up
        service.forget(rid)
        engine.abort_request([rid])
        if case == "aborted, done at once":  # the send ends before the next command runs
            _over(fut, KVTransferError("peer gone"))
        while loop.commands:
            loop.commands.pop(0)(engine)
    if case == "failed, read later":  # the send's timeout: the node learns at once, the blocks wait
        fut.set_exception(KVTransferError("no reply from KV peer tcp://decode in time"))
        (finish,) = loop.commands
        loop.commands.clear()
        finish(engine)
        assert [(t.request_id, t.error) for t in state.transfers] == [
            (rid, "no reply from KV peer tcp://decode in time")
        ]
        assert not [r for r, x in service.shipments.items() if x.stage is Stage.SENDING]
        still_pinned()  # a READ offered may still run on the decode node
        fut.released.set_result(None)
        (unpin,) = loop.commands
        loop.commands.clear()
        unpin(engine)
    # Neither the step's end nor an abort gave the blocks back: the peer may still be reading them.
    if not fut.done():
        still_pinned()
        _over(fut)
        assert len(loop.commands) == 2  # the outcome and the release, queued for the engine thread
        while loop.commands:
            loop.commands.pop(0)(engine)
    assert pool.num_free_blocks == total and rid not in engine.scheduler.held and not loop.commands
    assert not [r for r, x in service.shipments.items() if x.stage is Stage.SENDING]  # no send in flight
    engine.scheduler.check_integrity()


# -- the commit behind the READs ------------------------------------------------------------------


@nixl_only
def test_the_commit_follows_the_reads_at_once_and_the_ack_ends_them():
    """The sender sends its commit right behind its KVReady, without waiting for the READ: the
    decode node takes the commit once the READs of its request ended (one round trip a send), and
    the ack tells the sender they are over (a READ's own report, if it ended before the commit
    arrived, reaches the sender while it waits for the ack)."""
    pair = Pair(LARGE, src_blocks=512, dst_blocks=512)
    try:
        pair.sender.handshake(pair.address, info("prefill", LARGE), 10)
        session = pair.sender._peers[pair.address].session
        waited: list = []
        wait_one = session._wait_one
        session._wait_one = lambda deadline: (waited.append(deadline), wait_one(deadline))
        for k in range(3):
            rid = f"one-trip-{k}"
            pair.table.add(rid, list(range(512)), time.time() + 30)
            assert pair.send(rid, range(512), range(512)).result().ok
        assert waited == [] and session._pending == {}  # never waited for a READ's report
        assert torch.equal(pair.dst, pair.src) and len(pair.commits) == 3
    finally:
        pair.close()


def _bare_receiver_plane(table: ReservationTable):
    """A nixl receiver plane with its bookkeeping only (no NIXL agent): for the commit logic."""
    from pdserve.kv_transfer.nixl_receiver import NixlReceiverPlane

    plane = NixlReceiverPlane()
    plane.table = table
    acks: list = []
    commits: list = []
    plane.outbox = types.SimpleNamespace(put=lambda peer, msg: acks.append((peer, msg)))
    plane.on_commit = commits.append
    return plane, acks, commits


def _read(peer: bytes, rid: str, deadline: float):
    from pdserve.kv_transfer.messages import KVReady
    from pdserve.kv_transfer.nixl_receiver import _Read

    return _Read(
        handle=None, peer=peer, msg=KVReady(rid, 1, [0], [0], 0, 3, 5.0), deadline=deadline, nbytes=0
    )


def test_a_commit_waiting_behind_reads_of_a_connection_that_closed_is_never_taken():
    """The sender's connection closes while its commit waits for a READ: the request fails, and
    when the READ ends the commit is neither taken nor acked (the sender gave up on it and may have
    given the source blocks back)."""
    table = ReservationTable(3)
    table.add("r", [0], time.time() + 30)
    plane, acks, commits = _bare_receiver_plane(table)
    plane._inflight = [_read(b"peer", "r", time.monotonic() + 30)]
    assert plane.handle(b"peer", KVCommit("r", first_token=1), ()) == ""
    assert plane._commits and acks == []  # waits behind the READ
    plane.drop(b"peer")
    table.end("r", [0], 0, 3)  # the READ lands after all
    plane._inflight = []
    plane._settle_commits()
    assert acks == [] and commits == [] and plane._commits == []
    assert "connection closed" in table.commit("r")


def test_a_commit_is_taken_once_the_last_read_of_its_request_ended():
    """Commits wait per request and connection: another request's READ does not hold one back."""
    table = ReservationTable(3)
    for rid in ("a", "b"):
        table.add(rid, [0 if rid == "a" else 1], time.time() + 30)
        table.write(rid, [0 if rid == "a" else 1], 0, 3, lambda: None)
    plane, acks, commits = _bare_receiver_plane(table)
    plane._inflight = [_read(b"p", "a", time.monotonic() + 30)]
    plane.handle(b"p", KVCommit("a", first_token=1), ())
    plane.handle(b"p", KVCommit("b", first_token=2), ())
    assert [m.request_id for _, m in acks] == ["b"] and [c.request_id for c in commits] == ["b"]
    plane._inflight = []
    plane._settle_commits()
    assert [(m.request_id, m.ok) for _, m in acks] == [("b", True), ("a", True)]


def test_a_read_that_ends_behind_a_waiting_commit_is_reported_by_the_ack_alone():
    """Once the request's commit waits on the decode node, the sender has offered all its READs:
    the READs' ends are not reported one by one, the ack says it (and a failure reaches the sender
    through the ack); a READ that ends before its commit arrived is reported as usual."""
    table = ReservationTable(3)
    for rid in ("early", "behind"):
        table.add(rid, [0 if rid == "early" else 1], time.time() + 30)
    plane, replies, commits = _bare_receiver_plane(table)
    plane.pool = types.SimpleNamespace(release=lambda slot: None)
    for rid, block in (("early", 0), ("behind", 1)):
        assert table.begin(rid, [block], 0, 3) == ""
    early, behind = _read(b"p", "early", time.monotonic() + 30), _read(b"p", "behind", time.monotonic() + 30)
    behind.msg = msgspec.structs.replace(behind.msg, dst_block_ids=[1])
    plane._inflight = [behind]
    plane._end(b"p", early.msg, -1, "")  # no commit waiting: reported
    plane.handle(b"p", KVCommit("behind", first_token=1), ())
    plane._inflight = []
    plane._end(b"p", behind.msg, -1, "")  # its commit waits: the ack alone answers
    plane._settle_commits()
    assert [(type(m).__name__, m.request_id) for _, m in replies] == [
        ("KVReadDone", "early"),
        ("KVAck", "behind"),
    ]
    assert replies[1][1].ok and [c.request_id for c in commits] == ["behind"]


def test_the_last_read_of_a_request_is_committed_and_acked_as_it_ends():
    """A READ that lands with its request's commit waiting and no other READ of the request left
    (running or waiting for a slot) is committed as it is unpinned and acked at once; one with
    another READ of its request still running leaves the commit waiting for that one."""
    table = ReservationTable(3)
    table.add("r", [0, 1], time.time() + 30)
    plane, acks, commits = _bare_receiver_plane(table)
    first, last = _read(b"p", "r", time.monotonic() + 30), _read(b"p", "r", time.monotonic() + 30)
    last.msg = msgspec.structs.replace(last.msg, xfer_id=2, dst_block_ids=[1])
    assert table.begin("r", [0], 0, 3) == "" and table.begin("r", [1], 0, 3) == ""
    plane._inflight = [first, last]
    plane.handle(b"p", KVCommit("r", first_token=1), ())
    plane._end(b"p", first.msg, -1, "")  # the other READ still runs: neither reported nor acked
    assert acks == [] and commits == [] and len(plane._commits) == 1
    plane._inflight = [last]
    plane._end(b"p", last.msg, -1, "")  # the last one: committed and acked here
    assert [(type(m).__name__, m.request_id, m.ok) for _, m in acks] == [("KVAck", "r", True)]
    assert [c.request_id for c in commits] == ["r"] and plane._commits == []
    assert "already committed" in table.begin("r", [0], 0, 3)


def test_a_read_that_ends_past_its_deadline_fails_its_request():
    """A READ found done only after its deadline may have read blocks the sender gave back by
    then: it counts as failed, and the commit waiting behind it is refused."""
    table = ReservationTable(3)
    table.add("late", [0], time.time() + 30)
    plane, acks, commits = _bare_receiver_plane(table)
    plane.agent = types.SimpleNamespace(check_xfer_state=lambda handle: "DONE")
    read = _read(b"p", "late", time.monotonic() - 0.01)
    read.handle = types.SimpleNamespace(release=lambda: None)
    assert table.begin("late", [0], 0, 3) == ""
    plane._inflight = [read]
    plane.handle(b"p", KVCommit("late", first_token=1), ())
    assert acks == []
    plane.poll()
    assert len(acks) == 1  # the commit waited: the ack alone answers, with the READ's error
    ack = acks[0][1]
    assert not ack.ok and "past its deadline" in ack.error and commits == []


def test_a_sends_last_read_is_polled_tightly_on_a_gpu_and_acked_at_once():
    """On a GPU the control thread polls a send's last READ in a tight loop for up to
    ``settle_spin_s``: one that ends within it is committed and acked before ``_settle`` returns;
    one still running then is left to the control loop's turns (no ack yet); a READ whose state
    cannot be read does not take the control thread down. Never on the CPU (no stream)."""
    from pdserve.kv_transfer.nixl_common import NixlOptions

    def plane_with(states, spin_s: float, stream=True):
        table = ReservationTable(3)
        table.add("r", [0], time.time() + 30)
        assert table.begin("r", [0], 0, 3) == ""
        plane, acks, commits = _bare_receiver_plane(table)
        plane.options = NixlOptions(settle_spin_s=spin_s)
        plane.stream = object() if stream else None
        calls = []

        def check(handle):
            calls.append(time.perf_counter())
            state = states[min(len(calls), len(states)) - 1]
            if isinstance(state, Exception):
                raise state
            return state

        plane.agent = types.SimpleNamespace(check_xfer_state=check)
        read = _read(b"p", "r", time.monotonic() + 30)
        read.handle = types.SimpleNamespace(release=lambda: None)
        plane._inflight = [read]
        plane._commits = [(b"p", KVCommit("r", first_token=1))]
        return plane, acks, calls

    # Ends on the 50th check, well inside a second's spin: acked before _settle returns, the state
    # the spin saw last not asked again.
    plane, acks, calls = plane_with(["PROC"] * 49 + ["DONE"], spin_s=1.0)
    plane._settle()
    assert [(type(m).__name__, m.ok) for _, m in acks] == [("KVAck", True)] and len(calls) == 50
    # Still running after a 2 ms spin: no ack, the READ stays in flight for the next turns.
    plane, acks, calls = plane_with(["PROC"], spin_s=0.002)
    started = time.perf_counter()
    plane._settle()
    assert acks == [] and len(plane._inflight) == 1 and 0.002 <= calls[-1] - started < 0.5
    # A state that cannot be read: no exception; polled again at the next turns.
    plane, acks, calls = plane_with([RuntimeError("gone")], spin_s=1.0)
    plane._settle()
    assert acks == [] and len(plane._inflight) == 1 and len(calls) == 2
    # No stream (a cache in host memory) or spin 0: one check only, by the usual poll.
    for kwargs in ({"stream": False}, {"spin_s": 0.0}):
        plane, acks, calls = plane_with(["PROC"] * 3 + ["DONE"], **{"spin_s": 1.0, **kwargs})
        plane._settle()
        assert acks == [] and len(calls) == 1


def test_a_sender_that_loses_its_connection_keeps_the_blocks_until_its_reads_were_given_up():
    """With READs offered and not reported over, closing a session returns at once with the end of
    the latest time the decode node was given for one of them, plus a margin for the trip (when the
    sender may release the blocks), and frees their staging slots only then. READs reported over
    (or acked) earlier, with longer times, do not count."""
    from pdserve.kv_transfer.nixl_common import NixlOptions
    from pdserve.kv_transfer.nixl_sender import READ_MARGIN_S, NixlSession, _Offered

    released: list[tuple[int, float]] = []
    plane = types.SimpleNamespace(
        progress=None,
        pool=types.SimpleNamespace(release=lambda slot: released.append((slot, time.monotonic()))),
        options=NixlOptions(max_read_s=5.0),
    )
    session = NixlSession(plane, types.SimpleNamespace(address="tcp://peer"))
    start = time.monotonic()
    session._pending = {9: _Offered(-1, start + 30.0)}  # an earlier send's READ, given 30 s
    session.acked()  # ... and over
    session._pending = {1: _Offered(-1, start + 0.1), 2: _Offered(3, start + 0.2)}  # in place; slot 3
    quiet_at = session.close()
    assert time.monotonic() - start < 0.05 and session._pending == {}
    assert quiet_at == pytest.approx(start + 0.2 + READ_MARGIN_S)
    time.sleep(0.1)
    assert released == []  # the decode node may still READ slot 3
    deadline = time.monotonic() + 5
    while not released and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [slot for slot, _ in released] == [3] and released[0][1] >= quiet_at
    # A READ given more than max_read_s is cancelled by then on the decode node.
    session._pending = {4: _Offered(-1, time.monotonic() + 60.0)}
    assert session.close() == pytest.approx(time.monotonic() + 5.0 + READ_MARGIN_S, abs=0.05)
    assert session.close() <= time.monotonic()  # nothing pending: free now
    # A READ is given the send's time left less the margin, at most a tenth of it.
    sent: list = []
    plane._xfer_ids = itertools.count()
    session.peer = types.SimpleNamespace(
        send=lambda frames, deadline: sent.append(decode(frames[0], KVReady))
    )
    for left in (10.0, 1.0):
        session._offer("r", -1, [0], [0], 0, 1, time.monotonic() + left)
    assert sent[0].timeout_s == pytest.approx(10.0 - READ_MARGIN_S, abs=0.01)
    assert sent[1].timeout_s == pytest.approx(0.9, abs=0.01)


@nixl_only
def test_a_send_failing_after_a_chunk_that_may_still_be_read_is_released_behind_it():
    """A decode node that stops answering: the request's chunk fails at its timeout, the send with
    its commit fails right behind it (the sender's caller, the prefill node, watches only that one),
    and neither releases the blocks before the decode node's time for the chunk's READ is past."""
    from pdserve.kv_transfer.nixl_sender import READ_MARGIN_S

    pair = Pair(SMALL, src_blocks=16, dst_blocks=16)
    try:
        pair.sender.handshake(pair.address, info("prefill", SMALL), 10)
        pair.receiver._stop.set()  # stuck: as far as the sender knows, it may still READ
        pair.receiver._thread.join(timeout=5)
        pair.table.add("r", [1, 2, 3], time.time() + 30)
        start = time.monotonic()
        events: dict[str, float] = {}

        def at(name: str):
            return lambda _: events.setdefault(name, time.monotonic() - start)

        chunk = pair.send("r", [0, 1], [1, 2], commit=False, timeout=1.0)  # its READ: 0.9 s
        last = pair.send("r", [2], [3], timeout=0.2)
        for name, fut in (("chunk", chunk), ("last", last)):
            fut.add_done_callback(at(name + " failed"))
            fut.released.add_done_callback(at(name + " released"))
        for fut in (chunk, last):
            with pytest.raises(KVTransferError):
                fut.result(timeout=10)
            fut.released.result(timeout=10)
        read_end = 0.9 + READ_MARGIN_S - 0.05
        assert events["chunk failed"] < 1.3 and events["last failed"] < events["chunk released"]
        assert read_end <= events["chunk released"] <= events["last released"]
    finally:
        pair.close()


def test_the_ack_frees_the_staging_slots_of_reads_not_reported_one_by_one():
    from pdserve.kv_transfer.nixl_sender import NixlSession, _Offered

    released: list[int] = []
    plane = types.SimpleNamespace(progress=None, pool=types.SimpleNamespace(release=released.append))
    session = NixlSession(plane, types.SimpleNamespace(address="tcp://peer"))
    session._pending = {7: _Offered(2, 0.0), 8: _Offered(-1, 0.0)}
    session.acked()
    assert released == [2] and session._pending == {}
    session._finish(time.monotonic() + 1)  # nothing left to wait for


@nixl_only
@pytest.mark.parametrize("order", ["in place, scattered", "in place, runs", "packed"])
def test_a_send_is_one_message_each_way(order):
    """The commit rides in the send's last KVReady: a one-piece send is one message to the decode
    node and one (the ack) back, with no READ's report; scattered blocks READ by index from the
    descriptor lists prepared once per session, runs of more blocks than ``prepared_max_blocks``
    from lists built per READ."""
    options = (
        (kv_transfer.NixlOptions(pack_on_cpu=True, descriptors_per_piece=0),)
        if order == "packed"
        else (kv_transfer.NixlOptions(prepared_max_blocks=2),)
    )
    pair = Pair(SMALL, src_blocks=16, dst_blocks=32, options=options)
    try:
        pair.sender.handshake(pair.address, info("prefill", SMALL), 10)
        peer = pair.sender._peers[pair.address]
        sent, replies = [], []
        send, recv = peer.send, peer.recv

        def recording_send(frames, deadline):
            sent.append(type(_decode(frames[0])).__name__)
            send(frames, deadline)

        peer.send = recording_send

        def recording_recv(*args, **kw):
            reply = recv(*args, **kw)
            replies.append(type(reply).__name__)
            return reply

        peer.recv = recording_recv
        plane = pair.receiver.planes["nixl"]
        prepped, built = [], []
        make, init = plane.agent.make_prepped_xfer, plane.agent.initialize_xfer
        plane.agent.make_prepped_xfer = lambda *a, **k: (prepped.append(1), make(*a, **k))[1]
        plane.agent.initialize_xfer = lambda *a, **k: (built.append(1), init(*a, **k))[1]
        src, dst = ([9, 2, 14], [30, 3, 17]) if order != "in place, runs" else ([4, 5, 6], [10, 11, 12])
        pair.table.add("one", dst, time.time() + 30)
        assert pair.send("one", src, dst).result().ok
        assert sent == ["KVReady"] and replies == ["KVAck"]
        assert torch.equal(pair.dst[:, dst], pair.src[:, src]) and pair.commits == ["one"]
        if order == "in place, scattered":
            assert prepped == [1] and built == []
        elif order == "in place, runs":  # 3 blocks: more than 2
            assert prepped == [] and built == [1]
            pair.table.add("two", [20, 21], time.time() + 30)  # a run of 2: by index
            assert pair.send("two", [7, 8], [20, 21]).result().ok
            assert prepped == [1] and built == [1]
            assert torch.equal(pair.dst[:, [20, 21]], pair.src[:, [7, 8]])
    finally:
        pair.close()


def _decode(frame):
    from pdserve.kv_transfer.messages import REQUESTS
    from pdserve.messages import decode

    return decode(bytes(frame.buffer) if hasattr(frame, "buffer") else frame, REQUESTS)


@nixl_only
def test_a_refused_read_carrying_the_commit_is_answered_by_the_refused_ack_alone():
    """A KVReady with the commit whose READ is refused (blocks not reserved) gets one answer, the
    refused KVAck naming why, and no KVReadDone: the sender fails at once, not at its deadline."""
    from pdserve.kv_transfer.messages import KVReady

    table = ReservationTable(3)
    table.add("r", [0], time.time() + 30)
    plane, replies, commits = _bare_receiver_plane(table)
    plane.num_layers, plane.num_blocks = 3, 16
    remote_less = KVReady("r", 1, [0], [5], 0, 3, 5.0, commit=KVCommit("r", first_token=1))
    assert plane.handle(b"p", remote_less, ()) == ""  # no nixl session on this connection
    assert [(type(m).__name__, m.ok) for _, m in replies] == [("KVAck", False)]
    assert "without a nixl session" in replies[0][1].error and commits == [] and plane._commits == []
    assert table.commit("r")  # failed: never committed


@nixl_only
def test_a_packed_send_stopped_by_a_refusal_still_sends_its_commit():
    """A packed send whose pieces are refused stops offering them; its commit, which would have
    ridden in the last piece, goes alone, so the sender hears the refusal at once."""
    from pdserve.kv_transfer.nixl_common import NixlOptions
    from pdserve.kv_transfer.staging import StagingOptions

    slab = 2 * SMALL[2] * SMALL[1] * SMALL[3] * 4
    staging = StagingOptions(num_slots=1, slot_bytes=2 * slab)
    options = (NixlOptions(pack_on_cpu=True, descriptors_per_piece=0, staging=staging),)
    pair = Pair(SMALL, src_blocks=16, dst_blocks=16, options=options)
    try:
        pair.table.add("half", [0, 1], time.time() + 30)  # blocks 2 and 3 are nobody's
        start = time.monotonic()
        with pytest.raises(kv_transfer.KVRefused, match="not all reserved"):
            pair.send("half", [7, 3, 11, 5], [0, 1, 2, 3], timeout=20).result()
        assert time.monotonic() - start < 5 and pair.commits == []
        pool = pair.sender.planes["nixl"].pool
        slot = pool.try_acquire()
        assert slot is not None  # its slot came back
        pool.release(slot)
        pair.table.add("after", [8, 9], time.time() + 30)
        assert pair.send("after", [1, 4], [8, 9]).result().ok  # the connection still serves
    finally:
        pair.close()


@nixl_only
def test_without_prepared_lists_scattered_blocks_are_read_by_lists_built_per_read():
    """Where NIXL cannot prepare a cache's slab list (``_prepared`` gives None), scattered blocks
    are READ as runs are, by descriptor lists built for the READ."""
    from pdserve.kv_transfer.base import KVLayout
    from pdserve.kv_transfer.nixl_receiver import _prepared, _unit_array

    def refuse(*args):
        raise RuntimeError("no strided lists here")

    LAYOUT = KVLayout(2, 4, 8, block_major=False)

    assert (
        _prepared(types.SimpleNamespace(prep_xfer_dlist=refuse), "x", _unit_array(1, LAYOUT, 0), "DRAM")
        is None
    )
    pair = Pair(SMALL, src_blocks=16, dst_blocks=16)
    try:
        plane = pair.receiver.planes["nixl"]
        plane._units = None
        pair.table.add("built", [6, 1, 12], time.time() + 30)
        assert pair.send("built", [3, 9, 0], [6, 1, 12]).result().ok
        assert torch.equal(pair.dst[:, [6, 1, 12]], pair.src[:, [3, 9, 0]])
    finally:
        pair.close()


@pytest.mark.parametrize("same_gpu", [False, True])
def test_layer_chunks_follow_the_forward_except_when_both_caches_share_a_gpu(same_gpu):
    """With per-layer events, a send is offered in layer chunks as each is written; when the peer's
    cache is on this GPU (``NixlAccept.gpu`` matched at set-up), in one READ after the whole
    forward: the two processes' work on one GPU is time-sliced, and READs during it slowed it."""
    import itertools

    from pdserve.kv_transfer.base import KVLayout, Staged, slab_bytes
    from pdserve.kv_transfer.messages import KVReady
    from pdserve.kv_transfer.nixl_common import NixlOptions
    from pdserve.kv_transfer.nixl_sender import NixlSession
    from pdserve.messages import decode

    kv = torch.zeros(4, 16, 2, 4, 1, 8)  # 4 layers; a chunk of 2 layers at 2 blocks a slab each
    waited: list[int] = []

    class Event:
        def __init__(self, layer: int) -> None:
            self.layer = layer

        def synchronize(self) -> None:
            waited.append(self.layer)

    sent: list = []
    plane = types.SimpleNamespace(
        kv=kv,
        layout=KVLayout.of(kv),
        slab_bytes=slab_bytes(kv),
        options=NixlOptions(layer_chunk_bytes=2 * 2 * slab_bytes(kv)),
        packs_here=False,  # a cache on the CPU
        progress=None,
        _xfer_ids=itertools.count(1),
    )
    link = types.SimpleNamespace(address="tcp://peer", send=lambda frames, deadline: sent.append(frames))
    session = NixlSession(plane, link, same_gpu=same_gpu)
    staged = Staged(None, [3, 4], [(i + 1, Event(i + 1)) for i in range(4)])
    commit = KVCommit("r", 7)
    session.deliver("r", staged, [5, 6], time.monotonic() + 10, commit)
    offers = [decode(frames[0], KVReady) for frames in sent]
    if same_gpu:
        assert [(o.layer_start, o.layer_end) for o in offers] == [(0, 4)] and waited == [4]
    else:
        assert [(o.layer_start, o.layer_end) for o in offers] == [(0, 2), (2, 4)] and waited == [2, 4]
    assert offers[-1].commit == commit and all(o.commit is None for o in offers[:-1])
    assert all(o.src_block_ids == [3, 4] and o.dst_block_ids == [5, 6] for o in offers)


@nixl_only
def test_the_read_setup_benchmark_times_both_ways_and_checks_the_bytes(tmp_path):
    """``pdserve.benchmarks.nixl_read_setup`` on DRAM: both ways of building a READ timed at each
    count, and the last READ's bytes checked against the sender's (it raises otherwise)."""
    from pdserve.benchmarks import nixl_read_setup

    out = tmp_path / "setup.json"
    nixl_read_setup.main(["--dry-run", "--counts", "1,4", "--repeats", "3", "--output", str(out)])
    result = json.loads(out.read_text())
    assert [r["blocks"] for r in result["results"]] == [1, 4]
    ways = ("built", "prepared", "built_sleep0", "built_yield")
    assert all(r[f"{way}_median_us"] > 0 for r in result["results"] for way in ways)


@nixl_only
def test_kv_transfer_benchmark_nixl_dry_run(kv_benchmark):
    """The kv_transfer benchmark over nixl on the CPU: the raw NIXL anchors answer on the receiver's
    thread of their own, the warm anchor on its main thread, and both give every size a ratio; the
    breakdown splits the data message's trip at the receiver's poll and says how many sends went
    out on the caller's thread; the JSON records the options."""
    result = kv_benchmark("--transports", "nixl", "--anchors", "nixl", "--raw-nixl-progress-thread", "off")
    assert result["nixl_progress_thread"] is False and result["raw_nixl_progress_thread"] is False
    for row in result["results"]:
        for anchor in ("raw_nixl_read", "raw_nixl_read_warm", "raw_nixl_read_2mib", "raw_nixl_write"):
            assert row[f"{anchor}_gb_s"] > 0
        assert row["ratio_nixl_to_raw_nixl_read"] == pytest.approx(
            row["pdserve_nixl_gb_s"] / row["raw_nixl_read_gb_s"]
        )
        assert row["ratio_nixl_to_raw_nixl_read_warm_paired_median"] > 0
        steps = row["breakdown_us"]["raw_nixl_read"]
        assert steps["anchor: the whole READ, to its answer"]["p50"] > 0
    steps = result["one_block_breakdown_us"]["nixl"]
    wire = steps["wire: data message to the receiver's control thread"]["p50"]
    to_poll = steps["  of it: to the return of the receiver's poll that saw it"]["p50"]
    after_poll = steps["  of it: that poll's return to the plane's handle"]["p50"]
    assert 0 < to_poll < wire and 0 < after_poll < wire
    # The thread's CPU time over a step of one thread, beside its wall time.
    assert steps["CPU of it on its thread: receiver, poll's return to the plane"]["p50"] > 0
    # Most, not all: a send may find the peer's thread still winding up the last one (2 cores).
    assert steps["sends out on the caller's thread (%, not us)"]["p50"] > 50

"""The control host's prefill side: ``ControlSender`` speaks the protocol of ``control`` to each
decode node over ``connections`` DEALER sockets, a thread each (``_Peer``), which run its jobs in
order: handshakes and sends, whose blocks the agreed plane moves. Lease renewals do not wait their
turn: the thread sends them between its jobs and while it waits for a reply (``_Peer.renewals``)."""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
import zmq

from pdserve.kv_transfer.base import (
    KVHandshakeRefused,
    KVLayout,
    KVRefused,
    KVSender,
    KVSendFuture,
    KVTransferError,
    Staged,
    call_at,
    copy_to_cpu,
)
from pdserve.kv_transfer.control import HANDSHAKE_RESEND_S, MAX_MESSAGE_BYTES
from pdserve.kv_transfer.lane import SenderLane
from pdserve.kv_transfer.messages import (
    REPLIES,
    KVAck,
    KVCommit,
    KVHandshake,
    KVHandshakeReply,
    KVLane,
    KVLaneReply,
    KVRenew,
    KVSetup,
    KVSetupReply,
)
from pdserve.kv_transfer.plane import ControlLink, SenderPlane, SenderSession
from pdserve.messages import NodeInfo, decode, decoder, encode
from pdserve.utils import precise_sleeps

logger = logging.getLogger(__name__)

_decode_reply = decoder(REPLIES)  # held: a send's ack is decoded on its path

LANE_CONNECT_S = 2.0
"""How long a sender tries to open a lane before it keeps the session on the control connection."""
REFUSED_DRAIN_S = 1.0
"""After a refused commit, how long the sender waits for its data to finish leaving before it
takes the connection for broken (the peer drains data before it answers the commit)."""
RENEW_CHECK_S = 0.05
"""While a peer's thread waits for a reply, it looks this often for lease renewals to send."""
RENEW_TIMEOUT_S = 5.0
"""How long a lease renewal may take to go out (counted from when it is sent, not queued)."""
MAX_RENEWALS = 256
"""Renewals kept for a peer that cannot be reached yet; older ones (stale by then) are dropped."""


class _Expired(KVTransferError):
    """A job whose deadline passed before its turn: it fails without touching the connection."""


@dataclass
class _Job:
    info: NodeInfo
    request_id: str  # or "" for a handshake or a renewal's wake-up
    staged: Staged | None  # None for a bare handshake, a renewal or a send sent already (``delivered``)
    dst_block_ids: list[int]
    commit: KVCommit | None  # None: more blocks follow later
    timeout: float
    future: Future  # a send's: a KVSendFuture, whose ``released`` the peer's thread resolves
    renew: bool = False  # wakes the thread to send the renewals queued (``_Peer.renewals``)
    queued_at: float = field(default_factory=time.monotonic)
    delivered: bool = False  # sent on the caller's thread (``_Peer.post``): the peer's waits for the ack
    finish: Callable[[float], None] | None = None  # what ``deliver`` returned there
    error: BaseException | None = None  # what ``deliver`` raised there

    def deadline(self, started: float) -> float:
        """When the job is done or failed. A send or handshake counts its timeout from when it was
        queued: jobs queued behind others for a peer that died all fail by then, rather than each
        waiting out its whole timeout in turn (which kept a dead decode node's pinned blocks for N x
        the timeout). A lease renewal counts from its start: late is better than never."""
        return (started if self.renew else self.queued_at) + self.timeout


class _Peer(ControlLink):
    """One decode node: a DEALER socket owned by one thread that runs jobs in order."""

    FAILED_MEMORY = 4096
    """Request ids whose KV failed part-way, remembered so that their commit is refused here."""

    def __init__(self, sender: ControlSender, address: str) -> None:
        self.sender = sender
        self.address = address
        self.jobs: queue.Queue[_Job | None] = queue.Queue()
        self.sock = None
        self.lane: SenderLane | None = None  # the session's lane, where the receiver offered one
        self.peer_info: NodeInfo | None = None
        self.transport = ""  # agreed at set-up; "" before
        self.session: SenderSession | None = None  # the chosen plane's connection
        self.refused = ""  # permanent handshake refusal
        self.failed: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._waiting_for = ""
        self.renewals: collections.deque[KVRenew] = collections.deque(maxlen=MAX_RENEWALS)
        """Lease renewals to send, appended by any thread (``ControlSender.renew``): the peer's thread
        sends them as soon as it is connected and not inside a message, between its jobs and
        while it waits for a reply, so that they never wait behind other jobs (sends queued behind
        acks held them for seconds: a slow prefill node's leases ran out while it still renewed
        them)."""
        self._turn = threading.Lock()
        """Held by whoever uses the connection: the peer's thread while it runs a job, or a caller's
        thread sending a send's data at once (``post``)."""
        self._posting = False  # a caller's thread is sending: lane writes must not wait
        self._quiet: Future[None] = Future()
        """Resolves once no data of the sends taken so far can move any more (a closed session may
        still be read from for a while: ``SenderSession.close``); sends are released behind it."""
        self._quiet.set_result(None)
        self.thread = threading.Thread(target=self._run, name=f"kv-sender {address}", daemon=True)
        self.thread.start()

    def _connect(self) -> None:
        self._close_socket()
        sock = self.sender._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 64)
        sock.connect(self.address)
        self.sock = sock

    def _close_socket(self) -> None:
        """Forget the connection and its data-plane session: the next job starts afresh. The
        socket goes first (ZeroMQ drops what it had not sent), then the session, which may wait
        for ZeroMQ to let go of frames that point into the cache, or say until when its peer may
        still read (``SenderSession.close``): the sends taken so far are released after that."""
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
        if self.lane is not None:
            self.lane.close()
            self.lane = None
        if self.session is not None:
            try:
                quiet_at = self.session.close()
            except Exception:
                logger.exception("closing the %s session to %s failed", self.transport, self.address)
                quiet_at = 0.0
            self.session = None
            if quiet_at > time.monotonic():  # quiet once the earlier sessions are and that time passed
                quiet: Future[None] = Future()
                self._quiet.add_done_callback(lambda _: call_at(quiet_at, lambda: quiet.set_result(None)))
                self._quiet = quiet
        self.peer_info = None
        self.transport = ""

    def post(
        self,
        info: NodeInfo,
        request_id: str,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        commit: KVCommit,
        timeout: float,
    ) -> _Job | None:
        """Send the last part of a send, whose blocks wait for nothing, at once on the caller's
        thread when its session can (``SenderSession.post``: nixl, one READ) and the peer's thread
        has nothing to do, without waiting for the peer (``SenderLane.post``); that thread then
        only waits for the ack: the send's job, queued for it (None where the send cannot go now:
        the caller stages and queues it). The hand-off to that thread and its wake-up are then off
        the path to the decode node: on one H200 the hand-off and the peer thread's part were ~50
        us of a one-block send's ~230. Nothing is made before the message is out but what it
        needs (no ``Staged``, job or future: those come after): on an H200 host the caller's thread
        CPU from ``send`` to the message's ``sendmsg`` went from 21-23 to 11-13 us back to back,
        and from 53-57 to 31-34 us after 2 ms idle (caches gone cold, as between sends)."""
        if self.lane is None or not self._turn.acquire(blocking=False):
            return None
        try:
            session = self.session
            # No job queued, nor taken and not done (the peer's thread marks each done while it
            # holds the turn): nothing of the connection goes out ahead of this one's order.
            if (
                self.jobs.unfinished_tasks
                or self.refused
                or self.sock is None
                or self.peer_info is None
                or session is None
                or request_id in self.failed
            ):
                return None
            started = time.monotonic()
            # The message is encoded before this returns: the caller's lists serve as they are.
            src = src_block_ids if type(src_block_ids) is list else list(src_block_ids)
            dst = dst_block_ids if type(dst_block_ids) is list else list(dst_block_ids)
            error = None
            self._posting = True
            try:
                finish = session.post(request_id, src, dst, started + timeout, commit)
                if finish is None:
                    return None
            except Exception as e:  # the peer's thread fails the job, as if it had raised there
                finish, error = None, e
            finally:
                self._posting = False
            job = _Job(info, request_id, None, dst, commit, timeout, KVSendFuture(), queued_at=started)
            job.delivered, job.finish, job.error = True, finish, error
        finally:
            self._turn.release()
        self.jobs.put(job)
        return job

    def _run(self) -> None:
        precise_sleeps()  # the planes' waits on this thread (an NCCL op's spin) sleep as asked
        while True:
            job = self.jobs.get()
            with self._turn:
                try:
                    if job is None:
                        self._close_socket()
                        return
                    self._run_job(job)
                finally:
                    self.jobs.task_done()

    def _run_job(self, job: _Job) -> None:
        try:
            started = time.monotonic()
            deadline = job.deadline(started)
            if started >= deadline and not job.delivered:  # waited out its time behind earlier jobs
                raise _Expired(f"KV job for {self.address} timed out in the queue behind earlier ones")
            result = self._do(job, deadline)
        except Exception as e:
            # The request is never committed from here on.
            if job.request_id:
                self.failed[job.request_id] = None
                while len(self.failed) > self.FAILED_MEMORY:
                    self.failed.popitem(last=False)
            # The send fails now, at its deadline; its blocks are released below, once nothing
            # can read them any more.
            job.future.set_exception(e if isinstance(e, KVTransferError) else KVTransferError(str(e)))
            # A refusal leaves the connection as it was (a new NCCL communicator costs a second
            # on GPUs); a timeout or broken peer leaves it in an unknown state: start afresh.
            if not isinstance(e, (KVRefused, _Expired)):
                self._close_socket()
        else:
            job.future.set_result(result)
        if isinstance(job.future, KVSendFuture):  # at once, unless a closed session may still be read
            released = job.future.released
            self._quiet.add_done_callback(lambda _, released=released: released.set_result(None))

    def recv(self, deadline: float, kind, resend: list | None = None, idle: Callable[[], None] | None = None):
        """The next reply of type ``kind`` (for KVAck: of the request awaited); others go to the
        session (``SenderSession.received``), which skips what it does not wait for. ``resend``
        goes out again every HANDSHAKE_RESEND_S without an answer; ``idle`` (a data plane's
        progress call) runs every millisecond without one. Replies come on the lane once there is
        one (the receiver answers there), else on the control connection."""
        while True:
            if self.renewals and self.peer_info is not None:
                self._renew_now()
            left = deadline - time.monotonic()
            if left <= 0:
                raise KVTransferError(f"no reply from KV peer {self.address} in time")
            wait = min(left, HANDSHAKE_RESEND_S) if resend else min(left, RENEW_CHECK_S)
            if self.lane is not None:
                body = self.lane.recv(0.001 if idle is not None else wait)
            elif self.sock.poll(1 if idle is not None else int(wait * 1000) + 1):
                body = self.sock.recv()
            else:
                body = None
            if body is None:
                if idle is not None:
                    idle()
                if resend and time.monotonic() < deadline:
                    self.send(resend, deadline)
                continue
            msg = _decode_reply(body)
            if isinstance(msg, kind) and (not isinstance(msg, KVAck) or msg.request_id == self._waiting_for):
                return msg
            if self.session is not None:  # a data plane's report (nixl: a READ over) while waiting
                self.session.received(msg)

    @property
    def streams(self) -> bool:
        return self.lane is not None

    def send(self, frames: list, deadline: float) -> None:
        if self.lane is not None:
            if self._posting:
                assert len(frames) == 1, "a message with a payload is never posted"
                self.lane.post(frames[0])
            else:  # a payload follows its header as raw bytes (``kv_transfer.lane``)
                self.lane.send(frames[0], deadline, [memoryview(f) for f in frames[1:]])
            return
        while True:
            try:
                self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                if time.monotonic() > deadline:
                    raise KVTransferError(f"KV peer {self.address} is not accepting data") from None
                time.sleep(0.001)

    def _open(self, info: NodeInfo, deadline: float) -> None:
        """Handshake, then agree on a transport and connect its data plane."""
        hello = [encode(KVHandshake(info=info, cluster_token=self.sender.cluster_token))]
        self.send(hello, deadline)
        reply = self.recv(deadline, KVHandshakeReply, resend=hello)
        if not reply.ok:
            self.refused = f"KV peer {self.address} refused the handshake: {reply.error}"
            raise KVHandshakeRefused(self.refused)
        offers = [o for o in (plane.offer() for plane in self.sender.planes.values()) if o is not None]
        setup = KVSetup(session=uuid.uuid4().hex, transports=list(self.sender.transports), offers=offers)
        self.send([encode(setup)], deadline)
        chosen = self.recv(deadline, KVSetupReply)
        if not chosen.ok:
            why = f"KV peer {self.address} refused the transport set-up: {chosen.error}"
            if not chosen.final:  # this connection only: the job fails, the next one reconnects
                raise KVTransferError(why)
            self.refused = why
            raise KVHandshakeRefused(why)
        plane = self.sender.planes.get(chosen.transport)
        if plane is None:
            raise KVTransferError(f"KV peer {self.address} chose {chosen.transport!r}, which was not offered")
        if chosen.lane_port:
            self._open_lane(chosen, deadline)
        self.session = plane.connect(self, setup, chosen, deadline)
        self.transport = chosen.transport
        self.peer_info = reply.info

    def _open_lane(self, chosen: KVSetupReply, deadline: float) -> None:
        """Open the session's lane and present the set-up's token. A lane port that cannot be
        reached (a firewall) keeps the session on the control connection, with a warning; a lane
        refused or broken while it opens fails the job (the next one starts afresh)."""
        host = self.address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
        largest = MAX_MESSAGE_BYTES + (1 << 20)
        # A peer on this host (in this network namespace) is reached through its Unix socket.
        lane = SenderLane.connect_local(chosen.lane_path, largest) if chosen.lane_path else None
        if lane is None:
            try:
                until = min(deadline, time.monotonic() + LANE_CONNECT_S)
                lane = SenderLane.connect(host, chosen.lane_port, until, largest)
            except KVTransferError as e:
                logger.warning("%s; the KV session to %s stays on its control connection", e, self.address)
                return
        try:
            lane.send(encode(KVLane(token=chosen.lane_token)), deadline)
            body = lane.recv(max(deadline - time.monotonic(), 0.0))
            if body is None:
                raise KVTransferError(f"KV peer {self.address} did not answer on the lane in time")
            answer = decode(body, KVLaneReply)
        except BaseException:
            lane.close()
            raise
        if not answer.ok:
            lane.close()
            raise KVTransferError(f"KV peer {self.address} refused the lane: {answer.error}")
        self.lane = lane

    def _do(self, job: _Job, deadline: float):
        if job.delivered:  # sent by the caller's thread (``post``): wait for the ack
            if job.error is not None:
                raise job.error
            return self._conclude(job, deadline, job.finish, inline=True)
        if self.refused:
            self.renewals.clear()  # nothing will take them
            raise KVHandshakeRefused(self.refused)
        self._waiting_for = ""
        if self.sock is None:
            self._connect()
        if self.peer_info is None:
            self._open(job.info, deadline)
        if self.renewals:
            self._renew_now()
        if job.renew:
            return None
        staged = job.staged
        if staged is None:
            return self.peer_info
        rid = job.request_id
        if rid in self.failed:
            raise KVTransferError(f"an earlier part of request {rid}'s KV failed; it cannot be committed")
        finish = None  # waits for data still leaving (planes whose peer queues the commit behind it)
        # The commit rides inside the last data message where the plane carries it.
        inline = job.commit is not None and bool(job.dst_block_ids) and self.session.carries_commit
        if job.dst_block_ids:
            if inline:
                finish = self.session.deliver(rid, staged, job.dst_block_ids, deadline, job.commit)
            else:
                finish = self.session.deliver(rid, staged, job.dst_block_ids, deadline)
        if job.commit is None:
            if finish is not None:
                finish(deadline)
            return None
        return self._conclude(job, deadline, finish, inline)

    def _renew_now(self) -> None:
        """Send the lease renewals queued so far (the connection is open, between messages)."""
        while self.renewals:
            self.send([encode(self.renewals.popleft())], time.monotonic() + RENEW_TIMEOUT_S)

    def _conclude(self, job: _Job, deadline: float, finish, inline: bool) -> KVAck:
        """The commit (unless it went inside the data) and its ack; then the data's end."""
        rid = job.request_id
        self._waiting_for = rid
        if not inline:
            self.send([encode(job.commit)], deadline)
        ack = self.recv(deadline, KVAck, idle=self.session.progress if self.session else None)
        if self.session is not None:
            self.session.acked()
        if ack.lost:  # the peer lost this connection's handshake: the next job reconnects
            raise KVTransferError(f"KV peer {self.address} lost the connection's handshake ({rid} not sent)")
        if not ack.ok:
            # The peer took the data before it answered, so it has left here or is about to; if
            # it is stuck (the peer broke its side), this raises and the session is closed.
            if finish is not None:
                finish(min(deadline, time.monotonic() + REFUSED_DRAIN_S))
            raise KVRefused(f"KV peer {self.address} refused request {rid}: {ack.error}")
        if finish is not None:
            finish(deadline)
        return ack


class ControlSender(KVSender):
    """Prefill side: the control protocol to each peer; the blocks move on ``planes``, which also
    give the order of preference offered at set-up."""

    ROUTED_MEMORY = 65536

    def __init__(self, planes: Sequence[SenderPlane], cluster_token: str = "", connections: int = 1) -> None:
        assert planes, "a sender needs at least one plane"
        if connections < 1:
            raise ValueError(f"connections must be >= 1, got {connections}")
        self.cluster_token = cluster_token
        self.connections = connections
        self.planes = {p.name: p for p in planes}
        self.transports = tuple(self.planes)
        self.name = self.transports[0]
        self.kv: torch.Tensor | None = None
        self._ctx = zmq.Context.instance()
        self._peers: dict[str, _Peer] = {}
        """Each peer's first connection: handshakes, lease renewals, and every send until a plane that
        lets sessions run side by side is agreed on it."""
        self._more: dict[str, list[_Peer]] = {}  # each peer's other connections (``_open_lanes``)
        self._routed: collections.OrderedDict[str, _Peer] = collections.OrderedDict()
        """Requests sent in parts, until their commit: the connection their first part took (the
        choice of connection changes once the first one agrees on a plane)."""
        self._lock = threading.Lock()
        self.bytes_sent = 0

    def register_kv_cache(self, kv_cache: torch.Tensor) -> None:
        KVLayout.of(kv_cache)  # [L, NB, 2, BS, Hkv, D], one region (ValueError otherwise)
        self.kv = kv_cache
        self._cuda = kv_cache.is_cuda
        # What a block counts for in ``bytes_sent``: its bytes, or what a plane says it stands for.
        self._bytes_per_block = max(plane.block_bytes(kv_cache) for plane in self.planes.values())
        for plane in self.planes.values():
            plane.register(kv_cache)

    def _peer(self, address: str, request_id: str = "") -> _Peer:
        """The connection to ``address`` that carries ``request_id``'s sends (the first one for
        anything else)."""
        with self._lock:
            return self._peer_locked(address, request_id)

    def _peer_locked(self, address: str, request_id: str) -> _Peer:
        """``_peer``, with ``_lock`` held."""
        first = self._peers.get(address)
        if first is None:
            first = self._peers[address] = _Peer(self, address)
        plane = self.planes.get(first.transport)
        if not request_id or self.connections == 1 or plane is None or not plane.concurrent_sessions:
            return first
        lane = zlib.crc32(request_id.encode()) % self.connections
        if lane == 0:
            return first
        more = self._more.setdefault(address, [])
        while len(more) < lane:
            more.append(_Peer(self, address))
        return more[lane - 1]

    def renew(self, address: str, info: NodeInfo, request_ids: Sequence[str]) -> None:
        peer = self._peer(address)
        peer.renewals.append(KVRenew(list(request_ids)))
        peer.jobs.put(_Job(info, "", None, [], None, RENEW_TIMEOUT_S, Future(), renew=True))

    def handshake(self, address: str, info: NodeInfo, timeout: float) -> NodeInfo:
        fut: Future = Future()
        self._peer(address).jobs.put(_Job(info, "", None, [], None, timeout, fut))
        reply = fut.result()
        self._open_lanes(address, info, timeout)
        return reply

    def _open_lanes(self, address: str, info: NodeInfo, timeout: float) -> None:
        """Open the peer's other connections now, each its handshake and set-up in its own thread,
        rather than at the first send a request's id hashes to one: that send paid them (P/D on one
        H200 at 512 tokens: TTFT p90 64 ms against a p50 of 25, the first request on each new
        connection). Where the agreed plane takes one session per pair, there are none."""
        with self._lock:
            first = self._peers.get(address)
            plane = self.planes.get(first.transport) if first is not None else None
            if self.connections == 1 or plane is None or not plane.concurrent_sessions:
                return
            more = self._more.setdefault(address, [])
            opened = []
            while len(more) < self.connections - 1:
                more.append(_Peer(self, address))
                opened.append(more[-1])
        for peer in opened:  # a lane that fails here starts afresh at its first send
            peer.jobs.put(_Job(info, "", None, [], None, timeout, Future()))

    def send(
        self,
        address: str,
        info: NodeInfo,
        request_id: str,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        commit: KVCommit | None,
        timeout: float,
        layer_events: Sequence | None = None,
        written: bool = False,
    ) -> KVSendFuture:
        assert self.kv is not None, "register_kv_cache first"
        if len(src_block_ids) != len(dst_block_ids):
            raise KVTransferError(f"{len(src_block_ids)} source blocks for {len(dst_block_ids)} destinations")
        with self._lock:  # a request's later parts follow its first over the same connection
            peer = self._routed.pop(request_id, None) if commit is not None else self._routed.get(request_id)
            if peer is None:
                peer = self._peer_locked(address, request_id)
                if commit is None:
                    self._routed[request_id] = peer
                    while len(self._routed) > self.ROUTED_MEMORY:  # requests dropped before their commit
                        self._routed.popitem(last=False)
        if commit is not None and dst_block_ids and (written or not self._cuda):
            # Nothing to wait for (written, or nothing on the CPU to wait for): out now if it can.
            job = peer.post(info, request_id, src_block_ids, dst_block_ids, commit, timeout)
            if job is not None:
                self.bytes_sent += len(src_block_ids) * self._bytes_per_block
                return job.future
        plane = self.planes.get(peer.transport)  # read once: the peer thread may change it
        if plane is not None:
            staged = plane.stage(self.kv, src_block_ids, dst_block_ids, layer_events, written)
        else:  # not agreed yet: on the CPU, the only copy
            staged = copy_to_cpu(self.kv, src_block_ids)
        self.bytes_sent += len(src_block_ids) * self._bytes_per_block
        job = _Job(info, request_id, staged, list(dst_block_ids), commit, timeout, KVSendFuture())
        peer.jobs.put(job)
        return job.future

    def close(self) -> None:
        with self._lock:
            peers = [*self._peers.values(), *(p for more in self._more.values() for p in more)]
            self._peers, self._more = {}, {}
        for peer in peers:
            peer.jobs.put(None)
        for peer in peers:
            peer.thread.join(timeout=5)

"""The control host's decode side: ``ControlReceiver`` serves the protocol of ``control`` on a
ROUTER socket and the session lanes, on one thread, and hands data messages to the planes."""

from __future__ import annotations

import hmac
import itertools
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
import torch
import zmq
from zmq.utils.monitor import parse_monitor_message

from pdserve.kv_transfer.base import KVLayout, KVReceiver, KVTransferError, ReservationTable, check_compatible
from pdserve.kv_transfer.control import MAX_MESSAGE_BYTES
from pdserve.kv_transfer.lane import TOKEN_BYTES, LaneClosed, ReceiverLane, Sink, open_local_listener
from pdserve.kv_transfer.messages import (
    REQUESTS,
    KVAck,
    KVCommit,
    KVHandshake,
    KVHandshakeReply,
    KVLane,
    KVLaneReply,
    KVMessage,
    KVRenew,
    KVSetup,
    KVSetupReply,
)
from pdserve.kv_transfer.plane import Landing, Outbox, ReceiverPlane
from pdserve.messages import NodeInfo, decode, decoder, encode
from pdserve.utils import YIELD_S, precise_sleeps

logger = logging.getLogger(__name__)

_decode_request = decoder(REQUESTS)  # held: a send's data message is decoded on its path

RECEIVE_HWM = 16
"""Messages a receiver queues per connection before TCP pushes back: bounds what one peer, even
one that never passes the handshake, can make the node hold (RECEIVE_HWM * the largest message)."""
MESSAGES_PER_TURN = 16
"""Messages the receiver's control thread takes in a row before it polls its planes again."""
LANE_TOKEN_S = 5.0
"""A lane that has not presented a token this long after it was accepted is closed."""
MAX_PAYLOAD_BYTES = 1 << 40
"""No payload on a lane is longer (a header saying more is taken for garbage: the lane closes)."""
STREAM_CHECK_MS = 2
"""While a payload streams in on a lane, the control thread turns at least this often (ms) to see
whether its reservation is gone: the engine thread's ``release`` waits for the payload's pin."""
MAX_PENDING_LANES = 64
"""Lanes accepted and not yet bound by a token, at most (the oldest is closed first): bounds what
connections to the lane port that never present a token can make the node hold."""

# The control thread waits in one epoll on the lanes, the lane listeners and the ZeroMQ sockets'
# file descriptors (``_wait``). A lane's message wakes it straight out of epoll_wait, where
# ``zmq.Poller`` also asked each ZeroMQ socket for its events and built Python lists on every wake
# (a message on a socket pair seen 1.7-1.9 us sooner at p10 / p50 on the 2-core box). A ZeroMQ
# socket's descriptor only signals that its state may have changed: what waits on it is read from
# its EVENTS, asked for both sockets last before each wait and after a wake where one signalled.
_IN, _OUT = select.EPOLLIN, select.EPOLLOUT
_READABLE = select.EPOLLIN | select.EPOLLERR | select.EPOLLHUP
# zmq's flag as a plain int: an operation on pyzmq's IntFlag members builds a new member in Python.
_ZMQ_IN = int(zmq.POLLIN)

_instances = itertools.count()


def tokens_match(given: str, expected: str) -> bool:
    """The cluster token check, in constant time; any token passes when none is configured."""
    return not expected or hmac.compare_digest(given.encode(), expected.encode())


class WarnLimiter:
    """Refusals log a warning each, but a flood of them at most ``burst`` per ``window_s`` (then
    one line with how many were left out), so a hostile peer cannot fill the disk with logs."""

    def __init__(self, burst: int = 20, window_s: float = 10.0) -> None:
        self.burst = burst
        self.window_s = window_s
        self._start = 0.0
        self._count = 0
        self._lock = threading.Lock()

    def warning(self, fmt: str, *args, exc_info: bool = False) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._start > self.window_s:
                if self._count > self.burst:
                    logger.warning("%d more KV refusals not logged", self._count - self.burst)
                self._start, self._count = now, 0
            self._count += 1
            if self._count > self.burst:
                return
        logger.warning(fmt, *args, exc_info=exc_info)


def _short(request_id: str) -> str:
    return repr(request_id if len(request_id) <= 64 else request_id[:64] + "...")


@dataclass
class _Conn:
    """A sender connection that passed the handshake: state of that TCP connection (``fd``), so
    a ROUTER routing id reused by a later connection inherits nothing."""

    fd: int
    transport: str = ""  # agreed at set-up; "" before
    lane: ReceiverLane | None = None  # the session's lane, once its sender opened it
    lane_token: bytes = b""  # the token its last set-up handed out, until a lane presents it


class _Dropped(Landing):
    """A payload read off its lane and dropped: taking it failed here."""

    def __init__(self, nbytes: int, error: str) -> None:
        self.nbytes, self.views, self.error = nbytes, [], error

    def live(self) -> bool:
        return True

    def end(self, error: str) -> str:
        return self.error


class _Outbox(Outbox):
    """Lets data planes reply on the control connection: the receiver's control thread alone owns
    the ROUTER socket and sends what it is given here; other threads' replies reach it through an
    inproc socket it forwards from."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self._sock = ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        self._lock = threading.Lock()
        self._send: Callable[[bytes, bytes], None] | None = None
        self._owner = 0

    def own(self, send: Callable[[bytes, bytes], None]) -> None:
        """Called by the control thread: its own replies go straight out through ``send`` (the
        peer's lane, or the ROUTER socket)."""
        self._send, self._owner = send, threading.get_ident()

    def put(self, peer: bytes, msg: KVMessage) -> None:
        if self._send is not None and threading.get_ident() == self._owner:
            self._send(peer, encode(msg))
            return
        with self._lock:
            self._sock.send_multipart([peer, encode(msg)])

    def close(self) -> None:
        with self._lock:
            self._send = None
            self._sock.close(linger=0)


class ControlReceiver(KVReceiver):
    """Decode side: serves the control protocol; the blocks move on ``planes``, which also list
    the transports this node accepts, preferred first."""

    def __init__(
        self,
        planes: Sequence[ReceiverPlane],
        host: str = "127.0.0.1",
        port: int = 0,
        cluster_token: str = "",
        lane_port: int = 0,
    ) -> None:
        assert planes, "a receiver needs at least one plane"
        self.host = host
        self.port = port
        self.lane_port = lane_port
        """Where lanes are taken on ``host`` (``kv_transfer.lane``); 0: a free port."""
        self.cluster_token = cluster_token
        self.planes = {p.name: p for p in planes}
        self.transports = tuple(self.planes)
        self.name = self.transports[0]
        self.kv: torch.Tensor | None = None
        self._ctx = zmq.Context.instance()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._conns: dict[bytes, _Conn] = {}  # routing id -> connection that passed the handshake
        self._lanes: dict[int, ReceiverLane] = {}  # fd -> lane (bound to a connection, or not yet)
        self._tokens: dict[bytes, bytes] = {}  # lane token handed out -> routing id it binds to
        self._epoll: select.epoll | None = None  # the control thread's one wait (``_wait``)
        self._zmq_fds = (-1, -1)  # the ROUTER's and the outbox PULL's descriptors, in that epoll
        self._lane_port = 0
        self._lane_path = ""  # the abstract Unix socket name lanes from this host take ("" off Linux)
        self._lane_sweep_at = 0.0
        self._broken_lanes: list[tuple[ReceiverLane, str]] = []  # write failed: closed next turn
        self._streams: dict[ReceiverLane, tuple[Sink, Landing]] = {}  # payloads coming in on lanes
        self._warn = WarnLimiter()
        self.num_refused = 0  # messages refused (tests and logs)

    @property
    def bytes_received(self) -> int:
        return sum(p.bytes_received for p in self.planes.values())

    def register_kv_cache(self, kv_cache: torch.Tensor) -> None:
        KVLayout.of(kv_cache)  # [L, NB, 2, BS, Hkv, D], one region (ValueError otherwise)
        self.kv = kv_cache

    def start(self, info: NodeInfo, table: ReservationTable, on_commit: Callable[[KVCommit], None]) -> str:
        assert self.kv is not None, "register_kv_cache first"
        # The lane port first: a taken one fails the start before the control port is bound (ZeroMQ
        # lets a bound port go only after its socket's close, later, on its I/O thread).
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        try:
            lanes = socket.create_server(
                (self.host, self.lane_port), family=family, backlog=MAX_PENDING_LANES
            )
        except OSError as e:
            raise KVTransferError(f"cannot take KV lanes on {self.host}:{self.lane_port}: {e}") from None
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        largest = max(MAX_MESSAGE_BYTES, *(p.max_message_bytes for p in self.planes.values()))
        sock.setsockopt(zmq.MAXMSGSIZE, largest + (1 << 20))
        sock.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        try:
            if self.port:
                sock.bind(f"tcp://{self.host}:{self.port}")
                port = self.port
            else:
                port = sock.bind_to_random_port(f"tcp://{self.host}")
        except zmq.ZMQError:
            sock.close(linger=0)
            lanes.close()
            raise
        address = f"tcp://{self.host}:{port}"
        listeners = [lanes]
        self._lane_port = lanes.getsockname()[1]
        local = open_local_listener(MAX_PENDING_LANES)
        if local is not None:
            listeners.append(local)
            self._lane_path = local.getsockname().decode()[1:]  # its abstract name, without the NUL
        for listener in listeners:
            listener.setblocking(False)
        pull = self._ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        outbox_address = f"inproc://pdserve-kv-outbox-{next(_instances)}"
        pull.bind(outbox_address)
        self._outbox = _Outbox(self._ctx, outbox_address)
        for plane in self.planes.values():
            plane.start(self.kv, table, self._outbox, on_commit, self.host)
        self._thread = threading.Thread(
            target=self._serve,
            args=(sock, pull, listeners, info, table, on_commit),
            name="kv-receiver",
            daemon=True,
        )
        self._thread.start()
        return address

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for plane in self.planes.values():
            plane.close()

    # -- receiver thread -----------------------------------------------------------------------

    def _serve(self, sock, pull, listeners, info: NodeInfo, table: ReservationTable, on_commit) -> None:
        # Connections accepted and closed: per-connection state must not outlive its connection.
        monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        precise_sleeps()  # its turns while READs run sleep YIELD_S, not the timer slack's 50 us
        self._router = sock
        self._outbox.own(self._send_to)
        if self.kv.is_cuda:  # planes work on the cache from this thread (NIXL asks about pointers)
            torch.cuda.set_device(self.kv.device)
        self._epoll = select.epoll()
        self._zmq_fds = (sock.FD, pull.FD)  # (pyzmq asks the socket each time ``FD`` is read)
        for fd in (*self._zmq_fds, *(listener.fileno() for listener in listeners)):
            self._epoll.register(fd, _IN)
        try:
            while not self._stop.is_set():
                try:
                    self._serve_once(sock, pull, listeners, monitor, info, table, on_commit)
                except zmq.ContextTerminated:
                    return
                except Exception:  # nothing a peer sends may stop this thread
                    logger.exception("KV receiver: unexpected error (still serving)")
        finally:
            self._outbox.close()
            for lane in list(self._lanes.values()):
                lane.close()
            self._lanes.clear()
            for listener in listeners:
                listener.close()
            sock.disable_monitor()
            monitor.close(linger=0)
            pull.close(linger=0)
            sock.close(linger=0)
            self._epoll.close()

    def _wait(self, timeout_s: float) -> list[tuple[int, int]]:
        """The control thread's one wait: (fd, epoll flags) of what is ready, after at most
        ``timeout_s``."""
        return self._epoll.poll(timeout_s)

    def _serve_once(self, sock, pull, listeners, monitor, info, table, on_commit) -> None:
        while self._broken_lanes:
            lane, why = self._broken_lanes.pop()
            if lane.fd in self._lanes and self._lanes[lane.fd] is lane:
                self._close_lane(lane, why)
        busy = False
        for plane in self.planes.values():
            busy |= plane.poll()
        if busy:
            # Turn again soon, but yield the GIL first: a spin on poll(0) alone would take it
            # back before the engine thread gets a turn (measured: 4x slower small Python work).
            time.sleep(YIELD_S)
        if self._streams:  # a payload coming in whose reservation went: stop writing, unpin now
            for sink, landing in list(self._streams.values()):
                if not sink.dropping and not landing.live():
                    sink.drop("the reservation was released while its KV came in")
                    landing.end("the reservation was released while its KV came in")
        # Last before the wait, after the turn's sends and receives: what already waits on the
        # ZeroMQ sockets (their descriptors signal only what comes later).
        router_in = sock.getsockopt(zmq.EVENTS) & _ZMQ_IN
        pull_in = pull.getsockopt(zmq.EVENTS) & _ZMQ_IN
        if busy or router_in or pull_in:
            timeout_s = 0.0
        else:
            timeout_s = STREAM_CHECK_MS / 1000 if self._streams else 0.1
        events = dict(self._wait(timeout_s))
        if self._lanes:  # a send's data first
            self._serve_lanes(events, info, table, on_commit)
        router_fd, pull_fd = self._zmq_fds
        if pull_fd in events:
            pull_in = pull.getsockopt(zmq.EVENTS) & _ZMQ_IN
        if pull_in:
            while True:
                try:
                    peer, body = pull.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._send_to(peer, body)
        for listener in listeners:
            if listener.fileno() in events:
                self._accept_lanes(listener)
        if router_fd in events:
            router_in = sock.getsockopt(zmq.EVENTS) & _ZMQ_IN
        if not router_in:
            return
        # Every message already here before the planes are polled again: a sender's data and the
        # commit right behind it are taken in one turn (nixl then acks once, not a READ's end too).
        for _ in range(MESSAGES_PER_TURN):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            # Then read connection events: a connection's ACCEPTED event (and the DISCONNECTED of
            # the one before it on that fd) is queued before any message of it can arrive, so
            # read after the message, they are all here and a reused routing id is never taken
            # for the connection it replaced. (Read before it, a connection accepted in between
            # lost its state at its late ACCEPTED, right after its handshake.)
            self._drain_monitor(monitor)
            peer = frames[0].bytes
            try:
                reply = self._handle(peer, frames[1:], info, table, on_commit)
            except Exception as e:  # a bad frame must never take the node down
                self._refused("dropping a malformed KV message: %s", e)
                reply = None
            if reply is not None:
                self._send_to(peer, encode(reply))

    def _send_to(self, peer: bytes, body: bytes) -> None:
        """A reply to ``peer``: on its lane where it has one, else on the control connection."""
        conn = self._conns.get(peer)
        lane = conn.lane if conn is not None else None
        if lane is None:
            self._router.send_multipart([peer, body])
            return
        try:
            lane.write(body)
        except LaneClosed as e:
            # Closed at the next turn, not here: this may run inside a plane's own call (a reply it
            # puts in the outbox), which closing the lane would reenter (``plane.drop``).
            self._broken_lanes.append((lane, str(e)))
            return
        if lane.out:  # the rest goes once the socket takes it
            self._epoll.modify(lane.fd, _IN | _OUT)

    # -- lanes (``kv_transfer.lane``) ---------------------------------------------------------------

    def _accept_lanes(self, listener: socket.socket) -> None:
        largest = max(MAX_MESSAGE_BYTES, *(p.max_message_bytes for p in self.planes.values()))
        while True:
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of file descriptors, say: the listener stays
                logger.warning("KV receiver: accepting a lane failed: %s", e)
                return
            lane = ReceiverLane(conn, largest + (1 << 20))
            self._lanes[lane.fd] = lane
            self._epoll.register(lane.fd, _IN)
            pending = [ln for ln in self._lanes.values() if ln.peer is None]
            if len(pending) > MAX_PENDING_LANES:
                self._close_lane(min(pending, key=lambda ln: ln.opened), "too many lanes without a token")

    def _serve_lanes(self, events: dict, info: NodeInfo, table: ReservationTable, on_commit) -> None:
        for fd, flags in events.items():
            lane = self._lanes.get(fd)
            if lane is None:  # a ZeroMQ socket, a listener, or a lane closed while serving another
                continue
            try:
                if flags & _OUT:
                    lane.flush()
                    if not lane.out:
                        self._epoll.modify(lane.fd, _IN)
                if flags & _READABLE:
                    for body in lane.read():
                        self._lane_message(lane, body, info, table, on_commit)
                        if lane.fd not in self._lanes:
                            break
            except LaneClosed as e:
                self._close_lane(lane, str(e))
        now = time.monotonic()
        if now >= self._lane_sweep_at:  # lanes that never presented a token
            self._lane_sweep_at = now + LANE_TOKEN_S / 10
            stale = [ln for ln in self._lanes.values() if ln.peer is None and now - ln.opened > LANE_TOKEN_S]
            for lane in stale:
                self._close_lane(lane, "no token in time")

    def _lane_message(self, lane: ReceiverLane, body: bytearray, info, table, on_commit) -> None:
        if lane.peer is None:  # the first message: the token of the set-up it belongs to
            try:
                token = decode(body, KVLane).token
            except Exception:
                self._refused("closing a KV lane that did not start with its token")
                raise LaneClosed("no token first") from None
            peer = self._tokens.pop(token, None)
            conn = self._conns.get(peer) if peer is not None else None
            if conn is None or not hmac.compare_digest(conn.lane_token, token):
                self._refused("closing a KV lane with an unknown token")
                lane.write(encode(KVLaneReply(ok=False, error="unknown lane token")))
                raise LaneClosed("unknown token")
            conn.lane_token = b""
            if conn.lane is not None:  # a lane already: the new one replaces it
                self._close_lane(conn.lane, "replaced", forget=False)
            conn.lane = lane
            lane.bind(peer)
            self._send_to(peer, encode(KVLaneReply(ok=True)))
            return
        conn = self._conns.get(lane.peer)
        if conn is None or conn.lane is not lane:
            raise LaneClosed("its connection is gone")
        try:
            msg = _decode_request(body)
        except Exception as e:
            self._refused("dropping a malformed KV message on a lane: %s", e)
            return
        if isinstance(msg, (KVHandshake, KVSetup)):  # those belong on the control connection
            self._refused("closing a KV lane that carried a %s", type(msg).__name__)
            raise LaneClosed(f"a {type(msg).__name__} on the lane")
        if msg.payload_frames:  # its payload follows, raw
            self._expect(lane, conn, msg, table, on_commit)
            return
        try:
            reply = self._dispatch(lane.peer, conn, msg, (), table, on_commit)
        except Exception as e:  # a bad message must never take the node down
            reply = self._failed(msg, e, table)
        if reply is not None:
            self._send_to(lane.peer, encode(reply))

    def _expect(self, lane: ReceiverLane, conn: _Conn, msg: KVMessage, table, on_commit) -> None:
        """A data message whose payload follows it on the lane: the plane says where its bytes go
        (``ReceiverPlane.land``); once they all came, the message is answered as on the control
        connection (its refusal, or its commit's ack). A message no plane can take the payload of,
        or whose header does not say its length, closes the lane: the bytes that follow it could
        not be told from the next message."""
        plane = self.planes.get(conn.transport)
        commit = getattr(msg, "commit", None)
        why = ""
        if plane is None or not plane.lane or not isinstance(msg, plane.messages):
            why = f"{type(msg).__name__} with a payload on a lane set up for {conn.transport or 'nothing'}"
        elif commit is not None and commit.request_id != msg.request_id:
            why = f"carries the commit of another request, {_short(commit.request_id)}"
        elif not 0 <= msg.nbytes <= MAX_PAYLOAD_BYTES:
            why = f"a payload of {msg.nbytes} bytes"
        else:
            try:
                landing = plane.land(lane.peer, msg)
            except ValueError as e:  # a header that does not hold up
                why = str(e)
            except Exception as e:  # a fault here, not the peer's: the request fails, the bytes are dropped
                self._warn.warning("KV receiver: handling %s failed", type(msg).__name__, exc_info=True)
                landing = _Dropped(msg.nbytes, f"the decode node failed on it: {type(e).__name__}: {e}")
        if why:
            self._refuse(msg, why, table)
            raise LaneClosed(f"a {type(msg).__name__} whose payload cannot be taken: {why}")

        def done(error: str) -> None:
            self._streams.pop(lane, None)
            error = landing.end(error)
            if lane.closed:  # its connection is gone, and nobody waits for an answer on it
                return
            if error:
                reply = self._refuse(msg, error, table)
            else:
                reply = self._commit(commit, table, on_commit) if commit is not None else None
            if reply is not None:
                self._send_to(lane.peer, encode(reply))

        sink = Sink(landing.nbytes, landing.views, done)
        if landing.error:  # refused (blocks not reserved, say): its bytes are read and dropped
            sink.drop(landing.error)
        self._streams[lane] = (sink, landing)
        lane.expect(sink)

    def _close_lane(self, lane: ReceiverLane, why: str, forget: bool = True) -> None:
        """Close ``lane``; the connection it belongs to goes with it (``forget``): its sender starts
        afresh, as after its control connection closed."""
        if self._lanes.pop(lane.fd, None) is not None:
            self._epoll.unregister(lane.fd)
        lane.close(f"the lane closed inside a payload: {why}")
        peer, lane.peer = lane.peer, None
        conn = self._conns.get(peer) if peer is not None else None
        if conn is not None and conn.lane is lane:
            conn.lane = None
            logger.info("KV lane of a peer closed (%s)", why)
            if forget:
                self._forget(peer)

    def _drain_monitor(self, monitor) -> None:
        while True:
            try:
                raw = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                fd = parse_monitor_message(raw)["value"]  # ACCEPTED / DISCONNECTED: the socket's fd
            except Exception:
                continue
            for peer in [p for p, c in self._conns.items() if c.fd == fd]:
                self._forget(peer)

    def _forget(self, peer: bytes) -> None:
        conn = self._conns.pop(peer, None)
        if conn is None:
            return
        self._tokens.pop(conn.lane_token, None)
        if conn.lane is not None:
            lane, conn.lane = conn.lane, None
            self._close_lane(lane, "its connection is gone")
        plane = self.planes.get(conn.transport)
        if plane is not None:
            plane.drop(peer)

    def _refused(self, fmt: str, *args) -> None:
        self.num_refused += 1
        self._warn.warning(fmt, *args)

    def _refuse(self, msg: KVMessage, why: str, table: ReservationTable) -> KVMessage | None:
        """An authenticated message that cannot be acted on: fail the request it names (only that
        one), log, and answer what its sender waits for."""
        rid = getattr(msg, "request_id", "")
        self._refused("refusing %s for %s: %s", type(msg).__name__, _short(rid), why)
        if isinstance(rid, str) and rid:
            table.fail(rid, why)
        return msg.refused(why)

    def _handle(self, peer: bytes, frames, info: NodeInfo, table: ReservationTable, on_commit):
        if not frames:
            raise ValueError("no frames")
        fd = frames[0].get(zmq.SRCFD)
        conn = self._conns.get(peer)
        if conn is not None and conn.fd != fd:  # the routing id came back on another connection
            self._forget(peer)
            conn = None
        msg = _decode_request(frames[0].buffer)
        if isinstance(msg, KVHandshake):
            self._forget(peer)  # a handshake starts the connection's state afresh
            if len(frames) != 1:
                self._refused("refusing a KV handshake of %d frames", len(frames))
                return KVHandshakeReply(ok=False, error="malformed handshake")
            if not tokens_match(msg.cluster_token, self.cluster_token):
                self._refused("refusing KV peer %s: wrong cluster token", _short(msg.info.node_id))
                return KVHandshakeReply(ok=False, error="wrong cluster token")
            mismatches = check_compatible(info, msg.info)
            if mismatches:
                error = "incompatible peers: " + "; ".join(mismatches)
                logger.error("refusing KV peer %s: %s", msg.info.node_id, error)
                return KVHandshakeReply(ok=False, error=error, info=info)
            self._conns[peer] = _Conn(fd)
            return KVHandshakeReply(ok=True, info=info)
        try:
            return self._dispatch(peer, conn, msg, frames[1:], table, on_commit)
        except Exception as e:
            return self._failed(msg, e, table) if conn is not None else None

    def _failed(self, msg: KVMessage, e: Exception, table: ReservationTable) -> KVMessage | None:
        """A message of a peer past its handshake whose handling raised (a fault here, not the
        peer's): the request it names fails now, and its sender gets the refusal it waits for
        instead of waiting out its timeout with the decode node's lease."""
        self._warn.warning("KV receiver: handling %s failed", type(msg).__name__, exc_info=True)
        return self._refuse(msg, f"the decode node failed on it: {type(e).__name__}: {e}", table)

    def _dispatch(self, peer: bytes, conn: _Conn | None, msg: KVMessage, payload, table, on_commit):
        """A message after the handshake, from the control connection or the lane."""
        if conn is None:
            # Whoever waits for an answer learns that this connection must start afresh (its state
            # is gone: a new connection under an old routing id, or a bug here); not a refusal of
            # the request or the peer.
            self._refused("ignoring %s from a KV peer that did not pass the handshake", type(msg).__name__)
            commit = msg if isinstance(msg, KVCommit) else getattr(msg, "commit", None)
            if isinstance(commit, KVCommit):  # alone, or carried by a send's last data message
                return KVAck(request_id=commit.request_id, ok=False, error="handshake first", lost=True)
            return msg.refused("handshake first") if isinstance(msg, KVSetup) else None
        if len(payload) != msg.payload_frames:
            why = f"{1 + len(payload)} frames where {1 + msg.payload_frames} belong"
            return self._refuse(msg, why, table)
        plane = self.planes.get(conn.transport)
        if plane is not None and isinstance(msg, plane.messages):  # data, the usual message: first
            # A data message may carry its request's commit (the last of a send): taken after its data.
            commit = getattr(msg, "commit", None)
            if commit is not None and commit.request_id != msg.request_id:
                why = f"carries the commit of another request, {_short(commit.request_id)}"
                return self._refuse(msg, why, table)
            error = plane.handle(peer, msg, payload)
            if error:
                return self._refuse(msg, error, table)
            if commit is not None and not plane.handles_commit:
                return self._commit(commit, table, on_commit)
            return None
        if isinstance(msg, KVSetup):
            return self._setup(peer, conn, msg)
        if isinstance(msg, KVRenew):
            table.renew(msg.request_ids)
            return None
        if isinstance(msg, KVCommit):
            if plane is not None and plane.handles_commit:
                plane.handle(peer, msg, ())  # queued behind the data it must follow; acked by the plane
                return None
            return self._commit(msg, table, on_commit)
        why = f"{type(msg).__name__} on a connection set up for {conn.transport or 'nothing'}"
        return self._refuse(msg, why, table)

    @staticmethod
    def _commit(msg: KVCommit, table: ReservationTable, on_commit) -> KVAck:
        error = table.commit(msg.request_id)
        if not error:
            on_commit(msg)
        return KVAck(request_id=msg.request_id, ok=not error, error=error)

    def _setup(self, peer: bytes, conn: _Conn, msg: KVSetup) -> KVSetupReply:
        chosen = next((t for t in msg.transports if t in self.transports), None)
        if chosen is None:
            return KVSetupReply(
                ok=False,
                error=f"no common KV transport: the sender offers {', '.join(msg.transports)}; "
                f"this node accepts {', '.join(self.transports)}",
                final=True,
            )
        previous = self.planes.get(conn.transport)
        conn.transport = ""
        if conn.lane is not None:  # the session set up again: its lane goes, the connection stays
            self._close_lane(conn.lane, "set up again", forget=False)
        self._tokens.pop(conn.lane_token, None)
        conn.lane_token = b""
        if previous is not None:
            previous.drop(peer)
        try:
            reply = self.planes[chosen].setup(peer, msg)
        except Exception as e:
            logger.exception("setting up %s for a KV peer failed", chosen)
            reply = KVSetupReply(ok=False, error=f"{chosen} set-up failed on the decode node: {e}")
        if reply.ok:
            conn.transport = chosen
            if self.planes[chosen].lane:
                conn.lane_token = os.urandom(TOKEN_BYTES)
                self._tokens[conn.lane_token] = peer
                reply = msgspec.structs.replace(
                    reply, lane_port=self._lane_port, lane_path=self._lane_path, lane_token=conn.lane_token
                )
        return reply

"""The session lane: a plain TCP connection beside the control connection that carries a session's
small messages once its plane is set up.

A ZeroMQ message crosses an I/O thread on each side, so a one-block send (one message each way)
woke eight threads: the sender's peer thread, a ZeroMQ I/O thread on each side each way, the
receiver's control thread and the peer thread again for the ack. On an idle VM each wake-up costs
tens of microseconds and the send's fixed cost was most of it. On a lane the kernel wakes the
control thread itself, which reads the lane between its other work (``zmq.Poller`` polls plain
file descriptors beside ZeroMQ sockets), and the peer thread reads the answer off the lane.
Measured on the 2-core CPU box, the same round trip through a queue, a thread and a socket: 97 us
p50 against 239 over ZeroMQ back to back, 309 against 627 after 10 ms idle.

Planes whose messages are small (nixl, nccl) take a lane, and so does zmq into a cache in host
memory (``ReceiverPlane.lane``): its payload frames follow their header on the lane as raw bytes
(``SenderLane.send`` of several frames), which the decode node's control thread reads straight
into the reserved blocks (``ReceiverLane.expect``): one copy out of the kernel, as a plain socket's
``recv_into``, where ZeroMQ's I/O thread read them into its own buffer first and the control thread
copied them again (on the 2-core box three busy threads on two cores: 0.61-0.83 of a raw socket).
The handshake and set-up stay on the
control connection, which stays the session's identity: the set-up reply hands the sender a lane
port and a one-time token (``KVSetupReply.lane``), the sender opens a TCP connection there and
presents the token first (``KVLane`` -> ``KVLaneReply``); from then on every message of the
session goes and comes back on the lane. The lane and the control connection live and die
together: either closing drops the session on the receiver (``ControlReceiver._forget``) and
makes the sender start afresh. The receiver listens for lanes on a TCP port of its KV host (the
node's ``--kv-lane-port``, a free one by default; a taken one fails its start) and, on
Linux, on a Unix socket in the abstract namespace under a random name (``open_local_listener``);
the set-up reply names both, and a sender on the same host (in the same network namespace) finds
the socket and takes it, anyone else the port. A sender that reaches neither (a firewall) logs it
and keeps its messages on the control connection.

Framing: each message is a 4-byte little-endian length, then the message (``encode``). A frame
longer than the receiver's limit, a token that does not match, or anything but ``KVLane`` first
closes the lane. A message with a payload is followed by the payload's bytes, unframed: as many as
its header says (``KVBlocks.nbytes``); a header the receiver cannot trust with that number closes
the lane, and a payload it refuses (blocks not reserved, say) is read and dropped.
"""

from __future__ import annotations

import secrets
import select
import socket
import struct
import sys
import time
from collections.abc import Callable, Iterator, Sequence

from pdserve.kv_transfer.base import KVTransferError

LENGTH = struct.Struct("<I")
READ_BYTES = 1 << 18
"""What one ``recv`` takes off a lane at most."""
DROP_BYTES = 1 << 18
"""The scratch buffer a refused payload is read into and dropped."""
FILL_BYTES = 4 << 20
"""Payload bytes the control thread reads off one lane before it turns again (other lanes, other
peers, and whether the payload's reservation still stands: the engine's ``release`` waits for it)."""
TOKEN_BYTES = 16
FIRST_FRAME_BYTES = 256
"""The longest first frame (``KVLane``) a receiver takes: a lane that has not presented its token
makes the node hold no more than this."""


class LaneClosed(KVTransferError):
    """The lane's other end closed it, broke it, or sent what no lane carries."""


def as_bytes(view: memoryview) -> memoryview:
    """``view`` as one flat run of bytes (a cast only where it is not one already)."""
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def frame(body: bytes | memoryview) -> bytes:
    return LENGTH.pack(len(body)) + bytes(body)


class FrameReader:
    """Cuts a byte stream into frames; raises LaneClosed on a frame longer than ``max_bytes``.

    The lanes of this module read ``_buf`` and ``_pos`` themselves to skip ``next`` when nothing is
    buffered: every Python call on a send's path costs ~1 us on a host whose threads wake cold."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._buf = bytearray()
        self._pos = 0
        self._scratch = memoryview(bytearray(READ_BYTES))

    def feed(self, data: bytes | memoryview) -> None:
        if self._pos:
            if self._pos == len(self._buf):  # every frame taken (the usual case): no shift, no growth
                self._buf[:] = data
                self._pos = 0
                return
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += data

    def fill(self, sock: socket.socket) -> int:
        """Read what ``sock`` has now (up to READ_BYTES) into the frame buffer; how many bytes (0:
        none now). Raises LaneClosed once the other end closed or broke it. Read into a scratch
        buffer kept for the lane, not ``sock.recv(READ_BYTES)``, which allocates 256 KiB for every
        read and shrinks it: a 150-byte frame off a socket pair took 4.2-4.6 us that way, 2.8-3.0
        this way (2-core box), at every message each way."""
        try:
            n = sock.recv_into(self._scratch)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as e:
            raise LaneClosed(f"lane broken: {e}") from None
        if not n:
            raise LaneClosed("the other end closed the lane")
        if self._pos == len(self._buf):  # every frame taken (the usual case): ``feed`` inline
            self._buf[:] = self._scratch[:n]
            self._pos = 0
        else:
            self.feed(self._scratch[:n])
        return n

    def next(self) -> bytearray | None:
        """The next whole frame (a copy, which ``decode`` takes as it takes bytes), or None until
        more bytes come."""
        buf, pos = self._buf, self._pos
        if len(buf) - pos < LENGTH.size:
            return None
        (n,) = LENGTH.unpack_from(buf, pos)
        if n > self.max_bytes:
            raise LaneClosed(f"a lane frame of {n} bytes (at most {self.max_bytes})")
        end = pos + LENGTH.size + n
        if len(buf) < end:
            return None
        self._pos = end
        return buf[pos + LENGTH.size : end]

    def take(self, into: memoryview) -> int:
        """Move buffered bytes that are not a frame yet (a payload's first bytes, read with its
        header) into ``into``; how many."""
        n = min(len(self._buf) - self._pos, len(into))
        into[:n] = self._buf[self._pos : self._pos + n]
        self._pos += n
        return n


class Sink:
    """Where a payload that follows its header on a lane goes: ``nbytes`` into ``views`` in order
    (their lengths sum to it; none: every byte is read and dropped). ``done(error)`` runs once,
    when the last byte came ("") or the lane closed first (why); ``drop(why)`` stops writing into
    the views (what is left is read and dropped) and ``done`` then gets ``why``."""

    def __init__(self, nbytes: int, views: Sequence[memoryview], done: Callable[[str], None]) -> None:
        self.left = nbytes
        self._views = [as_bytes(v) for v in views]
        self._index = 0
        self._offset = 0
        self._done: Callable[[str], None] | None = done
        self.error = ""
        total = sum(len(v) for v in self._views)
        if nbytes < 0:
            raise ValueError(f"a payload of {nbytes} bytes")
        if self._views and total != nbytes:
            raise ValueError(f"views of {total} bytes for a payload of {nbytes}")
        self._scratch: memoryview | None = None if self._views else memoryview(bytearray(DROP_BYTES))

    @property
    def dropping(self) -> bool:
        return self._scratch is not None

    def target(self) -> memoryview:
        """Where the next bytes go (at most ``left`` of them)."""
        if self._scratch is not None:
            return self._scratch[: min(len(self._scratch), self.left)]
        view = self._views[self._index]
        return view[self._offset : self._offset + min(len(view) - self._offset, self.left)]

    def advance(self, n: int) -> bool:
        """``n`` bytes were written into ``target()``; True once the payload is whole."""
        self.left -= n
        if self._scratch is None:
            self._offset += n
            while self._index < len(self._views) and self._offset == len(self._views[self._index]):
                self._index, self._offset = self._index + 1, 0
        if self.left:
            return False
        self._finish(self.error)
        return True

    def drop(self, why: str) -> None:
        if self._scratch is None:
            self._views = []
            self._scratch = memoryview(bytearray(min(DROP_BYTES, max(self.left, 1))))
        self.error = self.error or why

    def fail(self, why: str) -> None:
        """The lane closed before the payload was whole."""
        self._finish(self.error or why)

    def _finish(self, error: str) -> None:
        done, self._done = self._done, None
        if done is not None:
            done(error)


def _write_frame(sock: socket.socket, out: bytearray, body: bytes | memoryview) -> None:
    """Write one frame of ``body`` behind what waits in ``out``; what the non-blocking ``sock`` does
    not take now is left in ``out``. With nothing waiting, the length and the body go out in one
    ``sendmsg``, not copied into ``out`` first (each message of a send, both ways)."""
    if out:
        out += frame(body)
        _write_some(sock, out)
        return
    header = LENGTH.pack(len(body))
    try:
        sent = sock.sendmsg([header, body])
    except (BlockingIOError, InterruptedError):
        sent = 0
    except OSError as e:
        raise LaneClosed(f"lane broken: {e}") from None
    if sent < len(header) + len(body):
        out += (header + bytes(body))[sent:]


def _write_some(sock: socket.socket, out: bytearray) -> None:
    """Write what the non-blocking ``sock`` takes of ``out`` now, and drop that from ``out``."""
    try:
        sent = sock.send(out)
    except (BlockingIOError, InterruptedError):
        sent = 0
    except OSError as e:
        raise LaneClosed(f"lane broken: {e}") from None
    del out[:sent]


def _tuned(sock: socket.socket) -> socket.socket:
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def open_local_listener(backlog: int) -> socket.socket | None:
    """A Unix socket in Linux's abstract namespace under a random name, for lanes from this host;
    None where there is no such namespace. A lane over it skips the TCP stack: a round trip through
    the same threads, 68-71 us here against 81-95 over loopback TCP."""
    if not sys.platform.startswith("linux"):
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(f"\0pdserve-kv-lane-{secrets.token_hex(12)}")
        sock.listen(backlog)
    except OSError:
        sock.close()
        return None
    return sock


class ReceiverLane:
    """The decode node's end of a lane, driven by its control thread: never blocks. Bytes it cannot
    write yet wait in ``out`` (the control thread then polls for POLLOUT) up to ``max_out`` bytes;
    past that the sender is taken for stuck and the lane is closed."""

    def __init__(self, sock: socket.socket, max_bytes: int) -> None:
        self.sock = _tuned(sock)
        self.sock.setblocking(False)
        self.fd = sock.fileno()
        self.reader = FrameReader(FIRST_FRAME_BYTES)  # ``max_bytes`` once bound (``bind``)
        self.max_bytes = max_bytes
        self.max_out = max(max_bytes, 1 << 20)
        self.out = bytearray()
        self.peer: bytes | None = None  # the control connection it belongs to, once its token matched
        self.opened = time.monotonic()
        self.sink: Sink | None = None  # the payload coming in now (``expect``)
        self.closed = False

    def bind(self, peer: bytes) -> None:
        """Its token matched the set-up of ``peer``'s connection: frames up to ``max_bytes`` now."""
        self.peer = peer
        self.reader.max_bytes = self.max_bytes

    def read(self) -> Iterator[bytearray]:
        """The whole frames that arrived, one at a time; between them, a payload announced by the one
        before (``expect``) goes into its sink, straight off the socket. Ends once the socket has
        nothing more now; raises LaneClosed once the sender closed or broke it."""
        more = True  # the socket may hold more (its last read filled the buffer)
        while True:
            if self.sink is not None:
                if not self._fill():
                    return
                more = True
                continue
            reader = self.reader
            if reader._pos != len(reader._buf):  # bytes buffered (else ``next`` says None: read first)
                body = reader.next()
                if body is not None:
                    yield body
                    continue
            n = self.reader.fill(self.sock) if more else 0
            if not n:
                return
            more = n == READ_BYTES

    def expect(self, sink: Sink) -> None:
        """The frame just read announced a payload: its bytes come next, into ``sink``."""
        assert self.sink is None, "a payload announced while another one is still coming"
        self.sink = sink
        if not sink.left:
            self.sink = None
            sink.advance(0)

    def _fill(self) -> bool:
        """Move payload bytes into the sink: those read with its header first, then off the socket
        (``recv_into``); True once the payload is whole, False once the socket has none now or
        FILL_BYTES came off it in this call (the rest waits in the socket: its poll wakes the
        control thread again)."""
        sink, taken = self.sink, 0
        while True:
            target = sink.target()
            n = self.reader.take(target)
            if not n:
                if taken >= FILL_BYTES:
                    return False
                try:
                    n = self.sock.recv_into(target)
                except (BlockingIOError, InterruptedError):
                    return False
                except OSError as e:
                    raise LaneClosed(f"lane broken: {e}") from None
                if not n:
                    raise LaneClosed("the sender closed the lane inside a payload")
                taken += n
            if sink.advance(n):
                self.sink = None
                return True

    def write(self, body: bytes) -> None:
        _write_frame(self.sock, self.out, body)
        if self.out:
            self._check_out()

    def flush(self) -> None:
        """Write what the socket takes now; raises LaneClosed if it broke or ``out`` grew too long."""
        if not self.out:
            return
        _write_some(self.sock, self.out)
        self._check_out()

    def _check_out(self) -> None:
        if len(self.out) > self.max_out:
            raise LaneClosed(f"the sender left {len(self.out)} bytes of replies unread")

    def close(self, why: str = "the lane closed") -> None:
        """Close it; a payload still coming fails with ``why``."""
        self.closed = True
        self.sock.close()
        sink, self.sink = self.sink, None
        if sink is not None:
            sink.fail(why)


class SenderLane:
    """The prefill node's end of a lane, used by one thread at a time (the peer's, or the engine's
    while that one holds the peer's turn): writes bounded by a deadline, or ``post``ed without
    waiting (what the socket does not take at once goes out with the next write or read), reads
    polled with a timeout."""

    def __init__(self, sock: socket.socket, max_bytes: int) -> None:
        self.sock = _tuned(sock)
        self.sock.setblocking(False)
        self.reader = FrameReader(max_bytes)
        self._out = bytearray()
        self._readable = select.poll()
        self._readable.register(sock.fileno(), select.POLLIN)
        self._writable = select.poll()
        self._writable.register(sock.fileno(), select.POLLOUT)

    @classmethod
    def connect(cls, host: str, port: int, deadline: float, max_bytes: int) -> SenderLane:
        left = deadline - time.monotonic()
        if left <= 0:
            raise KVTransferError(f"no time left to open the lane to {host}:{port}")
        try:
            sock = socket.create_connection((host, port), timeout=left)
        except OSError as e:
            raise KVTransferError(f"cannot open the lane to {host}:{port}: {e}") from None
        return cls(sock, max_bytes)

    @classmethod
    def connect_local(cls, name: str, max_bytes: int) -> SenderLane | None:
        """The lane through the receiver's abstract Unix socket ``name``; None where this host (this
        network namespace) has no such socket: the receiver is elsewhere."""
        if not sys.platform.startswith("linux"):
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(f"\0{name}")
        except OSError:
            sock.close()
            return None
        return cls(sock, max_bytes)

    def send(self, body: bytes | memoryview, deadline: float, payload: Sequence[memoryview] = ()) -> None:
        """Write one message, then its ``payload``'s bytes as they lie (unframed: the message says
        how many); raises KVTransferError if the peer does not take them by ``deadline`` (part of
        them may have gone: the lane is done for then)."""
        _write_frame(self.sock, self._out, body)
        if not self.flush(deadline):
            raise KVTransferError("the KV peer did not take a lane message in time")
        for view in payload:
            view = as_bytes(view)
            sent = 0
            while sent < len(view):
                try:
                    sent += self.sock.send(view[sent:])
                    continue
                except (BlockingIOError, InterruptedError):
                    pass
                except OSError as e:
                    raise LaneClosed(f"lane broken: {e}") from None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise KVTransferError("the KV peer did not take a payload in time")
                self._writable.poll(max(int(left * 1000 + 0.999), 1))

    def post(self, body: bytes | memoryview) -> None:
        """Write one message without waiting: the caller's thread must never block on the peer."""
        _write_frame(self.sock, self._out, body)

    def flush(self, until: float) -> bool:
        """Write what waits to go out, until ``time.monotonic()`` ``until``; True once all went."""
        while self._out:
            _write_some(self.sock, self._out)
            if not self._out:
                break
            left = until - time.monotonic()
            if left <= 0:
                return False
            self._writable.poll(max(int(left * 1000 + 0.999), 1))
        return True

    def recv(self, wait_s: float) -> bytearray | None:
        """The next frame, waiting up to ``wait_s`` for it (None when none came)."""
        reader = self.reader
        if reader._pos != len(reader._buf):  # bytes buffered (else ``next`` says None: wait first)
            body = reader.next()
            if body is not None:
                return body
        end = time.monotonic() + wait_s
        if self._out and not self.flush(end):
            return None
        while True:
            wait_ms = max(int((end - time.monotonic()) * 1000 + 0.999), 0)
            if self._readable.poll(wait_ms) and self.reader.fill(self.sock):
                body = self.reader.next()
                if body is not None:
                    return body
            if time.monotonic() >= end:
                return None

    def close(self) -> None:
        self.sock.close()

"""How a transport plugs in: a data plane on each side of the control host, and a registry entry.

The control host (``kv_transfer.control``) owns the connection between a prefill node and a decode
node: handshake, transport set-up, lease renewals, commits and acks. A **plane** moves the blocks;
the host hands it the messages of its own kind and never reads a plane's fields. A transport is
one file holding its options (a frozen dataclass whose defaults are the tuned values), its two
planes and a ``TransportPlugin``, plus one entry in ``kv_transfer.REGISTRY``; its set-up structs
and data messages join the others in ``kv_transfer.messages``.

Threads. On the decode node one control thread serves every connection: it calls ``setup``,
``handle``, ``poll`` and ``drop`` of the receiver planes, never concurrently; a plane answers from
any thread through the ``Outbox``. On the prefill node each peer (decode node) has a thread that
runs its jobs in order: it calls ``offer`` and ``connect`` and the session's ``deliver`` and
``close``; ``stage`` runs on the thread that calls ``KVSender.send`` (the engine's).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

import torch

from pdserve.kv_transfer.base import ReservationTable, Staged
from pdserve.kv_transfer.messages import KVCommit, KVMessage, KVSetup, KVSetupReply, PlaneOffer


class Outbox(ABC):
    """The decode node's way back to a sender: a reply on the control connection of ``peer``."""

    @abstractmethod
    def put(self, peer: bytes, msg: KVMessage) -> None:
        """Send ``msg`` to ``peer``; callable from any thread."""


class ControlLink(ABC):
    """A prefill node's control connection to one decode node, as its sessions use it (on the
    peer's thread only)."""

    address: str

    @property
    @abstractmethod
    def streams(self) -> bool:
        """Whether the session's messages travel on a lane (``kv_transfer.lane``): payload frames
        then go as raw bytes straight from their memory, which may be reused once ``send``
        returned; on ZeroMQ, a frame sent without a copy is read later by its I/O thread."""

    @abstractmethod
    def send(self, frames: list, deadline: float) -> None:
        """Send one multipart message (first frame: an encoded message; on a lane, payload frames
        are buffers); raises KVTransferError when the peer does not take it before ``deadline``."""

    @abstractmethod
    def recv(self, deadline: float, kind, resend: list | None = None, idle: Callable[[], None] | None = None):
        """The next reply of type ``kind`` (others are skipped); ``idle`` runs every millisecond
        without one. Raises KVTransferError at ``deadline``."""


class Landing(ABC):
    """A payload coming in on a lane (``ReceiverPlane.land``): ``nbytes`` into ``views`` in order,
    pinned in the reservation table (``begin``) unless refused (``error``; no views: the bytes are
    read and dropped)."""

    nbytes: int
    views: list[memoryview]
    error: str

    @abstractmethod
    def live(self) -> bool:
        """False once the reservation it writes into is gone (released, expired): the control
        thread then stops writing into the views and ends it at once."""

    @abstractmethod
    def end(self, error: str) -> str:
        """The payload is over, or given up (``error``): unpin (once; later calls only answer).
        "" when it landed, else why not."""


class ReceiverPlane(ABC):
    """A decode node's data plane: one per receiver, shared by every sender that chose it.

    Contract:

    * ``start`` once, before the control thread runs; afterwards every call but ``close`` comes
      from the control thread.
    * On set-up (``setup``) the plane reads only its own offer (``msg.offer(...)``) and answers
      ``KVSetupReply`` (``ok`` with its ``accept`` struct, or a refusal naming why); raising
      refuses too ("set-up failed on the decode node").
    * On data (``handle``: a message of a type in ``messages``, arriving on a connection set up
      for this plane, with its payload frames): return "" once taken (the plane answers itself,
      through the outbox, where the sender waits for an answer), or why it is refused: the host
      then fails that request in the table, logs, and answers ``msg.refused(why)``. It writes into
      the cache only as the ``ReservationTable`` allows (``write`` under its lock, or ``begin`` ..
      ``end`` around a transfer it cannot stop at will, bounded by a deadline). Nothing a peer
      sends may raise out of it. A data message whose payload follows it on the lane goes to
      ``land`` instead, which says where its bytes go; the host answers once they came.
    * On abort or refusal the plane takes no further part: the host fails the request and the
      commit is refused; the engine thread's ``release`` waits for what the plane pinned.
    * ``drop``: the peer's connection closed or set up again: forget its session (transfers in
      flight run to their end or deadline, then unpin). ``close``: after the control thread
      stopped; cancel and unpin what is left.
    """

    name: ClassVar[str]
    messages: ClassVar[tuple[type[KVMessage], ...]] = ()
    """The data messages this plane takes (``handle``)."""
    handles_commit: ClassVar[bool] = False
    """True when commits must queue behind the plane's data (``handle`` then gets the KVCommit
    and acks it through the outbox); otherwise the control thread commits directly."""
    max_message_bytes: int = 0
    """The largest message with its payload frames that this plane's senders send (0: small)."""
    lane: bool = False
    """Whether a session of this plane moves its messages onto a lane once set up
    (``kv_transfer.lane``): where its messages are small, or their payload can land through
    ``land`` (set by ``start`` where it depends on the cache)."""

    def __init__(self) -> None:
        self.bytes_received = 0

    @abstractmethod
    def start(
        self,
        kv: torch.Tensor,
        table: ReservationTable,
        outbox: Outbox,
        on_commit: Callable[[KVCommit], None],
        host: str,
    ) -> None:
        """The cache it writes into, the table it writes by, the way back to senders, the commit
        callback (for planes that commit themselves) and the KV interface's host."""

    @abstractmethod
    def setup(self, peer: bytes, msg: KVSetup) -> KVSetupReply:
        """A sender chose this plane; returns the KVSetupReply."""

    @abstractmethod
    def handle(self, peer: bytes, msg: KVMessage, payload: Sequence) -> str:
        """A data message of this plane (or a KVCommit when ``handles_commit``) from ``peer``;
        "" when taken, else why it is refused."""

    def land(self, peer: bytes, msg: KVMessage) -> Landing:
        """A data message whose payload follows it on the lane, as raw bytes: where they go. Raises
        ValueError when the header cannot be trusted with the payload's length (the lane closes)."""
        raise NotImplementedError(f"{self.name} takes no payload on a lane")

    def poll(self) -> bool:
        """The control thread calls this on every turn of its loop: work the plane does there
        (nixl checks its READs). True while such work is in flight: the control thread then
        turns again at once instead of waiting for the next message."""
        return False

    @abstractmethod
    def drop(self, peer: bytes) -> None:
        """Forget ``peer``'s session (it set up again, or went away)."""

    @abstractmethod
    def close(self) -> None: ...


class SenderPlane(ABC):
    """A prefill node's data plane: one per sender, one session per peer that chose it.

    Contract: ``register`` once, before any send, on the caller's thread; ``stage`` on the thread
    that calls ``KVSender.send``; ``offer`` and ``connect`` on the peer's thread at set-up.
    """

    name: ClassVar[str]
    concurrent_sessions: ClassVar[bool] = True
    """Whether several sessions to one peer may move blocks at the same time (a sender opens
    ``connections`` per peer where they may)."""

    @abstractmethod
    def register(self, kv: torch.Tensor) -> None: ...

    def block_bytes(self, kv: torch.Tensor) -> int:
        """Bytes one block of ``kv`` (all layers) counts for in the sender's ``bytes_sent``."""
        return kv[:, 0].numel() * kv.element_size()

    def offer(self) -> PlaneOffer | None:
        """This plane's part of the KVSetup the sender offers (None: it needs no parameters)."""
        return None

    @abstractmethod
    def stage(
        self,
        kv: torch.Tensor,
        block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        layer_events: Sequence | None = None,
        written: bool = False,
    ) -> Staged:
        """On the caller's thread: the blocks in the form ``deliver`` wants (a copy, or their ids
        to move in place); ``dst_block_ids`` are where they land in the peer's cache;
        ``layer_events`` and ``written`` as in ``KVSender.send``."""

    @abstractmethod
    def connect(
        self, link: ControlLink, setup: KVSetup, reply: KVSetupReply, deadline: float
    ) -> SenderSession:
        """The receiver chose this plane (``reply.accept``): connect to it."""


class SenderSession(ABC):
    """One sender's data connection to one receiver; called on the peer's thread only."""

    progress: Callable[[], None] | None = None
    """Run every millisecond while the sender waits for a reply (nixl: progress UCX, which some of
    its transports need on this side too), if set."""

    carries_commit: ClassVar[bool] = False
    """True when ``deliver`` sends the request's commit itself, inside its last data message (zmq,
    nixl): a send is then one message each way. Otherwise the host sends the commit right behind
    the data."""

    @abstractmethod
    def deliver(
        self,
        request_id: str,
        staged: Staged,
        dst_block_ids: list[int],
        deadline: float,
        commit: KVCommit | None = None,
    ) -> Callable[[float], None] | None:
        """Move staged blocks into the peer's reserved ``dst_block_ids``; raises KVTransferError
        (``KVRefused`` when the peer refused them: the connection stays up; anything else closes
        it, and this session with it).

        ``commit`` is given only to a session that ``carries_commit``: it goes out with the send's
        last data message (or alone, right behind the data, where a refusal stopped the send
        early), so the peer always gets it and always answers it with a KVAck.

        Returns None once the peer has them. A plane whose peer queues the commit behind the data
        (nccl: one thread there takes both in order; nixl: the decode node commits behind its own
        READs) returns as soon as the data is on its way, with a function that waits, until the
        deadline it is given, for the data to have left: the sender sends the commit at once, then
        calls it before the send's future resolves (the source blocks are read until then). If the
        sender gives up instead, closing the session stops the data, or says until when it may
        still move (``close``)."""

    def post(
        self,
        request_id: str,
        src_block_ids: list[int],
        dst_block_ids: list[int],
        deadline: float,
        commit: KVCommit,
    ) -> Callable[[float], None] | None:
        """Called by the sender on the caller's thread while the peer's thread is idle, for a
        request's last send (``commit``) of blocks that wait for nothing: send it now if that takes
        nothing but its messages (``ControlLink.send``, which does not wait on a posting thread):
        no kernel, no staging slot, no wait. Returns what ``deliver`` would (the wait for the data
        to have left), or None, having sent nothing, when it cannot; the send then takes the usual
        way (``stage``, then ``deliver`` on the peer's thread). Never blocks."""
        return None

    def acked(self) -> None:
        """The peer answered the commit of the send just delivered (either way); a plane whose
        peer takes the commit only after all of the request's data (nixl) knows from this that
        nothing of it is moving any more."""
        return None

    def received(self, msg: KVMessage) -> None:
        """A reply the control host received while it waited for another (a commit's ack): one of
        this plane's reports (nixl: a READ is over), or a stale reply to skip."""
        return None

    @abstractmethod
    def close(self) -> float:
        """The connection is dropped (timeout, broken peer, sender closing): stop the data still
        moving, and return the ``time.monotonic()`` from which none can move any more (a time
        already past where close stopped it all: zmq once ZeroMQ let go of its frames, nccl once
        the communicator is aborted). The caller reuses the source blocks only from then on
        (``KVSendFuture.released``). A session whose peer may still read on its own (nixl) returns
        at once with the end of the time it gave the peer, and gives back what else the peer may
        read (staging slots) only then."""


OptionsT = TypeVar("OptionsT")


@dataclass(frozen=True)
class TransportPlugin(Generic[OptionsT]):
    """A registry entry: how to tell whether a transport runs here and build its planes."""

    name: str
    options: type[OptionsT]
    """Its options: a frozen dataclass; ``options()`` gives the tuned defaults."""
    available: Callable[[], bool]
    sender_plane: Callable[[OptionsT], SenderPlane]
    receiver_plane: Callable[[OptionsT], ReceiverPlane]
    auto_on_cpu: bool = False
    """Offered by ``auto`` on a CPU-only host too (else only where CUDA is)."""
    in_auto: bool = True
    """Offered by ``auto`` at all (the sim transport, for simulated nodes only, is not)."""

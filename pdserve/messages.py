"""Typed messages that cross process boundaries, and their one serializer (msgpack via msgspec).

The control plane between proxy and nodes carries only these structs: the request path over
one multiplexed channel per (proxy worker, node) (``Hello``, ``Call``/``Reply``, ``Events``,
``Ping``/``Pong``: pdserve.node.channel and pdserve.proxy.channel), info, load and health over
HTTP. The KV channel's
messages (prefill node -> decode node) build on ``Message`` and live in one module of their own,
``pdserve.kv_transfer.messages``. Every decode validates types and required fields; semantic
checks (sizes, ids, block ranges) happen where the message is used.

Request life cycle across processes (numbers match docs/architecture.md):

1. proxy -> decode ``ReserveRequest``; decode -> proxy ``LandingDescriptor``; at the same time
   (3) proxy -> prefill ``PrefillRequest`` without it: the prompt is computed while the decode
   node reserves, and ``PrefillLanding`` brings the landing descriptor once it is known
2. proxy -> decode ``StreamRequest`` (opens the token stream: ``TokenEvent``s, batched per step)
3. proxy -> prefill ``PrefillRequest`` (carrying the landing descriptor, or followed by it)
4. prefill -> decode over the KV transport (``pdserve.kv_transfer.messages``): ``KVHandshake``
   once per peer, then the blocks and one ``KVCommit`` per request
5. prefill -> proxy ``PrefillResult`` (control plane only: ok or an error)
6. proxy -> either node ``AbortRequest`` on client disconnect or failure

Deadlines (``ReserveRequest.deadline``, ``PrefillRequest.deadline``) are absolute wall-clock
``time.time()`` seconds, 0 for none: proxy and nodes share a clock domain (NTP) in our
deployments, and an absolute time survives queueing and retries on other nodes unchanged. A node
drops a request whose deadline has passed, wherever it is, and frees its blocks.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from pdserve.config import Role
from pdserve.logprobs import TokenLogprobs
from pdserve.sampling_params import SamplingParams

T = TypeVar("T")


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag=True):
    """Base of every cross-process message; tagged with its class name, so unions decode."""


class NodeInfo(Message):
    """What a node is; peers compare it at handshake and refuse mismatches."""

    node_id: str
    role: Role
    model_id: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_layout: str
    kv_transport: str
    kv_address: str  # where the node's KV transport listens ("" when it receives none)
    max_model_len: int
    vocab_size: int
    kv_transports: list[str] = []  # the transports it accepts, preferred first; agreed per peer
    channel_port: int = 0  # the request channel's TCP port, on the host of the node's URL


COMPAT_FIELDS = ("model_id", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "kv_layout")
"""NodeInfo fields a prefill node and a decode node must share before any KV moves between them."""


def mismatches(a: NodeInfo, b: NodeInfo) -> list[tuple[str, object, object]]:
    """Why two nodes cannot exchange KV: each compatibility field on which they disagree, with both
    values, and ``kv_transports`` when they accept none in common. The one compatibility rule: the
    proxy checks it before routing, the KV handshake before the first block moves."""
    out = [(f, getattr(a, f), getattr(b, f)) for f in COMPAT_FIELDS if getattr(a, f) != getattr(b, f)]
    ta, tb = a.kv_transports or [a.kv_transport], b.kv_transports or [b.kv_transport]
    if not set(ta) & set(tb):
        out.append(("kv_transports", ta, tb))
    return out


class NodeLoad(Message):
    running: int
    waiting: int
    waiting_for_kv: int
    free_blocks: int
    total_blocks: int
    pending_prompt_tokens: int = 0  # prompt tokens queued or running, not computed yet


class ReserveRequest(Message):
    """Take a request on a decode node: reserve blocks for KV computed elsewhere, or with
    ``local_prefill`` queue the prompt to be computed there (conditional disaggregation)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    lease_s: float
    local_prefill: bool = False
    deadline: float = 0.0  # unix time (time.time()) after which nobody wants the result; 0: none


class LandingDescriptor(Message):
    """Where a prompt's KV must land on a decode node: block ``first_block + i`` of the prompt goes
    to ``block_ids[i]``. The decode node holds the prompt's first ``first_block`` blocks in its own
    prefix cache already, so they are neither sent nor writable."""

    request_id: str
    node_id: str
    kv_address: str
    block_ids: list[int]
    num_prompt_tokens: int
    lease_deadline: float  # unix time after which the reservation is void
    local_prefill: bool = False  # the node computes the prompt itself: no KV to send, no lease
    first_block: int = 0


class StreamRequest(Message):
    request_id: str


class PrefillRequest(Message):
    """Compute a prompt and send its KV to ``landing``; None: the landing descriptor follows in a
    ``PrefillLanding`` (the decode node is still reserving), and the prompt's blocks are held
    after its first token until it arrives."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    landing: LandingDescriptor | None = None
    deadline: float = 0.0  # unix time (time.time()) after which nobody wants the result; 0: none


class PrefillLanding(Message):
    """Proxy -> prefill node: where the KV of a ``PrefillRequest`` sent without one lands; answered
    once the node took it (404: no such prefill here, it ended or never came)."""

    landing: LandingDescriptor


class PrefillResult(Message):
    request_id: str
    ok: bool
    error: str = ""
    num_cached_tokens: int = 0
    prompt_logprobs: list[LogprobsMsg | None] | None = None  # asked for by params.prompt_logprobs


class AbortRequest(Message):
    request_id: str


class LogprobsMsg(Message):
    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]

    @classmethod
    def from_logprobs(cls, lp: TokenLogprobs) -> LogprobsMsg:
        return cls(lp.token_id, lp.logprob, lp.rank, [tuple(t) for t in lp.top])

    def to_logprobs(self) -> TokenLogprobs:
        return TokenLogprobs(self.token_id, self.logprob, self.rank, tuple(tuple(t) for t in self.top))


class TokenEvent(Message, omit_defaults=True):
    """One step of one sequence of a request's output as the decode node streams it.

    A parallel-sampling request (``params.n``/``best_of`` > 1) streams its sequences interleaved,
    told apart by ``index``; each ends with its own ``finish_reason``. The first event of a request
    whose prompt the node computed carries the prompt logprobs when asked for.

    The per-token message: fields at their defaults stay off the wire (a usual event is 84 bytes
    instead of 191, and decodes in half the time).
    """

    request_id: str
    token_ids: list[int]
    text: str  # the text these tokens completed
    logprobs: list[LogprobsMsg] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str = ""
    index: int = 0
    prompt_logprobs: list[LogprobsMsg | None] | None = None


# -- the request channel (one per proxy worker and node) -----------------------------------------


class Hello(Message):
    """Proxy -> node, first on every connection of the channel: the cluster token."""

    token: str
    peer: str = ""  # who is calling, for the node's logs (e.g. "proxy pid 1234")


class Welcome(Message):
    """Node -> proxy: the channel is open (the token was right)."""

    node_id: str


class Call(Message):
    """Proxy -> node: one call of the request path; answered by a ``Reply`` with its ``call_id``."""

    call_id: int
    body: ReserveRequest | PrefillRequest | PrefillLanding | StreamRequest | AbortRequest


class Reply(Message):
    """Node -> proxy: the answer to a ``Call`` (``call_id`` 0: to the channel's ``Hello``).

    ``status`` keeps HTTP's meanings (200 ok; 400 the request is bad; 401 wrong token; 404 no
    such request; 429/503 full, with ``retry_after``; 5xx the node failed it)."""

    call_id: int
    status: int = 200
    body: LandingDescriptor | PrefillResult | None = None
    error: str = ""
    error_type: str = ""
    retry_after: float | None = None
    load: NodeLoad | None = None
    """The node's load as of its last engine step, on every call's reply: each proxy worker
    routes on what the node said at its last call there, not on a poll up to an interval old
    (with several workers, each one's own in-flight counts miss the others' requests)."""


class Events(Message):
    """Node -> proxy: every token event of one engine step for the streams this proxy opened."""

    events: list[TokenEvent]


class Ping(Message):
    """Either way: are you there? Answered with a ``Pong`` carrying the same ``sent``."""

    sent: float


class Pong(Message):
    sent: float


ToNode = Hello | Call | Ping | Pong
ToProxy = Welcome | Reply | Events | Ping | Pong


# -- node process <-> its engine core process -----------------------------------------------------
# A node runs its engine (and the engine-side halves of its roles: KV sender/receiver, the
# reservation table, deadlines, prefix-index events) in a process of its own, as vLLM V1 runs its
# EngineCore (pdserve/node/engine_core.py); the node process keeps HTTP and the request channel
# (pdserve/node/core_client.py). They speak these messages over one ZeroMQ ipc:// pair.


class AddPrefill(Message):
    """Node -> core: handshake with the prompt's decode node unless done already (a refusal is
    remembered), then open the prefill's shipment and queue its prompt (its blocks held for the send)."""

    msg: PrefillRequest


class LandPrefill(Message):
    """Node -> core: the landing of a prefill added without one (``PrefillLanding``): handshake with
    its decode node unless done already, then ship its KV there (at once if its first token is out)."""

    landing: LandingDescriptor


class ClosePrefill(Message):
    """Node -> core: the prefill's call handler returned; its lease is no longer renewed."""

    request_id: str


class Reserve(Message):
    """Node -> core: reserve blocks for KV computed elsewhere (``local`` false), or take a prompt
    to compute here once its stream opens (``local`` true); ``lease_deadline`` is unix time."""

    msg: ReserveRequest
    lease_deadline: float
    local: bool = False


class StartLocal(Message):
    """Node -> core: the stream of a locally prefilled request is open: queue its prompt."""

    request_id: str


class EndRequest(Message):
    """Node -> core: end a request wherever it is (``status``: a ``RequestStatus`` name)."""

    request_id: str
    status: str
    message: str


class GetStats(Message):
    """Node -> core: the engine's counters for /metrics (answered with ``CoreStats``)."""


class IsIdle(Message):
    """Node -> core: nothing left in the core that must finish before the node exits."""


class EndAll(Message):
    """Node -> core: end every request the core holds with an error (a drain that ran out)."""

    message: str


class Shutdown(Message):
    """Node -> core: stop the engine loop, close the transports and exit."""


class CoreCall(Message):
    """Node -> core: a command; ``call_id`` 0 wants no reply, others get a ``CoreReply``."""

    call_id: int
    body: (
        AddPrefill
        | LandPrefill
        | ClosePrefill
        | Reserve
        | StartLocal
        | EndRequest
        | GetStats
        | IsIdle
        | EndAll
        | Shutdown
    )


class Reserved(Message):
    """Core -> node: the blocks a prompt's KV lands in and the index of the prompt block the first
    takes (empty for a local prefill); ``ok`` false when too few blocks are free now."""

    ok: bool
    block_ids: list[int] = []
    first_block: int = 0


class Flag(Message):
    value: bool


class Count(Message):
    value: int


class GcStats(Message):
    """A process's cyclic-collector passes (``pdserve.gc_heap``): how many ran and the seconds they
    took, by generation (0, 1, 2), and how many objects its start-up froze out of them."""

    collections: list[int]
    seconds: list[float]
    frozen: int


class CoreStats(Message):
    """Core -> node: what ``LLMEngine.load`` says, the KV bytes the transports moved, and the
    core process's collector passes."""

    num_running: int
    num_waiting: int
    num_waiting_for_kv: int
    num_held: int
    num_free_blocks: int
    num_blocks: int
    num_pending_prompt_tokens: int
    num_prompt_tokens_computed: int
    num_prefix_hit_tokens: int
    num_jit_compiles: int
    transfer_bytes: int
    gc: GcStats | None = None


class CoreReply(Message):
    """Core -> node: the answer to a ``CoreCall``; ``status`` keeps HTTP's meanings (``kind``
    ``value_error``: the engine can never serve the request)."""

    call_id: int
    status: int = 200
    body: Reserved | Flag | Count | CoreStats | None = None
    error: str = ""
    kind: str = ""
    retry_after: float | None = None


class TransferDone(Message):
    """Core -> node: the outcome of a prefill's last KV send is known (``error`` empty: the decode
    node acked it after ``seconds``). A failed send's blocks may stay pinned a while longer, until
    no READ it offered can run (``KVSendFuture.released``)."""

    request_id: str
    error: str = ""
    seconds: float = 0.0


class StepOutputs(Message):
    """Core -> node: one message per engine step (or idle turn with news): every token event of
    the step, the requests whose outputs ended (each sequence's own end is in its events), the KV
    sends that ended, and the node's load when it changed."""

    events: list[TokenEvent]
    finished: list[str] = []
    transfers: list[TransferDone] = []
    load: NodeLoad | None = None


class CoreReady(Message):
    """Core -> node, once: the engine is loaded and the transports listen."""

    info: NodeInfo
    simulated: bool
    load: NodeLoad


class CoreFailed(Message):
    """Core -> node: the core could not start (or its loop died); the node exits."""

    error: str


FromCore = CoreReply | StepOutputs | CoreReady | CoreFailed


_encoder = msgspec.msgpack.Encoder()
_decoders: dict[int, tuple[Any, msgspec.msgpack.Decoder]] = {}
"""id(kind) -> (kind, its decoder): looked up by identity, not by the kind's hash, which a Union
computes from its members at every call (~250 ns on the 2-core box, a third of decoding a KVReady).
The entry holds the kind, so its id is never reused while the entry is there. Kinds are
module-level classes and Union constants: a caller that built a new Union for every call would
add an entry each time."""
_decoders_lock = threading.Lock()
"""Decoders are made one at a time. msgspec (0.22, with the GIL) caches a Struct's type info on
the class *before* it fills in the fields' types, and filling them runs Python code, where the
GIL may pass to another thread: a second thread that made a decoder of the same Struct then got
the half-built info and dereferenced a NULL field type (a segfault in ``mpack_decode``: a prefill
node's engine core, whose KV peer threads decode their first replies at once, died so in CI).
A decoder made whole is safe to share between threads."""


encode: Callable[[Message], bytes] = _encoder.encode
"""A message's bytes: the shared encoder's own method (no Python call around it: a KV send encodes
one message each way on threads that wake cold, where each Python call costs)."""


def _new_decoder(kind: Any) -> tuple[Any, msgspec.msgpack.Decoder]:
    with _decoders_lock:
        entry = _decoders.get(id(kind))
        if entry is None:
            entry = _decoders[id(kind)] = (kind, msgspec.msgpack.Decoder(kind))
        return entry


def decode(data: bytes | bytearray | memoryview, kind: type[T]) -> T:
    """Decode ``data`` as ``kind`` (a Message subclass or a Union of them); raises ``msgspec.DecodeError``."""
    dec = (_decoders.get(id(kind)) or _new_decoder(kind))[1]
    try:
        return dec.decode(data)
    except UnicodeDecodeError as e:  # msgspec lets invalid UTF-8 in a str out as this
        raise msgspec.DecodeError(f"invalid UTF-8 in a string: {e}") from None


def decoder(kind: type[T]) -> Callable[[bytes | bytearray | memoryview], T]:
    """``kind``'s decode function, made once as ``decode`` makes it, for a hot path to hold (a KV
    send's messages, each way): ``decode`` without its lookup, one Python call fewer on threads
    that wake cold. Raises ``msgspec.DecodeError``, or ``UnicodeDecodeError`` on invalid UTF-8 in
    a string (where ``decode`` turns that into a ``DecodeError``)."""
    return (_decoders.get(id(kind)) or _new_decoder(kind))[1].decode


_LEN = struct.Struct("<I")


def frame(msg: Message) -> bytes:
    """A length-prefixed message, for byte streams (HTTP streaming bodies)."""
    body = encode(msg)
    return _LEN.pack(len(body)) + body


class FrameReader:
    """Splits a byte stream into length-prefixed messages."""

    MAX_FRAME = 64 << 20

    def __init__(self, kind: type[T]) -> None:
        self.kind = kind
        self._buf = bytearray()

    def feed(self, chunk: bytes) -> list:
        self._buf += chunk
        out = []
        while len(self._buf) >= _LEN.size:
            (n,) = _LEN.unpack_from(self._buf)
            if n > self.MAX_FRAME:
                raise ValueError(f"frame of {n} bytes exceeds the {self.MAX_FRAME}-byte limit")
            if len(self._buf) < _LEN.size + n:
                break
            out.append(decode(bytes(self._buf[_LEN.size : _LEN.size + n]), self.kind))
            del self._buf[: _LEN.size + n]
        return out

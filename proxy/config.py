"""The proxy's frozen configuration; ``pdserve proxy`` reads its flag defaults from here."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve import envs
from pdserve.config import DEFAULT_MODEL


def _normalize_urls(urls: object, what: str) -> tuple[str, ...]:
    if isinstance(urls, str):
        urls = [u for u in urls.split(",")]
    out = []
    for url in urls:  # type: ignore[union-attr]
        url = str(url).strip().rstrip("/")
        if not url:
            continue
        if "://" not in url:
            url = "http://" + url
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{what} URL {url!r} must be http:// or https://")
        out.append(url)
    if len(set(out)) != len(out):
        raise ValueError(f"{what} URLs are listed twice: {out}")
    return tuple(out)


@dataclass(frozen=True)
class ProxyConfig:
    """The OpenAI-compatible front of a cluster: where it listens and which nodes it drives."""

    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 8000
    """Port to listen on (0 picks a free one)."""
    prefill_urls: tuple[str, ...] = field(default_factory=tuple)
    """Base URLs of the prefill nodes (comma-separated on the command line; http:// is implied)."""
    decode_urls: tuple[str, ...] = field(default_factory=tuple)
    """Base URLs of the decode nodes (comma-separated on the command line; http:// is implied)."""
    both_urls: tuple[str, ...] = field(default_factory=tuple)
    """Base URLs of co-located nodes (`--role both`): each serves whole requests, prefill included;
    list one under --prefill-urls too to let it prefill for decode nodes."""
    model: str = DEFAULT_MODEL
    """The nodes' --model: `default`, an HF-format folder or `random:<preset>`; gives the tokenizer."""
    served_model_name: str = ""
    """Name clients use in `model` and /v1/models lists; empty means the model id."""
    cache_dir: str = ""
    """Where converted models live (as the nodes' --cache-dir); empty means the default."""
    lease_s: float = 30.0
    """How long a decode node holds a reservation for KV that has not landed yet."""
    request_timeout_s: float = 600.0
    """Every request ends, with output or an error, within this many seconds."""
    cluster_token: str = ""
    """Bearer token of the nodes' internal API (default: $PDSERVE_CLUSTER_TOKEN); empty: none."""
    api_key: str = ""
    """If set, clients must send `Authorization: Bearer <api_key>` to /v1/* (else a 401);
    /health and /metrics stay open, as in vLLM."""
    max_request_body_bytes: int = 32 * 1024 * 1024
    """Largest request body accepted; a larger one is a 413, refused as its bytes arrive (a
    Content-Length over it is refused before any are read)."""
    workers: int = 1
    """Proxy worker processes sharing the port, each a whole proxy with its own routing state (one
    process relays about one core's worth of tokens). /metrics on any of them sums all; SIGTERM
    drains them all. --max-inflight-requests holds per worker."""
    max_inflight_requests: int = 4096
    """Generation requests this proxy (each worker) runs at once, streams included until their last byte; one
    more is a 429 with Retry-After. Each costs about three open files (client socket, prefill and
    decode streams): keep it below a third of `ulimit -n`. Decode nodes bound their own queues
    by KV blocks (--admission-wait-s); this bounds the proxy's memory and sockets before that."""
    routing: str = "prefix-aware"
    """How to pick nodes: `prefix-aware` (cached prefix against queued work; needs --redis-url for
    the cached part), `least-loaded` or `round-robin`."""
    redis_url: str = ""
    """Redis of the cluster's prefix index (redis://host:port/db); empty: route on load alone."""
    prefix_index_timeout_s: float = 0.1
    """Longest a request waits for the prefix index before it is routed on load alone."""
    min_remote_prefill_tokens: int = 0
    """A prompt whose uncached part on the chosen decode node is shorter than this is computed
    there instead of on a prefill node; 0 (the default) always uses a prefill node while one is
    up. Measured on 2 x H200 with 16 streams decoding (docs/benchmarks/conditional_prefill_h200x2.json):
    a local prefill of even 8 tokens saves 12-20 ms of its TTFT but raises the streams' p99 TPOT
    from 9-11 ms to 22-33 ms (one mixed step), and at 2048 tokens it is slower for both."""
    overlap_reserve: bool = True
    """Send a prompt to its prefill node while its decode node reserves the KV blocks, the block ids
    following in a second message, rather than after the reservation: the reserve's round trip
    leaves the time to first token. The prompt's blocks wait on the prefill node, after its first
    token, until the landing comes (at most --kv-transfer-timeout-s of the prefill node)."""
    default_max_tokens: int = 4096
    """max_tokens of a chat completion that sets none (a /v1/completions request without one gets
    OpenAI's 16); the rest of the context caps it further."""
    admission_wait_s: float = 5.0
    """How long a request waits for free KV blocks on some decode node, or for this proxy's own
    event loop to catch up (--max-loop-lag-s), before a 429."""
    max_loop_lag_s: float = 0.05
    """Past its capacity a proxy's event loop runs late for every stream it relays: while it runs
    later than this, new requests wait in a FIFO queue (admitted one by one as it catches up, a
    429 after --admission-wait-s) and the streams already admitted keep their pace. 0: never wait."""
    max_migrations: int = 2
    """How many times one request may move to other nodes after a node died under it: a decode
    node that dies mid-stream (the request resumes on another decode node from its prompt plus
    the tokens already streamed) or a prefill node that dies before the hand-off."""
    shutdown_timeout_s: float = 30.0
    """On SIGTERM the proxy stops accepting, then waits this long for the requests in flight
    (streams included); those still running then end with an error event."""
    load_poll_interval_s: float = 1.0
    """How often each node's load is polled (also how fast a dead node is noticed)."""
    startup_timeout_s: float = 600.0
    """How long start-up waits for every node to answer /internal/info."""

    def __post_init__(self) -> None:
        if not self.cluster_token:
            object.__setattr__(self, "cluster_token", envs.PDSERVE_CLUSTER_TOKEN)
        object.__setattr__(self, "prefill_urls", _normalize_urls(self.prefill_urls, "prefill"))
        object.__setattr__(self, "decode_urls", _normalize_urls(self.decode_urls, "decode"))
        object.__setattr__(self, "both_urls", _normalize_urls(self.both_urls, "co-located"))
        if not self.decode_urls and not self.both_urls:
            raise ValueError("the proxy needs at least one decode or co-located (both) node URL")
        both_twice = set(self.decode_urls) & set(self.both_urls)
        if both_twice:
            raise ValueError(f"{sorted(both_twice)} listed as decode and as co-located nodes: pick one")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.min_remote_prefill_tokens < 0:
            raise ValueError(f"min_remote_prefill_tokens must be >= 0, got {self.min_remote_prefill_tokens}")
        for name in (
            "lease_s",
            "request_timeout_s",
            "load_poll_interval_s",
            "startup_timeout_s",
            "prefix_index_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations}")
        if self.max_loop_lag_s < 0:
            raise ValueError(f"max_loop_lag_s must be >= 0, got {self.max_loop_lag_s}")
        if self.admission_wait_s < 0:
            raise ValueError(f"admission_wait_s must be >= 0, got {self.admission_wait_s}")
        for name in ("max_request_body_bytes", "max_inflight_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        from pdserve.proxy.router import POLICIES

        if self.routing not in POLICIES:
            raise ValueError(f"unknown routing {self.routing!r}; choose one of {sorted(POLICIES)}")

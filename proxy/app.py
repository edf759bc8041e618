"""The proxy's HTTP front: OpenAI-compatible endpoints over a prefill/decode cluster.

``create_app(config)`` builds the FastAPI app; its lifespan resolves the model (for the
tokenizer), waits for every node's ``NodeInfo`` and refuses to start when the cluster is
incompatible (``ClusterError``). Per request (docs/architecture.md, life of a request, steps 1 and 6):
validate, apply the chat template, tokenize, then hand the prompt to the ``Dispatcher``
(``proxy/dispatch.py``) and relay its ``TokenEvent``s as a response or as SSE.

Errors found before the first token (validation, no capacity, a failed prefill) are HTTP
errors with OpenAI bodies; a streaming request that fails after its first token ends with
an ``{"error": ...}`` event and ``[DONE]``. A client that disconnects, streaming or not,
aborts its request on both nodes.

In front of the routes, ``Gate`` (an ASGI middleware) refuses what should cost nothing to
refuse, in this order: a missing or wrong API key on /v1/* (401), a generation request
beyond ``max_inflight_requests`` (429 with Retry-After), a body over
``max_request_body_bytes`` (413, counted as it streams in). Every error, down to a route that
does not exist or an exception nobody expected, has an OpenAI body.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from pdserve import gc_heap
from pdserve.config import ModelConfig
from pdserve.messages import TokenEvent
from pdserve.metrics import CONTENT_TYPE, LATENCY_BUCKETS, Registry
from pdserve.model_source import resolve_model
from pdserve.proxy.batch import GenerationBatch
from pdserve.proxy.config import ProxyConfig
from pdserve.proxy.dispatch import Dispatcher, Generation
from pdserve.proxy.node_client import make_http_client
from pdserve.proxy.overload import LoopLag
from pdserve.proxy.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    ProxyError,
    bad_request,
    chat_messages,
    check_model,
    check_token_ids,
    completion_prompts,
    error_body,
    sampling_params,
    structured_outputs,
)
from pdserve.proxy.responses import SSE_DONE, ChatBuilder, CompletionBuilder, TokenStrings, sse
from pdserve.proxy.router import POLICIES, ClusterError, Router
from pdserve.proxy.tools import HERMES, ToolPlan, parser_for_template, tool_plan
from pdserve.proxy.workers import SharedMetrics
from pdserve.tokenizer import apply_chat_template, load_tokenizer

logger = logging.getLogger(__name__)

T = TypeVar("T")
CLIENT_GONE = 499  # nginx's status for a client that closed the connection; used in metrics


# -- client disconnects ----------------------------------------------------------------------


class ClientGone(Exception):
    """The client closed the connection."""


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(work: Awaitable[T], receive: Receive) -> T:
    """Await ``work`` unless the client disconnects first (then cancel it, raise ClientGone).

    Servers only report a disconnect to whoever awaits ``receive()``, and nobody does while
    a handler runs, so without this a vanished client would go unnoticed until the end.

    ``work`` runs in the calling task and only the watch is a task of its own: when it ends (a
    disconnect, or ``receive`` failing) it cancels the caller, whose ``work`` then unwinds.
    """
    caller = asyncio.current_task()
    active, gone = True, False

    def on_watch_done(watch: asyncio.Task) -> None:
        nonlocal gone
        if not watch.cancelled():
            watch.exception()  # retrieved: whatever ended the watch, the client is gone to us
            if active:  # a callback scheduled as ``work`` ended must not cancel later work
                gone = True
                caller.cancel()

    watch = asyncio.ensure_future(_wait_disconnect(receive))
    watch.add_done_callback(on_watch_done)
    try:
        result = await work
    except asyncio.CancelledError:
        if gone and caller.uncancel() == 0:  # our own cancel, and no one else's
            raise ClientGone() from None
        raise
    finally:
        active = False
        watch.cancel()
    if gone:  # ``work`` took our cancel and finished all the same
        caller.uncancel()
    return result


RAW_SEND = "pdserve.raw_send"
"""Scope key under which the outermost middleware (``server.InFlight``) leaves the server's own
``send``. Each middleware between it and a route wraps ``send`` in a coroutine of its own, and all
of them look only at a response's start and its last body message: a stream sends those through
the wrapped ``send`` and the token chunks in between straight to the server's."""

Write = Callable[[bytes], Awaitable[None]]


class EventStream(Response):
    """A ``text/event-stream`` response: ``produce(write)`` writes each SSE chunk; it is cancelled
    (and its cleanup runs) when the client leaves."""

    media_type = "text/event-stream"

    def __init__(
        self,
        produce: Callable[[Write], Awaitable[None]],
        headers: dict[str, str] | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.produce = produce
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw_send = scope.get(RAW_SEND, send)

        async def write(chunk: bytes) -> None:
            await raw_send({"type": "http.response.body", "body": chunk, "more_body": True})

        async def pump() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            await self.produce(write)
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await until_disconnected(pump(), receive)
        except (ClientGone, OSError):
            pass
        finally:
            if self.on_close is not None:
                self.on_close()  # for a body that never started, whose own cleanup did not run


# -- metrics ---------------------------------------------------------------------------------


class ProxyMetrics:
    """What /metrics shows about requests (the dispatcher adds its own)."""

    def __init__(self, registry: Registry) -> None:
        self.requests = registry.counter(
            "pdserve_requests_total",
            "Generation requests by final status (HTTP status; 499 = client went away), and every other "
            "/v1/ request that ends in an error (an unknown path is a 404, a body over the limit a 413). "
            "A streaming request that fails after its first token counts under its error's status.",
            ["status"],
        )
        self.running = registry.gauge("pdserve_requests_running", "Generation requests in flight.")
        self.admitted = registry.gauge(
            "pdserve_requests_admitted",
            "Generation requests past the gate, bodies still arriving included; bounded by "
            "--max-inflight-requests.",
        )
        self.ttft = registry.histogram(
            "pdserve_time_to_first_token_seconds",
            "From the request's arrival to its first token at the proxy.",
            buckets=LATENCY_BUCKETS,
        )
        self.itl = registry.histogram(
            "pdserve_inter_token_latency_seconds",
            "Time between consecutive output tokens at the proxy.",
            buckets=LATENCY_BUCKETS,
        )
        self.ttft_child = self.ttft.labels()  # unlabelled: the one child, looked up once
        self.itl_child = self.itl.labels()
        self.e2e = registry.histogram(
            "pdserve_e2e_request_latency_seconds",
            "From the request's arrival to its end.",
            buckets=LATENCY_BUCKETS,
        )
        self.prompt_tokens = registry.counter("pdserve_prompt_tokens_total", "Prompt tokens of requests.")
        self.cached_tokens = registry.counter(
            "pdserve_cached_prompt_tokens_total", "Prompt tokens whose KV came from a prefix cache."
        )
        self.generation_tokens = registry.counter("pdserve_generation_tokens_total", "Output tokens.")
        self.node_up = registry.gauge(
            "pdserve_node_up", "1 when the node answers and is compatible.", ["role", "node"], merge="max"
        )
        self.loop_lag = registry.gauge(
            "pdserve_proxy_event_loop_lag_seconds",
            "How late this proxy's event loop runs (a late wake-up, decaying); past --max-loop-lag-s new "
            "requests wait.",
            merge="max",
        )
        self.admission_waiting = registry.gauge(
            "pdserve_proxy_admission_waiting", "Requests waiting for the proxy's event loop to catch up."
        )
        self.node_inflight = registry.gauge(
            "pdserve_node_requests_in_flight", "This proxy's requests on the node.", ["role", "node"]
        )


class _Timing:
    """One request's latency bookkeeping; ``done`` records it exactly once."""

    def __init__(self, metrics: ProxyMetrics, arrival: float) -> None:
        self.m = metrics
        self.arrival = arrival
        self.last_token: float | None = None
        self.recorded = False
        metrics.running.inc()

    def event(self, event: TokenEvent) -> None:
        """Called for every event of every request: the histograms' children are looked up once."""
        n = len(event.token_ids)
        if not n:
            return
        now = time.monotonic()
        if self.last_token is None:
            self.m.ttft_child.observe(now - self.arrival)
        else:
            gap = (now - self.last_token) / n
            itl = self.m.itl_child
            for _ in range(n):
                itl.observe(gap)
        self.last_token = now

    def done(self, status: int, builder=None) -> None:
        if self.recorded:
            return
        self.recorded = True
        self.m.running.dec()
        self.m.requests.labels(str(status)).inc()
        self.m.e2e.observe(time.monotonic() - self.arrival)
        if builder is not None:
            self.m.prompt_tokens.inc(builder.num_prompt_tokens)
            self.m.cached_tokens.inc(builder.num_cached_tokens)
            self.m.generation_tokens.inc(builder.num_output_tokens)


class ErrorJSON(JSONResponse):
    """An error body, ASCII-escaped so that whatever text it quotes can always be encoded."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def error_response(exc: ProxyError) -> JSONResponse:
    return ErrorJSON(exc.body(), status_code=exc.status, headers=exc.headers)


# -- the gate: auth, in-flight bound, body size ------------------------------------------------

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


def api_key_matches(authorization: bytes, key: str) -> bool:
    """``Authorization: Bearer <key>`` (scheme in any case), compared in constant time."""
    scheme, _, token = authorization.strip().partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key.encode())


class BodyTooLarge(StarletteHTTPException):
    """Raised from ``receive`` when a body outgrows the limit; FastAPI passes it on to its handler."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than the limit of {limit} bytes")


class Gate:
    """ASGI middleware: API key, in-flight bound and body size, checked before a route runs."""

    def __init__(self, app, proxy: Proxy) -> None:
        self.app = app
        self.proxy = proxy

    async def _refuse(self, scope: Scope, send: Send, exc: ProxyError) -> None:
        """Answer a request the gate stops (401, 413, 429), counted like every API request."""
        if scope["path"].startswith("/v1/"):
            self.proxy.metrics.requests.labels(str(exc.status)).inc()
        await error_response(exc)(scope, _nothing, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cfg = self.proxy.config
        path = scope["path"]
        headers = dict(scope["headers"])  # names arrive lower-cased
        authorization = headers.get(b"authorization", b"")
        if cfg.api_key and path.startswith("/v1/") and not api_key_matches(authorization, cfg.api_key):
            await self._refuse(
                scope, send, ProxyError(401, "Incorrect API key provided.", code="invalid_api_key")
            )
            return
        generation = scope["method"] == "POST" and path in GENERATION_PATHS
        if generation and self.proxy.num_inflight >= cfg.max_inflight_requests:
            message = f"the proxy is at its limit of {cfg.max_inflight_requests} requests in flight"
            await self._refuse(scope, send, ProxyError(429, message, code="too_many_requests", retry_after=1))
            return
        if generation and cfg.max_loop_lag_s and not await self.proxy.lag.admit(cfg.admission_wait_s):
            message = (
                f"the proxy is overloaded: its event loop ran {self.proxy.lag.lag * 1000:.0f} ms late for "
                f"{cfg.admission_wait_s:g} s"
            )
            await self._refuse(scope, send, ProxyError(429, message, code="too_many_requests", retry_after=1))
            return
        limit = cfg.max_request_body_bytes
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await self._refuse(scope, send, ProxyError(413, BodyTooLarge(limit).detail))
            return
        received = 0
        started = False

        async def receive_limited() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        async def send_tracked(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        if generation:
            self.proxy.num_inflight += 1
        try:
            await self.app(scope, receive_limited, send_tracked)
        except BodyTooLarge as exc:  # read outside a route's body parsing: answer it here
            if started:
                raise
            await self._refuse(scope, send_tracked, ProxyError(413, exc.detail))
        finally:
            if generation:
                self.proxy.num_inflight -= 1


async def _nothing() -> dict:
    return {"type": "http.disconnect"}


# -- the proxy -------------------------------------------------------------------------------

# Longer prompts are tokenized off the event loop: HF tokenizers release the GIL, and a body
# near max_request_body_bytes takes seconds (1.9 s for 1.2 M characters on this CPU), during
# which every other stream would stall. Shorter ones cost less than the thread hop saves.
THREAD_TOKENIZE_CHARS = 16384


def _num_text_chars(body: CompletionRequest | ChatCompletionRequest) -> int:
    if isinstance(body, ChatCompletionRequest):
        total = 0
        for m in body.messages:
            if isinstance(m.content, str):
                total += len(m.content)
            elif m.content:
                total += sum(len(p.get("text", "")) for p in m.content if isinstance(p.get("text"), str))
        return total
    prompt = body.prompt
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(p) for p in prompt if isinstance(p, str))


class Proxy:
    """A running proxy's state: tokenizer, router, dispatcher, metrics."""

    def __init__(self, config: ProxyConfig, shared_metrics: SharedMetrics | None = None) -> None:
        self.config = config
        self.shared_metrics = shared_metrics  # set in a worker of several: /metrics answers for all
        self.registry = Registry()
        self.metrics = ProxyMetrics(self.registry)
        self.gc = gc_heap.GcMetrics(self.registry)
        self.lag = LoopLag(config.max_loop_lag_s)  # admission by this process's own capacity
        self.metrics.loop_lag.set_function(lambda: self.lag.lag)
        self.metrics.admission_waiting.set_function(lambda: self.lag.num_waiting)
        self.num_inflight = 0  # generation requests past the Gate, streams until their last byte
        self.metrics.admitted.set_function(lambda: self.num_inflight)
        self.tokenizer = None
        self.token_strings = TokenStrings(None)
        self.tool_parser = HERMES  # the tool-call format of the model's chat template
        self.model_id = ""
        self.served_names: tuple[str, ...] = ()
        self.router: Router | None = None
        self.dispatcher: Dispatcher | None = None
        self.started = False

    def current_metrics(self) -> Registry:
        """The registry, with what is read rather than counted as it happens (the collector's
        passes) brought up to date: before every render or snapshot."""
        self.gc.update("proxy", gc_heap.pauses())
        return self.registry

    async def start(self) -> None:
        """Load the tokenizer, wait for the nodes, check the cluster; raises ClusterError."""
        if self.started:
            return
        cfg = self.config
        try:
            source = await asyncio.to_thread(
                resolve_model, ModelConfig(model=cfg.model, cache_dir=cfg.cache_dir)
            )
        except (ValueError, FileNotFoundError) as exc:
            raise ClusterError(f"--model {cfg.model!r}: {exc}") from exc
        if source.tokenizer_dir is not None:
            self.tokenizer = await asyncio.to_thread(load_tokenizer, source.tokenizer_dir)
        self.token_strings = TokenStrings(self.tokenizer)
        self.tool_parser = parser_for_template(getattr(self.tokenizer, "chat_template", None))
        self.model_id = source.model_id
        self.served_names = tuple(dict.fromkeys(n for n in (cfg.served_model_name, source.model_id) if n))
        self.router = Router(
            cfg.prefill_urls,
            cfg.decode_urls,
            make_http_client,
            cfg.cluster_token,
            POLICIES[cfg.routing](),
            cfg.load_poll_interval_s,
            both_urls=cfg.both_urls,
            redis_url=cfg.redis_url,
            index_timeout_s=cfg.prefix_index_timeout_s,
        )
        try:
            await self.router.start(source.model_id, cfg.startup_timeout_s)
        except BaseException:
            await self.router.close()
            raise
        for node in self.router.nodes:
            self.metrics.node_up.labels(node.role, node.url).set_function(lambda n=node: float(n.available))
            self.metrics.node_inflight.labels(node.role, node.url).set_function(lambda n=node: n.num_inflight)
        self.dispatcher = Dispatcher(
            self.router,
            self.registry,
            cfg.lease_s,
            cfg.admission_wait_s,
            cfg.min_remote_prefill_tokens,
            cfg.routing,
            max_migrations=cfg.max_migrations,
            overlap_reserve=cfg.overlap_reserve,
        )
        if cfg.max_loop_lag_s:
            self.lag.start()
        self.started = True
        logger.info(
            "proxy ready: model %s (served as %s), max_model_len %d, %d prefill and %d decode nodes",
            self.model_id,
            self.served_names[0],
            self.router.max_model_len,
            len(self.router.prefill),
            len(self.router.decode),
        )

    async def close(self) -> None:
        await self.lag.stop()
        if self.dispatcher is not None:
            await self.dispatcher.close()
        if self.router is not None:
            await self.router.close()
        self.started = False

    # -- request handling --------------------------------------------------------------------

    def _prompts(
        self, body: CompletionRequest | ChatCompletionRequest, tools: ToolPlan | None = None
    ) -> list[tuple[list[int], str]]:
        """Token ids of each prompt, and the text echo=true puts in front of its outputs."""
        tok = self.tokenizer
        if isinstance(body, ChatCompletionRequest):
            messages = chat_messages(body)
            if tok is None:
                raise bad_request(f"model {self.model_id} has no tokenizer, so no chat template", "messages")
            try:
                text = apply_chat_template(
                    tok, messages, body.add_generation_prompt, tools.tools if tools is not None else None
                )
            except Exception as exc:  # jinja errors: roles that do not alternate, and the like
                raise bad_request(f"the chat template failed: {exc}", "messages") from None
            return [(tok.encode(text, add_special_tokens=False), "")]
        return [self._completion_prompt(prompt, body.echo) for prompt in completion_prompts(body)]

    def _completion_prompt(self, prompt: str | list[int], echo: bool) -> tuple[list[int], str]:
        tok = self.tokenizer
        if isinstance(prompt, str):
            if tok is None:
                raise bad_request(
                    f"model {self.model_id} has no tokenizer: send the prompt as token ids", "prompt"
                )
            ids = tok.encode(prompt, add_special_tokens=True)
            if not ids:
                raise bad_request("the prompt is empty", "prompt")
            return ids, prompt if echo else ""
        check_token_ids(prompt, self.router.vocab_size)
        text = tok.decode(prompt) if echo and tok is not None else ""
        return list(prompt), text

    async def generate(self, body: CompletionRequest | ChatCompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        timing = _Timing(self.metrics, arrival)
        chat = isinstance(body, ChatCompletionRequest)
        try:
            model = check_model(body.model, self.served_names)
            tools = tool_plan(body, self.tool_parser) if chat else None
            constraint = structured_outputs(body)
            if tools is not None and tools.constraint is not None:
                if constraint is not None:
                    raise bad_request(
                        f"tool_choice {tools.mode!r} constrains the output itself: drop response_format "
                        "and structured_outputs",
                        "tool_choice",
                    )
                constraint = tools.constraint
            if _num_text_chars(body) > THREAD_TOKENIZE_CHARS:
                prompts = await asyncio.to_thread(self._prompts, body, tools)
            else:
                prompts = self._prompts(body, tools)
            max_len, default_max = self.router.max_model_len, self.config.default_max_tokens
            params = [sampling_params(body, len(ids), max_len, default_max, constraint) for ids, _ in prompts]
            vocab = self.router.vocab_size
            check_token_ids(params[0].stop_token_ids, vocab, "stop_token_ids")
            check_token_ids(list(params[0].logit_bias or ()), vocab, "logit_bias")
        except ProxyError as exc:
            timing.done(exc.status)
            return error_response(exc)
        request_id = uuid.uuid4().hex
        first = params[0]
        kwargs: dict[str, Any] = dict(
            stream=body.stream,
            include_usage=body.include_usage,
            logprobs=first.logprobs,
            token_strings=self.token_strings,
            n=first.n,
            num_sequences=first.num_sequences,
            num_prompts=len(prompts),
        )
        num_prompt_tokens = sum(len(ids) for ids, _ in prompts)
        if chat:
            if tools is not None and tools.mode != "none":
                kwargs["tools"] = tools
            builder = ChatBuilder(
                f"chatcmpl-{request_id}", model, int(time.time()), num_prompt_tokens, **kwargs
            )
        else:
            builder = CompletionBuilder(
                f"cmpl-{request_id}",
                model,
                int(time.time()),
                num_prompt_tokens,
                echo_texts=[echo for _, echo in prompts],
                prompt_token_ids=None if first.prompt_logprobs is None else [ids for ids, _ in prompts],
                **kwargs,
            )
        deadline = arrival + self.config.request_timeout_s
        if len(prompts) == 1:
            gen = self.dispatcher.start(request_id, prompts[0][0], first, deadline)
        else:
            gens = [
                self.dispatcher.start(f"{request_id}-{i}", ids, p, deadline)
                for i, ((ids, _), p) in enumerate(zip(prompts, params))
            ]
            gen = GenerationBatch(request_id, gens, first.num_sequences)
        headers = {"x-request-id": request_id}
        try:
            if body.stream:
                # Wait for the first token before answering, so that everything that can fail
                # before it (capacity, the prefill) still gets a proper HTTP status.
                first_event = await until_disconnected(gen.next(), request.receive)

                def on_close() -> None:
                    gen.cancel()
                    timing.done(CLIENT_GONE, builder)  # no-op unless the body never ran

                async def body(write: Write) -> None:
                    await self._stream(gen, builder, timing, first_event, write)

                return EventStream(body, headers, on_close)
            await until_disconnected(self._collect(gen, builder, timing), request.receive)
        except ClientGone:
            gen.cancel()
            timing.done(CLIENT_GONE, builder)
            return Response(status_code=CLIENT_GONE)
        except ProxyError as exc:
            timing.done(exc.status, builder)
            return error_response(exc)
        except BaseException:
            gen.cancel()
            timing.done(500, builder)
            raise
        self._fill_cached(gen, builder)
        timing.done(200, builder)
        return Response(builder.response().model_dump_json(), media_type="application/json", headers=headers)

    @staticmethod
    def _fill_cached(gen: Generation | GenerationBatch, builder) -> None:
        # The decode node reports cached tokens on its events; the prefill node's own count
        # stands in if an event stream carried none.
        generations = gen.generations if isinstance(gen, GenerationBatch) else [gen]
        for prompt, g in enumerate(generations):
            if g.prefill_result is not None:
                builder.note_cached(prompt, g.prefill_result.num_cached_tokens)

    async def _collect(self, gen: Generation, builder, timing: _Timing) -> None:
        while (event := await gen.next()) is not None:
            timing.event(event)
            builder.add(event)

    async def _stream(
        self, gen: Generation, builder, timing: _Timing, first: TokenEvent | None, write: Write
    ) -> None:
        """The per-token path of a streaming request: one chunk built and one write per event."""
        status = CLIENT_GONE
        try:
            for chunk in builder.start():
                await write(chunk)
            event = first
            failure: Exception | None = None  # of the request (not of a write: the client left)
            while event is not None:
                try:
                    timing.event(event)
                    chunk = builder.add(event)
                except Exception as exc:
                    failure = exc
                    break
                if chunk is not None:
                    await write(chunk)
                try:
                    event = await gen.next()
                except Exception as exc:
                    failure = exc
                    break
            if failure is not None:
                exc = failure
                if not isinstance(exc, ProxyError):
                    logger.error("streaming request %s failed", gen.request_id, exc_info=exc)
                    exc = ProxyError(500, f"internal error: {type(exc).__name__}: {exc}")
                status = exc.status
                gen.cancel()
                await write(sse(exc.body()))
                await write(SSE_DONE)
                return
            self._fill_cached(gen, builder)
            for chunk in builder.finish():
                await write(chunk)
            status = 200
        finally:
            if status == CLIENT_GONE:
                gen.cancel()
            timing.done(status, builder)

    # -- other endpoints ---------------------------------------------------------------------

    def models(self) -> ModelList:
        created = int(time.time())
        # Requests may also name the model id; the list shows the served name only, as vLLM does.
        max_len = self.router.max_model_len
        card = ModelCard(id=self.served_names[0], created=created, root=self.model_id, max_model_len=max_len)
        return ModelList(data=[card])

    async def health(self) -> Response:
        """200 when a decode (or co-located) node answers /health: requests can be served, by a
        prefill node or, with none left, on the decode node itself."""
        usable = [n for n in self.router.decode if not n.incompatible]
        answers = await asyncio.gather(*(n.client.health() for n in usable))
        if not any(answers):
            return JSONResponse(error_body(503, "no healthy decode node"), status_code=503)
        return Response(status_code=200)


# -- the app ---------------------------------------------------------------------------------


def _validation_message(exc: RequestValidationError, content_type: str) -> tuple[str, str | None]:
    parts = []
    param = None
    for err in exc.errors():
        kind = err.get("type")
        if kind == "json_invalid":
            return f"the body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}", None
        if kind == "invalid_unicode":
            return err.get("msg", "invalid Unicode"), err.get("ctx", {}).get("param")
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if not loc and kind in ("model_attributes_type", "dict_type", "missing"):
            if "json" not in content_type:
                sent = f"not {content_type!r}" if content_type else "with no Content-Type"
                return f"the body must be a JSON object sent as application/json, {sent}", None
            return "the body must be a JSON object", None
        if param is None and loc:
            param = ".".join(loc)
        parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')}")
    return "; ".join(parts) or "invalid request", param


def create_app(config: ProxyConfig, proxy: Proxy | None = None) -> FastAPI:
    """The proxy's ASGI app. Start-up (the lifespan) raises ``ClusterError`` when the nodes
    cannot be reached in time or disagree; pass a started ``proxy`` to skip that step."""
    proxy = proxy or Proxy(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        owned = not proxy.started
        await proxy.start()
        try:
            yield
        finally:
            if owned:
                await proxy.close()

    app = FastAPI(title="pdserve", lifespan=lifespan)
    app.state.proxy = proxy
    app.add_middleware(Gate, proxy=proxy)

    def _count(request: Request, status: int) -> None:
        """Errors before a route ran (bad body, unknown path or method) of any API request."""
        if request.url.path.startswith("/v1/"):
            proxy.metrics.requests.labels(str(status)).inc()

    @app.exception_handler(ProxyError)
    async def _proxy_error(request: Request, exc: ProxyError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc, request.headers.get("content-type", ""))
        _count(request, 400)
        return ErrorJSON(error_body(400, message, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        message = str(exc.detail)
        cause = exc.__cause__
        if isinstance(cause, UnicodeDecodeError):
            message = f"the body is not valid UTF-8: {cause.reason} at byte {cause.start}"
        elif isinstance(cause, RecursionError):
            message = "the body is nested too deeply"
        elif cause is not None:
            message = f"the body could not be parsed: {type(cause).__name__}: {cause}"
        if exc.status_code >= 400:
            _count(request, exc.status_code)
        status = exc.status_code
        return ErrorJSON(error_body(status, message), status_code=status, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        # Starlette logs the traceback after this answers; the client gets an OpenAI body.
        return ErrorJSON(error_body(500, f"internal error: {type(exc).__name__}"), status_code=500)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await proxy.generate(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await proxy.generate(body, request)

    @app.get("/v1/models")
    async def models() -> Response:
        return Response(proxy.models().model_dump_json(), media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        return await proxy.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        shared, registry = proxy.shared_metrics, proxy.current_metrics()
        text = shared.render(registry) if shared is not None else registry.render()
        return Response(text, media_type=CONTENT_TYPE)

    return app

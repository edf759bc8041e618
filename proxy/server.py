"""Running the proxy: ``serve`` in the foreground (``pdserve proxy``), ``ProxyServer`` in a
background thread (``pdserve up``, tests).

Both start the proxy (tokenizer, node info, compatibility check) before uvicorn listens,
so a ``ClusterError`` comes out of ``serve``/``ProxyServer.start`` as a plain exception
instead of a traceback in uvicorn's log and exit status 3.

Graceful shutdown (``serve``): the first SIGTERM or SIGINT closes the listening socket (new
connections are refused) and answers 503 to new requests on open keep-alive connections; requests
in flight, streams included, run to their end, for at most ``shutdown_timeout_s``; those still
running then end with an OpenAI-style error (an error event and ``[DONE]`` on a stream), their
requests aborted on the nodes; then uvicorn shuts down and the process exits with status 0. A
second signal ends the requests in flight at once, a third exits without waiting for anything.

uvicorn's own ``timeout_graceful_shutdown`` is no drain: it waits for open connections (streams
included) but cancels them at its timeout, which cuts a stream off without an error event, and it
re-raises the signal after shutdown, so the process dies by it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Coroutine
from types import FrameType
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve import gc_heap
from pdserve.proxy.app import RAW_SEND, Proxy, create_app
from pdserve.proxy.config import ProxyConfig
from pdserve.proxy.protocol import error_body
from pdserve.proxy.responses import SSE_DONE, sse
from pdserve.proxy.workers import SNAPSHOT_INTERVAL_S, SharedMetrics, run_workers

logger = logging.getLogger(__name__)

FLUSH_TIMEOUT_S = 5.0
"""How long requests ended by a drain get to send their error."""
SHUTTING_DOWN = "the proxy is shutting down"


class InFlight:
    """ASGI middleware that keeps count of the HTTP requests in flight for a drain: while draining,
    new requests get 503; ``end_all`` cancels those left and finishes their responses with an
    error (an SSE error event and ``[DONE]`` when a stream has started)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.draining = False
        self._ending = False
        self._inner: set[asyncio.Task] = set()  # the app's calls still running
        self._active = 0  # requests whose response is not over (their error included)
        self._idle = asyncio.Event()

    @property
    def num_inflight(self) -> int:
        return self._active

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.draining:
            await _send_error(send, None, SHUTTING_DOWN)
            return
        sent: dict[str, Message | bool | None] = {"start": None, "done": False}

        async def tracked_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                sent["start"] = message
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                sent["done"] = True
            await send(message)

        self._active += 1
        self._idle.clear()
        scope[RAW_SEND] = send  # a stream's token chunks skip the middlewares' wrappers (app.RAW_SEND)
        inner = asyncio.ensure_future(self.app(scope, receive, tracked_send))
        self._inner.add(inner)
        try:
            try:
                await asyncio.wait({inner})
            except asyncio.CancelledError:  # the server gave up on this request
                inner.cancel()
                raise
            finally:
                self._inner.discard(inner)
            if self._ending and not sent["done"]:
                with contextlib.suppress(Exception):
                    await _send_error(send, sent["start"], "the proxy shut down before the request finished")
                if inner.cancelled():
                    return
            inner.result()  # the app's own exception, if any
        finally:
            self._active -= 1
            if self._active == 0:
                self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        if self._active == 0:
            return True
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
        return self._active == 0

    async def end_all(self, timeout: float = FLUSH_TIMEOUT_S) -> int:
        """Cancel the requests in flight (the app aborts them on the nodes) and send each its error."""
        self._ending = True
        n = len(self._inner)
        for task in list(self._inner):
            task.cancel()
        await self.wait_idle(timeout)
        return n


async def _send_error(send: Send, start: Message | None, message: str) -> None:
    """End a response with a 503 error: whole when nothing was sent, else as the last SSE event."""
    if start is None:
        body = json.dumps(error_body(503, message)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})
        return
    headers = dict(start.get("headers", []))
    body = b""
    if headers.get(b"content-type", b"").startswith(b"text/event-stream"):
        body = sse(error_body(503, message)) + SSE_DONE
    await send({"type": "http.response.body", "body": body, "more_body": False})


class DrainingServer(uvicorn.Server):
    """uvicorn's server, with a drain of ``InFlight`` before its own shutdown (see the module
    docstring); signals reach it in the main thread only."""

    def __init__(self, config: uvicorn.Config, inflight: InFlight, shutdown_timeout_s: float) -> None:
        super().__init__(config)
        self.inflight = inflight
        self.shutdown_timeout_s = shutdown_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None
        self._now = asyncio.Event()
        self._signals = 0

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: it may interrupt the event loop anywhere, so it only schedules work.
        self._signals += 1
        if self._loop is None or not self.started or self._signals > 2:
            self.should_exit = True
            self.force_exit = self._signals > 2
            return
        self._loop.call_soon_threadsafe(self.begin_drain)

    def begin_drain(self) -> None:
        """Start the drain; called again, end the requests in flight now."""
        if self._drain is None:
            self._drain = asyncio.ensure_future(self._drain_then_exit())
        else:
            logger.warning("second signal: ending the requests in flight now")
            self._now.set()

    async def _drain_then_exit(self) -> None:
        try:
            self.inflight.draining = True
            for server in self.servers:
                server.close()  # new connections are refused from here on
            timeout = self.shutdown_timeout_s
            logger.info(
                "draining: %d request(s) in flight, waiting up to %.0f s", self.inflight.num_inflight, timeout
            )
            give_up = time.monotonic() + timeout
            while self.inflight.num_inflight and not self._now.is_set():
                left = give_up - time.monotonic()
                if left <= 0:
                    break
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._now.wait(), min(0.1, left))
            if self.inflight.num_inflight:
                n = await self.inflight.end_all()
                logger.warning("drain: ended %d request(s) still in flight with an error", n)
        except Exception:
            logger.exception("drain failed")
        finally:
            self.should_exit = True


def _uvicorn_config(
    config: ProxyConfig, proxy: Proxy, log_level: str, app: ASGIApp | None = None
) -> uvicorn.Config:
    return uvicorn.Config(
        app or create_app(config, proxy),
        host=config.host,
        port=config.port,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
    )


async def serve_async(
    config: ProxyConfig,
    log_level: str = "info",
    sockets: list[socket.socket] | None = None,
    shared: SharedMetrics | None = None,
    ready: Callable[[], None] | None = None,
) -> None:
    """Run one proxy until a signal and its drain. A worker of several (workers.py) passes the
    listening socket it inherited, its side of the shared /metrics, and ``ready`` to call once it
    serves."""
    proxy = Proxy(config, shared_metrics=shared)
    await proxy.start()
    publisher = asyncio.ensure_future(_publish_metrics(proxy, shared)) if shared is not None else None
    try:
        inflight = InFlight(create_app(config, proxy))
        uv_config = _uvicorn_config(config, proxy, log_level, inflight)
        server = DrainingServer(uv_config, inflight, config.shutdown_timeout_s)
        serving = asyncio.ensure_future(server.serve(sockets))
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)
        if server.started:
            gc_heap.freeze()  # started: the tokenizer, the app and the router stay for the process's life
            gc_heap.track()
            if ready is not None:
                ready()
        await serving
    finally:
        if publisher is not None:
            publisher.cancel()
        await proxy.close()


async def _publish_metrics(proxy: Proxy, shared: SharedMetrics) -> None:
    while True:
        try:
            shared.publish(proxy.current_metrics())
        except OSError:
            logger.warning("could not write this worker's metrics snapshot", exc_info=True)
        await asyncio.sleep(SNAPSHOT_INTERVAL_S)


def run_loop(main: Coroutine[Any, Any, None]) -> None:
    """``asyncio.run`` on uvloop where it is installed, as uvicorn's ``loop="auto"`` and vLLM's API
    server do: its loop, futures and socket writes cost a fraction of asyncio's, on every token."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)


def serve(config: ProxyConfig, log_level: str = "info") -> int:
    """Run the proxy until SIGINT/SIGTERM, then drain (module docstring); with ``config.workers``
    above 1, as that many worker processes on the port (workers.py). Raises ``ClusterError``
    before listening when the nodes do not answer within ``startup_timeout_s`` or are incompatible
    (one worker), or returns a non-zero status (several). Returns the exit status."""
    if config.workers > 1:
        return run_workers(config, log_level)
    run_loop(serve_async(config, log_level))
    return 0


class ProxyServer:
    """The proxy on its own event loop in a daemon thread.

    ``start()`` returns once it listens (``port`` is then the bound port, useful with port 0)
    or raises what stopped it; ``stop()`` shuts it down. Usable as a context manager.
    """

    def __init__(self, config: ProxyConfig, log_level: str = "warning") -> None:
        self.config = config
        self.log_level = log_level
        self.port: int | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._server: uvicorn.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def start(self, timeout: float | None = None) -> ProxyServer:
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._main()), name="pdserve-proxy", daemon=True
        )
        self._thread.start()
        if not self._ready.wait(timeout if timeout is not None else self.config.startup_timeout_s + 60):
            self.stop()
            raise TimeoutError("the proxy did not start in time")
        if self._error is not None:
            self._thread.join()
            raise self._error
        return self

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        proxy = Proxy(self.config)
        try:
            await proxy.start()
            self._server = uvicorn.Server(_uvicorn_config(self.config, proxy, self.log_level))
            serving = asyncio.ensure_future(self._server.serve())
            while not self._server.started and not serving.done():
                await asyncio.sleep(0.01)
            if serving.done():
                serving.result()
                raise RuntimeError(f"the proxy could not listen on {self.config.host}:{self.config.port}")
            self.port = self._server.servers[0].sockets[0].getsockname()[1]
        except BaseException as exc:  # handed to the thread that called start()
            if isinstance(exc, SystemExit):  # uvicorn exits when it cannot bind
                exc = RuntimeError(f"the proxy could not listen on {self.config.host}:{self.config.port}")
            self._error = exc
            self._ready.set()
            await proxy.close()
            return
        self._ready.set()
        try:
            await serving
        finally:
            await proxy.close()

    def stop(self) -> None:
        if self._server is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(setattr, self._server, "should_exit", True)
        if self._thread is not None:
            self._thread.join(timeout=30)

    def __enter__(self) -> ProxyServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

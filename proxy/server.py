"""Running the proxy: ``serve`` in the foreground (``pdserve proxy``), ``ProxyServer`` in a
background thread (``pdserve up``, tests).

Both start the proxy (tokenizer, node info, compatibility check) before uvicorn listens,
so a ``ClusterError`` comes out of ``serve``/``ProxyServer.start`` as a plain exception
instead of a traceback in uvicorn's log and exit status 3.
"""

from __future__ import annotations

import asyncio
import threading

import uvicorn

from proxy.app import Proxy, create_app
from proxy.config import ProxyConfig


def _uvicorn_config(config: ProxyConfig, proxy: Proxy, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(
        create_app(config, proxy),
        host=config.host,
        port=config.port,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
    )


async def serve_async(config: ProxyConfig, log_level: str = "info") -> None:
    proxy = Proxy(config)
    await proxy.start()
    try:
        await uvicorn.Server(_uvicorn_config(config, proxy, log_level)).serve()
    finally:
        await proxy.close()


def serve(config: ProxyConfig, log_level: str = "info") -> None:
    """Run the proxy until SIGINT/SIGTERM. Raises ``ClusterError`` before listening when the
    nodes do not answer within ``startup_timeout_s`` or are incompatible."""
    asyncio.run(serve_async(config, log_level))


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

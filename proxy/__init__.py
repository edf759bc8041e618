"""OpenAI-compatible HTTP front of a pdserve cluster: tokenization, routing, streaming relay.

``serve(ProxyConfig(...))`` runs it in the foreground; ``ProxyServer`` in a background
thread; ``create_app`` gives the ASGI app. Modules: ``config`` (ProxyConfig), ``protocol``
(OpenAI request/response models, validation into SamplingParams), ``responses`` (events to
responses and SSE chunks), ``router`` (nodes, compatibility check, load polling, routing
policies), ``node_client`` (the nodes' internal API), ``dispatch`` (one request's trip
through a decode and a prefill node), ``app`` (handlers), ``server`` (uvicorn).
"""

from pdserve.proxy.config import ProxyConfig
from pdserve.proxy.router import ClusterError

__all__ = ["ClusterError", "ProxyConfig", "ProxyServer", "create_app", "serve"]


def __getattr__(name: str):
    # The app pulls in FastAPI, torch and transformers; import it only when asked.
    if name == "create_app":
        from pdserve.proxy.app import create_app

        return create_app
    if name in ("serve", "ProxyServer"):
        from pdserve.proxy import server

        return getattr(server, name)
    raise AttributeError(f"module 'proxy' has no attribute {name!r}")

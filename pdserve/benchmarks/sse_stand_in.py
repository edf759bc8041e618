"""A stand-in OpenAI-compatible server that streams known SSE chunks at known times, for next to no CPU.

It answers ``GET /health`` and ``GET /v1/models``, and a streamed ``POST /v1/completions`` or
``/v1/chat/completions`` with the events of ``script(body, chat)``: (delay before it in seconds, SSE
data payload) pairs, each sent as one HTTP/1.1 chunk (as uvicorn sends what a StreamingResponse
yields), then ``[DONE]``. The default script is pdserve's own byte layout (``proxy/responses.py``):
``max_tokens`` text chunks ``--interval-ms`` apart, the last with ``finish_reason`` ``length``, then
the usage chunk. Tests use it to pin what ``pdserve bench serve`` records for a known stream;
``serve_client_cpu`` uses it to measure the load client's CPU per token with nothing else busy.

    python -m pdserve.benchmarks.sse_stand_in --port 8011 --interval-ms 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Callable

Script = Callable[[dict, bool], list[tuple[float, str | None]]]
"""(request body, chat?) -> (delay before it in seconds, SSE data payload; None drops the connection)."""


def pdserve_script(interval_s: float) -> Script:
    """pdserve's chunks for a request of ``max_tokens``: one token (" t") per ``interval_s``."""

    def script(body: dict, chat: bool) -> list[tuple[float, str | None]]:
        n = int(body.get("max_tokens") or 16)
        head = '{"id":"cmpl-0","object":"%s","created":0,"model":"m","choices":[{"index":0,' % (
            "chat.completion.chunk" if chat else "text_completion"
        )
        events = []
        for i in range(n):
            finish = '"length"' if i == n - 1 else "null"
            if chat:
                text = '"delta":{"content":" t"},"logprobs":null'
            else:
                text = '"text":" t","logprobs":null'
            events.append((interval_s, f'{head}{text},"finish_reason":{finish},"stop_reason":null}}]}}'))
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}
            events.append((0.0, json.dumps({"id": "cmpl-0", "choices": [], "usage": usage})))
        return events

    return script


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, bytes] | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    body = await reader.readexactly(length) if length else b""
    return method, path, body


def _plain(status: str, payload: dict) -> bytes:
    body = json.dumps(payload).encode()
    head = f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    return head.encode() + body


STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _chunk(data: str) -> bytes:
    payload = b"data: " + data.encode() + b"\n\n"
    return b"%x\r\n%b\r\n" % (len(payload), payload)


async def _handle(script: Script, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while (request := await _read_request(reader)) is not None:
            method, path, body = request
            if method == "GET" and path == "/health":
                writer.write(_plain("200 OK", {}))
            elif method == "GET" and path == "/v1/models":
                writer.write(_plain("200 OK", {"object": "list", "data": [{"id": "m", "object": "model"}]}))
            elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
                events = script(json.loads(body), path.endswith("chat/completions"))
                writer.write(STREAM_HEAD)
                for delay, data in events:
                    if delay > 0:
                        await writer.drain()
                        await asyncio.sleep(delay)
                    if data is None:  # the connection drops mid-stream
                        writer.transport.abort()
                        return
                    writer.write(_chunk(data))
                writer.write(_chunk("[DONE]") + b"0\r\n\r\n")
            else:
                writer.write(_plain("404 Not Found", {"error": {"message": f"no route {method} {path}"}}))
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


async def start(script: Script, host: str = "127.0.0.1", port: int = 0) -> asyncio.Server:
    """Listen on ``host:port`` (0: a free port; read it from ``server.sockets``)."""
    return await asyncio.start_server(lambda r, w: _handle(script, r, w), host, port)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--interval-ms", type=float, default=20.0, help="between two text chunks of a stream")
    args = p.parse_args(argv)

    async def serve() -> None:
        server = await start(pdserve_script(args.interval_ms / 1000), args.host, args.port)
        async with server:
            await server.serve_forever()

    try:
        import uvloop

        uvloop.run(serve())
    except ImportError:
        asyncio.run(serve())


if __name__ == "__main__":
    main()

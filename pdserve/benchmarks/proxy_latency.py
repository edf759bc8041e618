"""What the proxy adds to a request's latency: one-token requests at concurrency 1, through the
proxy against the nodes' own protocol driven directly, in the same run.

    python -m pdserve.benchmarks.proxy_latency --nodes default --requests 200

Behind both paths sit the same nodes: one prefill and one decode node of the default model on the
CPU (``--nodes default``, a local cluster as ``pdserve up`` starts it, with one proxy worker), or
stand-ins that answer at once (``--nodes stand-in``: ``proxy_alone``'s, whose decode stand-in sends
a stream's one token as soon as it opens), which leaves the proxy's own cost alone in the figures.

- direct: what a proxy worker does for the request, and nothing else, on the nodes' request
  channels (``pdserve.proxy.channel``, a connection each, opened before the clock runs): reserve KV
  blocks on the decode node, then at the same time open the token stream there and send the prefill
  to the prefill node, and wait for the final token event;
- proxy: ``POST /v1/completions`` with the same prompt length, ``max_tokens`` 1 and greedy sampling,
  on a kept-alive connection, until the whole response has arrived (``--stream``: until ``[DONE]``).

The two alternate request by request, each with a prompt of its own (random token ids: no prefix
cache hit on either path). Reported: p50 and p90 of each and their differences (the anchor is the
direct path), and the median of the paired differences (request i of one path against request i
of the other), which real nodes' varying step times disturb less. Writes JSON under
docs/benchmarks/ with ``--output``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from pdserve.benchmarks.proxy_alone import VOCAB, _StandIn, _wait_healthy, serving_stack
from pdserve.utils import free_port


class _ImmediateStandIn(_StandIn):
    """A stand-in whose token stream sends its one event as soon as the stream opens."""

    async def stream(self, peer, req):
        from pdserve.messages import TokenEvent

        self.channel.add_event(
            peer, TokenEvent(req.request_id, [100], " tok", finish_reason="length", num_prompt_tokens=1)
        )
        asyncio.get_running_loop().call_soon(self.channel.flush)  # after the reply to the call


def _run_stand_in(role: str, port: int) -> None:
    async def main() -> None:
        node = _ImmediateStandIn(role, port, 1, 3600.0)
        node.channel.start()
        server = await asyncio.start_server(node.handle, "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
    asyncio.run(main())


# -- the two paths ---------------------------------------------------------------------------------


class Direct:
    """The nodes' protocol, driven as a proxy worker drives it for one request."""

    def __init__(self, prefill_url: str, decode_url: str, token: str) -> None:
        self.urls = (prefill_url, decode_url)
        self.token = token

    async def start(self) -> None:
        from pdserve.proxy.node_client import NodeClient, make_http_client

        self.http = make_http_client()
        self.clients = [NodeClient(url, self.http, self.token) for url in self.urls]
        for client in self.clients:  # as the proxy's router does: the node's info names its channel
            await client.use_info(await client.info())

    async def close(self) -> None:
        for client in self.clients:
            await client.close()

    async def request(self, request_id: str, prompt: list[int]) -> None:
        from pdserve.messages import PrefillRequest, ReserveRequest, StreamRequest
        from pdserve.sampling_params import SamplingParams

        prefill, decode = self.clients
        params = SamplingParams(max_tokens=1, temperature=0.0)
        deadline = time.time() + 60
        landing = await decode.reserve(ReserveRequest(request_id, prompt, params, 30.0, deadline=deadline))
        done = asyncio.get_running_loop().create_future()

        def sink(item) -> None:
            if not done.done():
                if isinstance(item, Exception):
                    done.set_exception(item)
                elif item.finish_reason is not None:
                    done.set_result(item)

        sent = asyncio.ensure_future(
            prefill.prefill(PrefillRequest(request_id, prompt, params, landing, deadline))
        )
        async with decode.stream(StreamRequest(request_id), sink):
            event = await done
        result = await sent
        if not result.ok or event.error:
            raise RuntimeError(f"request {request_id} failed: {result.error or event.error}")


class ThroughProxy:
    """``POST /v1/completions`` on one kept-alive connection, read to the end of the response."""

    def __init__(self, port: int, stream: bool) -> None:
        self.port = port
        self.stream = stream

    async def start(self) -> None:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=10) as r:
            self.model = json.loads(r.read())["data"][0]["id"]  # the name the proxy serves
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)

    async def close(self) -> None:
        self.writer.close()

    async def request(self, request_id: str, prompt: list[int]) -> None:
        body = {"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        body["stream"] = self.stream
        data = json.dumps(body).encode()
        self.writer.write(
            b"POST /v1/completions HTTP/1.1\r\nhost: proxy\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(data), data)
        )
        head = await self.reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            status = head.split(b"\r\n", 1)[0].decode()
            raise RuntimeError(f"the proxy answered {status}")
        headers = head.lower()
        if b"transfer-encoding: chunked" in headers:
            payload = await self.reader.readuntil(b"0\r\n\r\n")  # the chunked body's last chunk
            if b"data: [DONE]" not in payload:
                raise RuntimeError("the stream ended without [DONE]")
        else:
            length = int(headers.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
            payload = await self.reader.readexactly(length)
            if b'"finish_reason":"length"' not in payload:
                raise RuntimeError(f"unexpected response: {payload[:200]!r}")


# -- the run -----------------------------------------------------------------------------------------


def _percentiles(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {
        "p50_ms": statistics.median(s) * 1000,
        "p90_ms": s[int(0.9 * (len(s) - 1))] * 1000,
        "mean_ms": statistics.fmean(s) * 1000,
    }


async def _measure(args, direct: Direct, proxy: ThroughProxy) -> dict[str, list[float]]:
    await direct.start()
    await proxy.start()
    rng = random.Random(0)
    times: dict[str, list[float]] = {"direct": [], "proxy": []}
    try:
        for i in range(args.warmup + args.requests):
            # Alternate which path goes first, so that neither always follows the other.
            order = (
                [("direct", direct), ("proxy", proxy)] if i % 2 else [("proxy", proxy), ("direct", direct)]
            )
            for name, path in order:
                prompt = [rng.randrange(1000, VOCAB) for _ in range(args.prompt_len)]
                started = time.perf_counter()
                await path.request(f"lat-{name}-{i}-{rng.getrandbits(32):08x}", prompt)
                if i >= args.warmup:
                    times[name].append(time.perf_counter() - started)
    finally:
        await proxy.close()
        await direct.close()
    return times


def _with_stand_ins(args) -> tuple[dict[str, list[float]], str]:
    ctx = multiprocessing.get_context("spawn")
    prefill_port, decode_port = free_port(), free_port()
    nodes = [
        ctx.Process(target=_run_stand_in, args=(role, port), daemon=True)
        for role, port in (("prefill", prefill_port), ("decode", decode_port))
    ]
    for p in nodes:
        p.start()
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve", "proxy", "--port", str(port), "--model", "default"]
    cmd += ["--prefill-urls", f"127.0.0.1:{prefill_port}", "--decode-urls", f"127.0.0.1:{decode_port}"]
    proxy = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", proxy)
        direct = Direct(f"http://127.0.0.1:{prefill_port}", f"http://127.0.0.1:{decode_port}", "")
        return asyncio.run(_measure(args, direct, ThroughProxy(port, args.stream))), "stand-in"
    finally:
        proxy.send_signal(signal.SIGTERM)
        proxy.wait(timeout=60)
        for p in nodes:
            p.terminate()


def _with_cluster(args) -> tuple[dict[str, list[float]], str]:
    from pdserve.cluster import ClusterConfig, LocalCluster
    from pdserve.config import ModelConfig

    cfg = ClusterConfig(
        port=free_port(),
        threads_per_node=args.threads_per_node,
        proxy_workers=1,
        redis_url="none",
        cluster_token="proxy-latency",
    )
    flags = [] if args.nodes == "default" else ["--model", args.nodes]
    cluster = LocalCluster(cfg, flags, ModelConfig(model=args.nodes))
    try:
        cluster.start()
        direct = Direct(cluster.node_urls("prefill")[0], cluster.node_urls("decode")[0], cfg.cluster_token)
        return asyncio.run(_measure(args, direct, ThroughProxy(cfg.port, args.stream))), f"model {args.nodes}"
    finally:
        cluster.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.benchmarks.proxy_latency", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--nodes",
        default="default",
        help='"stand-in", or the model of real nodes (default: the default model)',
    )
    p.add_argument("--requests", type=int, default=200, help="measured requests on each path")
    p.add_argument("--warmup", type=int, default=20, help="requests on each path before measuring")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--stream", action="store_true", help="streamed requests through the proxy")
    p.add_argument("--threads-per-node", type=int, default=1, help="torch threads of each real node")
    p.add_argument("--output", default="", help="JSON path (default: print only)")
    args = p.parse_args(argv)
    times, nodes = _with_stand_ins(args) if args.nodes == "stand-in" else _with_cluster(args)
    direct, proxy = _percentiles(times["direct"]), _percentiles(times["proxy"])
    added = {k: proxy[k] - direct[k] for k in direct}
    # The two paths alternate, so request i of each ran under the same conditions: the median of
    # the pairs' differences is the steadier figure where the nodes' own times vary (real models).
    pairs = [p - d for p, d in zip(times["proxy"], times["direct"])]
    added["paired_p50_ms"] = statistics.median(pairs) * 1000
    print(
        f"nodes: {nodes}, {args.requests} one-token requests on each path, concurrency 1, "
        f"prompt {args.prompt_len} tokens"
    )
    for name, row in (("direct", direct), ("proxy", proxy), ("added", added)):
        print(
            f"{name:7s} p50 {row['p50_ms']:8.3f} ms  p90 {row['p90_ms']:8.3f} ms  "
            f"mean {row['mean_ms']:8.3f} ms"
        )
    print(f"added, median of the paired differences: {added['paired_p50_ms']:.3f} ms")
    result = {
        "benchmark": "proxy_latency",
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(
            ["python -m pdserve.benchmarks.proxy_latency", *(argv if argv is not None else sys.argv[1:])]
        ),
        "host": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "packages": serving_stack(),
        },
        "anchor": "the nodes' own protocol driven directly, alternating with the proxy's requests",
        "nodes": nodes,
        "settings": vars(args),
        "direct": direct,
        "proxy": proxy,
        "added": added,
        "samples_s": times,
    }
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

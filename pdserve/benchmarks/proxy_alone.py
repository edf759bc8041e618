"""The proxy alone: how many output tokens a second the proxy relays, and its CPU per token.

    python -m pdserve.benchmarks.proxy_alone --workers 1,8 --concurrency 16,64,128,256

Stand-in nodes that cost almost nothing sit behind a real proxy (``pdserve proxy``), and clients
that are not the limit load it:

- One stand-in prefill node answers every prefill at once; D stand-in decode nodes answer every
  reserve at once and, like an engine stepping every ``--interval-ms``, send each open token stream
  one token event per step, ``--tokens`` of them (the last with ``finish_reason`` length). Each
  stand-in is a process of its own: info, load and health on raw asyncio sockets, the request
  path on the node's own request channel, token events batched per step as a real node sends them.
- C client processes hold ``concurrency`` streams open in a closed loop: each sends a streamed
  ``/v1/completions`` request (a prompt of ``--prompt-len`` token ids), counts the SSE token
  events as they arrive on a raw socket and sends the next request when ``[DONE]`` comes.

Per point (workers x concurrency), over ``--duration-s`` after a warm-up: output tok/s relayed (token
events the clients received per second of wall time), against what the stand-ins offer
(``concurrency`` x 1000 / interval when nothing waits); proxy CPU seconds per token (the proxy's
processes from /proc: with --workers, the supervisor and every worker); a stream's wall time p50
and p90 against its ideal (tokens x interval); and requests that failed or migrated (a busy proxy
must never take its own slowness for a dead node). The anchor is the one-worker proxy measured in
the same run; ``workers_over_one`` is each point's tok/s over the one-worker figure at the same
concurrency. Writes JSON under docs/benchmarks/ (``--output``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from pdserve.utils import child_pids, free_port

GRACE_S = 5.0
"""After the measured window, how long a client waits for the streams it has open."""
MODEL = "SmolLM2-135M-Instruct"  # the default model's id: the proxy loads its tokenizer
VOCAB = 49152


# -- stand-in nodes -----------------------------------------------------------------------------


def _node_info(role: str, port: int, channel_port: int):
    from pdserve.config import Role
    from pdserve.messages import NodeInfo

    return NodeInfo(
        node_id=f"stand-in-{role}-{port}",
        role=Role(role),
        model_id=MODEL,
        dtype="bfloat16",
        block_size=16,
        num_layers=32,
        num_kv_heads=8,
        head_dim=128,
        kv_layout="L,NB,2,BS,Hkv,D",
        kv_transport="zmq",
        kv_address="tcp://127.0.0.1:1" if role == "decode" else "",
        max_model_len=8192,
        vocab_size=VOCAB,
        kv_transports=["zmq"],
        channel_port=channel_port,
    )


class _StandIn:
    """One stand-in node: info, load and health on a raw HTTP/1.1 server, the request path on
    the node's own request channel (``pdserve.node.channel``), whose token events leave batched
    once per step as a real node's do."""

    def __init__(self, role: str, port: int, tokens: int, interval_s: float) -> None:
        from pdserve.messages import (
            AbortRequest,
            NodeLoad,
            PrefillRequest,
            ReserveRequest,
            StreamRequest,
            encode,
        )
        from pdserve.node.channel import ChannelServer

        self.role = role
        self.tokens = tokens
        self.interval_s = interval_s
        self.channel = ChannelServer("127.0.0.1", 0, "", lambda peer, ids: self._lost(ids))
        self.channel.handle(ReserveRequest, self.reserve)
        self.channel.handle(PrefillRequest, self.prefill)
        self.channel.handle(StreamRequest, self.stream)
        self.channel.handle(AbortRequest, self.abort)
        self.info = encode(_node_info(role, port, self.channel.port))
        self.load = encode(
            NodeLoad(running=0, waiting=0, waiting_for_kv=0, free_blocks=1 << 20, total_blocks=1 << 20)
        )
        self.streams: dict[str, list] = {}  # request id -> [peer, tokens sent, prompt tokens]

    async def reserve(self, peer, req):
        from pdserve.messages import LandingDescriptor

        n = len(req.prompt_token_ids)
        blocks = list(range(-(-n // 16)))
        return LandingDescriptor(req.request_id, "stand-in", "tcp://127.0.0.1:1", blocks, n, time.time() + 60)

    async def prefill(self, peer, req):
        from pdserve.messages import PrefillResult

        return PrefillResult(req.request_id, ok=True)

    async def stream(self, peer, req):
        self.streams[req.request_id] = [peer, 0, 128]

    async def abort(self, peer, req):
        self.streams.pop(req.request_id, None)

    def _lost(self, ids: list[str]) -> None:
        for rid in ids:
            self.streams.pop(rid, None)

    async def tick(self) -> None:
        """One engine step: every open stream gets its next token event, one message per peer."""
        from pdserve.messages import TokenEvent

        channel = self.channel
        while True:
            start = time.monotonic()
            for rid, s in list(self.streams.items()):
                peer, sent, prompt = s
                last = sent + 1 == self.tokens
                event = TokenEvent(
                    rid,
                    [100 + sent % 1000],
                    " tok",
                    finish_reason="length" if last else None,
                    num_prompt_tokens=prompt if sent == 0 else 0,
                )
                channel.add_event(peer, event)
                if last:
                    del self.streams[rid]
                else:
                    s[1] = sent + 1
            channel.flush()
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - start)))

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                method, path, _ = line.decode("latin-1").split(" ", 2)
                length = 0
                while True:
                    header = await reader.readline()
                    if header in (b"\r\n", b""):
                        break
                    name, _, value = header.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                if length:
                    await reader.readexactly(length)
                payload = b""
                if path == "/internal/info":
                    payload = self.info
                elif path == "/internal/load":
                    payload = self.load
                elif path == "/health":
                    payload = b"ok"
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/msgpack\r\ncontent-length: %d\r\n\r\n%s"
                    % (len(payload), payload)
                )
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()


def _run_stand_in(role: str, port: int, tokens: int, interval_s: float) -> None:
    async def main() -> None:
        node = _StandIn(role, port, tokens, interval_s)
        node.channel.start()
        server = await asyncio.start_server(node.handle, "127.0.0.1", port, backlog=4096)
        ticker = asyncio.ensure_future(node.tick())
        async with server:
            await server.serve_forever()
        ticker.cancel()

    signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
    asyncio.run(main())


# -- clients -------------------------------------------------------------------------------------


def _run_client(
    port: int, streams: int, prompt_len: int, max_tokens: int, until: float, measure_from: float, out
) -> None:
    async def user(i: int, totals: dict) -> None:
        ids = [(1000 + 7 * i + k) % VOCAB for k in range(prompt_len)]
        body = json.dumps(
            {"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        ).encode()
        request = (
            b"POST /v1/completions HTTP/1.1\r\nhost: proxy\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        reader = writer = None
        while time.monotonic() < until:
            if writer is None:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            started = time.monotonic()
            writer.write(request)
            tail, ok, cut, first = b"", False, False, True
            while True:
                left = until + GRACE_S - time.monotonic()
                try:  # a stream still open GRACE_S after the window is cut off
                    chunk = await asyncio.wait_for(reader.read(65536), max(0.01, left))
                except asyncio.TimeoutError:
                    chunk, cut = b"", True
                if not chunk:
                    break
                if first and not chunk.startswith(b"HTTP/1.1 200"):  # refused (429): as its Retry-After says
                    totals["rejected"] += 1
                    writer.close()
                    writer = None
                    await asyncio.sleep(1.0)
                    break
                first = False
                seen = tail + chunk
                now = time.monotonic()
                if measure_from <= now < until:  # tokens that arrive within the measured window
                    totals["tokens"] += seen.count(b"data: {") - tail.count(b"data: {")
                if b'"error"' in chunk:
                    totals["errors"] += 1
                if b"data: [DONE]" in seen:
                    ok = seen.rstrip().endswith(b"0")  # the chunked body's last chunk follows [DONE]
                    if not ok:
                        try:
                            ok = bool(await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), max(0.01, left)))
                        except (asyncio.TimeoutError, asyncio.IncompleteReadError):
                            cut = True
                    break
                tail = seen[-16:]
            if ok and started >= measure_from:
                totals["streams"] += 1
                totals["durations"].append(time.monotonic() - started)
            elif not ok and writer is not None:
                totals["cut_off" if cut else "failed"] += 1
                writer.close()
                writer = None
        if writer is not None:
            writer.close()

    async def main() -> dict:
        totals = {"tokens": 0, "streams": 0, "failed": 0, "cut_off": 0, "rejected": 0, "errors": 0}
        totals["durations"] = []
        await asyncio.gather(*(user(i, totals) for i in range(streams)))
        return totals

    out.put(asyncio.run(main()))


# -- orchestration -------------------------------------------------------------------------------


def _cpu_seconds(pids: list[int]) -> float:
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def serving_stack() -> dict[str, str | None]:
    """Versions of what the proxy's per-token cost depends on (None: not installed, so not used)."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name in ("uvicorn", "uvloop", "httptools", "fastapi", "pyzmq", "msgspec"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def _get(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the proxy exited with {proc.returncode}")
        try:
            if _get(url + "/health") is not None:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the proxy did not come up")
        time.sleep(0.2)


def run_point(args, prefill_url: str, decode_urls: list[str], workers: int, concurrency: int) -> dict:
    from pdserve.metrics import parse_text

    port = free_port()
    cmd = [sys.executable, "-m", "pdserve", "proxy", "--port", str(port), "--model", "default"]
    cmd += ["--prefill-urls", prefill_url, "--decode-urls", ",".join(decode_urls), "--workers", str(workers)]
    cmd += ["--max-inflight-requests", "100000", "--routing", "least-loaded", *shlex.split(args.proxy_flags)]
    proxy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proxy)
        time.sleep(1.0)  # every worker up (the supervisor's first worker answers /health first)
        ctx = multiprocessing.get_context("spawn")
        out = ctx.Queue()
        clients = min(args.client_processes, concurrency)
        per = [concurrency // clients + (1 if i < concurrency % clients else 0) for i in range(clients)]
        start = time.monotonic() + 2.0  # client processes start in under two seconds
        measure_from = start + args.warmup_s
        until = measure_from + args.duration_s
        procs = [
            ctx.Process(
                target=_run_client,
                args=(port, n, args.prompt_len, args.tokens, until, measure_from, out),
            )
            for n in per
        ]
        for p in procs:
            p.start()
        time.sleep(max(0.0, measure_from - time.monotonic()))
        pids = [proxy.pid, *child_pids(proxy.pid)]  # the supervisor and its workers
        cpu0, t0 = _cpu_seconds(pids), time.monotonic()
        time.sleep(max(0.0, until - time.monotonic()))
        cpu1, t1 = _cpu_seconds(pids), time.monotonic()
        totals = [out.get(timeout=GRACE_S + 60) for _ in procs]
        for p in procs:
            p.join()
        try:  # an overloaded proxy may not answer in time: its migrations are then unknown
            metrics = parse_text(_get(url + "/metrics", timeout=60))
        except OSError:
            metrics = None
    finally:
        proxy.send_signal(signal.SIGTERM)
        try:
            proxy.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proxy.pid, signal.SIGKILL)
            proxy.wait()
    tokens = sum(t["tokens"] for t in totals)
    durations = sorted(d for t in totals for d in t["durations"])
    ideal = args.tokens * args.interval_ms / 1000
    wall = t1 - t0
    return {
        "workers": workers,
        "concurrency": concurrency,
        "output_tok_s": tokens / wall,
        "offered_tok_s": concurrency * 1000 / args.interval_ms,
        "proxy_cpu_s": cpu1 - cpu0,
        "proxy_cores": (cpu1 - cpu0) / wall,
        "proxy_cpu_us_per_token": (cpu1 - cpu0) / tokens * 1e6 if tokens else None,
        "streams_completed": sum(t["streams"] for t in totals),
        "streams_failed": sum(t["failed"] for t in totals),
        "streams_cut_off": sum(t["cut_off"] for t in totals),  # still open GRACE_S after the window
        "requests_rejected": sum(t["rejected"] for t in totals),  # 429: the client waits 1 s, sends again
        "error_events": sum(t["errors"] for t in totals),
        "stream_s_p50": statistics.median(durations) if durations else None,
        "stream_s_p90": durations[int(0.9 * (len(durations) - 1))] if durations else None,
        "stream_ideal_s": ideal,
        "migrations": None
        if metrics is None
        else sum(v for k, v in metrics.items() if k.startswith("pdserve_request_migrations_total")),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.benchmarks.proxy_alone", description=__doc__.split("\n")[0]
    )
    p.add_argument("--workers", default="1,8", help="proxy worker counts, comma-separated; 1 is the anchor")
    p.add_argument("--concurrency", default="16,64,128,256", help="open streams, comma-separated")
    p.add_argument("--tokens", type=int, default=64, help="token events per stream")
    p.add_argument("--interval-ms", type=float, default=10.0, help="the stand-in decode step")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-nodes", type=int, default=4, help="stand-in decode nodes (processes)")
    p.add_argument("--client-processes", type=int, default=4)
    p.add_argument("--warmup-s", type=float, default=2.0)
    p.add_argument("--duration-s", type=float, default=8.0)
    p.add_argument("--proxy-flags", default="", help='more flags for the proxy, e.g. "--max-loop-lag-s 0.05"')
    p.add_argument("--output", default="", help="JSON path (default: print only)")
    args = p.parse_args(argv)
    workers = [int(w) for w in args.workers.split(",")]
    concurrency = [int(c) for c in args.concurrency.split(",")]
    if 1 not in workers:
        workers.insert(0, 1)

    ctx = multiprocessing.get_context("spawn")
    interval_s = args.interval_ms / 1000
    stand_ins = []
    prefill_port = free_port()
    decode_ports = [free_port() for _ in range(args.decode_nodes)]
    for role, port in [("prefill", prefill_port)] + [("decode", q) for q in decode_ports]:
        proc = ctx.Process(target=_run_stand_in, args=(role, port, args.tokens, interval_s), daemon=True)
        proc.start()
        stand_ins.append(proc)
    rows: list[dict] = []
    try:
        time.sleep(1.0)
        prefill_url = f"127.0.0.1:{prefill_port}"
        decode_urls = [f"127.0.0.1:{q}" for q in decode_ports]
        for w in workers:
            for c in concurrency:
                row = run_point(args, prefill_url, decode_urls, w, c)
                rows.append(row)
                print(
                    f"workers {w:2d} streams {c:4d}: {row['output_tok_s']:9.0f} tok/s "
                    f"(offered {row['offered_tok_s']:.0f}), proxy {row['proxy_cores']:.2f} cores, "
                    f"{row['proxy_cpu_us_per_token'] or 0:.0f} us CPU/token, "
                    f"stream p50 {row['stream_s_p50'] or 0:.2f} s "
                    f"(ideal {row['stream_ideal_s']:.2f}), failed {row['streams_failed']}, "
                    f"cut off {row['streams_cut_off']}, rejected {row['requests_rejected']}, "
                    f"migrations {row['migrations']}",
                    flush=True,
                )
                if args.output:  # what is measured so far survives a run cut short
                    _write(args.output, _result(args, argv, rows))
    finally:
        for proc in stand_ins:
            proc.terminate()
    result = _result(args, argv, rows)
    print(json.dumps({"peak_tok_s_by_workers": result["peak_tok_s_by_workers"]}))
    if args.output:
        _write(args.output, result)
    return 0


def _result(args: argparse.Namespace, argv: list[str] | None, rows: list[dict]) -> dict:
    one = {r["concurrency"]: r["output_tok_s"] for r in rows if r["workers"] == 1}
    for r in rows:
        r["workers_over_one"] = (
            r["output_tok_s"] / one[r["concurrency"]] if one.get(r["concurrency"]) else None
        )
    peak = {
        w: max(r["output_tok_s"] for r in rows if r["workers"] == w) for w in {r["workers"] for r in rows}
    }
    return {
        "benchmark": "proxy_alone",
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(
            ["python -m pdserve.benchmarks.proxy_alone", *(argv if argv is not None else sys.argv[1:])]
        ),
        "host": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "packages": serving_stack(),
        },
        "anchor": "the same proxy with one worker, at the same concurrency, in this run",
        "settings": vars(args),
        "peak_tok_s_by_workers": peak,
        "results": rows,
    }


def _write(path: str, result: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())

"""Fault-injection harness: a load generator, fault injectors, result accounting and a table.

A scenario runs ``Load`` (N OpenAI requests from a pool of asyncio workers in a thread of its
own: streaming and not, chat and completions, some abandoned by their client) while the caller
injects a fault; then ``settle`` waits for every surviving node's KV pool to return to its idle
free count and ``probe`` checks that the cluster still serves. Each request is classified:

- completed: 200 with output, or a stream of chunks that ends in ``[DONE]`` without an error event;
- errored: an HTTP error status, an OpenAI error event in the stream, a stream cut before
  ``[DONE]``, or a connection error (expected when the proxy itself dies);
- aborted: its client hung up on purpose (after a few chunks, or a moment into a plain request);
- hung: no end within its deadline plus slack. The reliability rules say this must never happen.

``Relay`` (a TCP relay that cuts random connections) and ``Stutter`` (SIGSTOP/SIGCONT bursts)
are the injectors that need more than a ``kill``. Results go into ``RESULTS`` (printed as a table
by tests/conftest.py at the end of the run) and into a JSON report.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from pdserve.cluster import log_tail
from pdserve.messages import NodeLoad, decode

MODEL = "SmolLM2-135M-Instruct"
COMPLETED, ERRORED, ABORTED, HUNG = "completed", "errored", "aborted", "hung"

RESULTS: list[ScenarioResult] = []
"""Rows recorded by this run's scenarios, in order."""
REPORT_PATH: Path | None = None
"""Where ``record`` writes the JSON report ($PDSERVE_FAULT_REPORT, else set by the tests)."""
KV_TRANSPORT_ENV = "PDSERVE_FAULT_KV_TRANSPORT"
"""The nodes' ``--kv-transport`` (unset: their default, zmq on a CPU host; ``nixl`` runs every
scenario through nixl over DRAM and its lane)."""

WORDS = [
    *("river", "mountain", "engine", "harbor", "garden", "lantern", "signal", "copper", "orbit"),
    *("meadow", "violin", "candle", "compass", "glacier", "market", "thunder", "pepper", "canyon"),
]


# -- results ---------------------------------------------------------------------------------


@dataclass
class ScenarioResult:
    scenario: str
    sent: int = 0
    completed: int = 0
    errored: int = 0
    aborted: int = 0
    hung: int = 0
    leaked_blocks: int = 0
    busy_requests: int = 0  # running + waiting + waiting_for_kv left on nodes after settling
    slowest_s: float = 0.0  # the longest any request took to end (aborted ones aside)
    settle_s: float = 0.0  # from the last request's end until every pool was idle
    probe_s: float = 0.0  # how long the fresh requests after the scenario took (retries included)
    served_after: bool = False
    crashed: list[str] = field(default_factory=list)  # processes that died without being killed
    duration_s: float = 0.0
    errors: dict[str, int] = field(default_factory=dict)  # error kind -> count
    notes: str = ""

    def add(self, outcomes: list[Outcome]) -> None:
        counts = Counter(o.kind for o in outcomes)
        self.sent += len(outcomes)
        self.completed += counts[COMPLETED]
        self.errored += counts[ERRORED]
        self.aborted += counts[ABORTED]
        self.hung += counts[HUNG]
        ended = [o.seconds for o in outcomes if o.kind != ABORTED]
        self.slowest_s = max([self.slowest_s, *ended])
        errors = Counter(self.errors)
        errors.update(o.detail for o in outcomes if o.kind in (ERRORED, HUNG))
        self.errors = dict(errors.most_common())


COLUMNS = (
    ("scenario", "scenario"),
    ("sent", "sent"),
    ("completed", "completed"),
    ("errored", "errored"),
    ("aborted", "aborted"),
    ("hung", "hung"),
    ("leaked_blocks", "leaked blocks"),
    ("served_after", "serves after"),
    ("slowest_s", "slowest s"),
    ("duration_s", "seconds"),
)


def format_table(rows: list[ScenarioResult]) -> str:
    def cell(row: ScenarioResult, key: str) -> str:
        value = getattr(row, key)
        if isinstance(value, bool):
            return "yes" if value else "NO"
        if isinstance(value, float):
            return f"{value:.1f}"
        return str(value)

    table = [[title for _, title in COLUMNS]] + [[cell(r, k) for k, _ in COLUMNS] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS))]

    def fmt(line: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))

    out = [fmt(table[0]), "  ".join("-" * w for w in widths)]
    out += [fmt(line) for line in table[1:]]
    total = ScenarioResult("total")
    for r in rows:
        for key in ("sent", "completed", "errored", "aborted", "hung", "leaked_blocks"):
            setattr(total, key, getattr(total, key) + getattr(r, key))
    total.served_after = all(r.served_after for r in rows)
    total.duration_s = sum(r.duration_s for r in rows)
    total.slowest_s = max([0.0, *(r.slowest_s for r in rows)])
    out += ["  ".join("-" * w for w in widths), fmt([cell(total, k) for k, _ in COLUMNS])]
    for r in rows:
        if r.errors:
            out.append(f"  {r.scenario}:")
            out += [f"    {n:4d} x {k}" for k, n in list(r.errors.items())[:4]]
    return "\n".join(out)


def record(result: ScenarioResult) -> None:
    """Keep a scenario's row for the summary table and rewrite the JSON report."""
    RESULTS.append(result)
    path = Path(os.environ["PDSERVE_FAULT_REPORT"]) if os.environ.get("PDSERVE_FAULT_REPORT") else REPORT_PATH
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"scenarios": [asdict(r) for r in RESULTS]}, indent=1))


# -- load ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """One request of a load: what to send and when (if ever) its client hangs up."""

    index: int
    chat: bool
    stream: bool
    prompt: str
    max_tokens: int
    abort_after_chunks: int = -1  # streaming: hang up after this many chunks; -1: never
    abort_after_s: float = -1.0  # plain: hang up after this many seconds; -1: never
    model: str = MODEL  # the served model name it asks for


@dataclass(frozen=True)
class Outcome:
    spec: Spec
    kind: str
    detail: str = ""
    seconds: float = 0.0


def make_specs(
    num_requests: int,
    seed: int = 0,
    abort_fraction: float = 0.0,
    prompt_words: tuple[int, int] = (4, 24),
    max_tokens: tuple[int, int] = (2, 8),
    model: str = MODEL,
) -> list[Spec]:
    """A seeded mix of chat/completions, streaming or not, short prompts and outputs."""
    rng = random.Random(seed)
    specs = []
    for i in range(num_requests):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*prompt_words)))
        stream = rng.random() < 0.5
        abort = rng.random() < abort_fraction
        specs.append(
            Spec(
                index=i,
                chat=rng.random() < 0.5,
                stream=stream,
                prompt=f"{i}: {words}",
                max_tokens=rng.randint(*max_tokens),
                abort_after_chunks=rng.randint(0, 4) if abort and stream else -1,
                abort_after_s=rng.uniform(0.0, 1.5) if abort and not stream else -1.0,
                model=model,
            )
        )
    return specs


def _body(spec: Spec) -> tuple[str, dict]:
    common = {
        "model": spec.model,
        "max_tokens": spec.max_tokens,
        "temperature": 0.7,
        "ignore_eos": True,
        "stream": spec.stream,
    }
    if spec.chat:
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": spec.prompt}]}
    return "/v1/completions", {**common, "prompt": spec.prompt}


def _error_kind(prefix: str, error: object) -> str:
    """An error's kind for counting: its message without URLs, ids and numbers."""
    message = error.get("message", "") if isinstance(error, dict) else str(error)
    message = re.sub(r"https?://\S+|\d+(\.\d+)?", "#", message)
    return f"{prefix}: {message[:90]}"


def _has_output(body: dict) -> bool:
    choices = body.get("choices") or []
    usage = body.get("usage") or {}
    return (
        bool(choices)
        and choices[0].get("finish_reason") is not None
        and usage.get("completion_tokens", 0) > 0
    )


def _json_error(response: httpx.Response) -> object:
    try:
        return response.json().get("error", "")
    except (ValueError, AttributeError):
        return response.text


class Load:
    """Runs ``specs`` against a proxy from ``concurrency`` asyncio workers in a background thread.

    ``target`` is called for each request, so a scenario can point the rest of a load at a
    restarted proxy. ``deadline_s`` is the proxy's request timeout: a request that has not ended
    ``slack_s`` after it is hung.
    """

    def __init__(
        self,
        target: Callable[[], str],
        specs: list[Spec],
        concurrency: int = 16,
        deadline_s: float = 30.0,
        slack_s: float = 10.0,
    ) -> None:
        self.target = target
        self.specs = specs
        self.concurrency = concurrency
        self.deadline_s = deadline_s
        self.slack_s = slack_s
        self.outcomes: list[Outcome] = []
        self.num_started = 0
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    @property
    def num_finished(self) -> int:
        return len(self.outcomes)

    def start(self) -> Load:
        self._thread.start()
        return self

    def wait(self) -> list[Outcome]:
        """Every request ends by its deadline plus slack, so this is bounded."""
        bound = (len(self.specs) / self.concurrency + 1) * (self.deadline_s + self.slack_s) + 30
        self._thread.join(timeout=bound)
        if self._thread.is_alive():
            raise AssertionError(f"the load generator itself did not finish within {bound:.0f} s")
        return sorted(self.outcomes, key=lambda o: o.spec.index)

    def wait_until(self, predicate: Callable[[], bool], timeout: float = 60.0, what: str = "") -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what or predicate}")
            if not self._thread.is_alive():
                raise AssertionError(f"the load ended before {what or predicate}")
            time.sleep(0.02)

    async def _main(self) -> None:
        queue: asyncio.Queue[Spec] = asyncio.Queue()
        for spec in self.specs:
            queue.put_nowait(spec)
        limits = httpx.Limits(
            max_connections=self.concurrency * 2, max_keepalive_connections=self.concurrency
        )
        timeout = httpx.Timeout(self.deadline_s + self.slack_s + 30, connect=10)
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:

            async def worker() -> None:
                while not queue.empty():
                    spec = queue.get_nowait()
                    self.num_started += 1
                    self.outcomes.append(await self._one(client, spec))

            await asyncio.gather(*(worker() for _ in range(self.concurrency)))

    async def _one(self, client: httpx.AsyncClient, spec: Spec) -> Outcome:
        start = time.monotonic()
        try:
            kind, detail = await asyncio.wait_for(self._send(client, spec), self.deadline_s + self.slack_s)
        except asyncio.TimeoutError:
            kind, detail = HUNG, f"no end in {self.deadline_s + self.slack_s:.0f} s"
        except httpx.HTTPError as exc:
            kind, detail = ERRORED, type(exc).__name__
        return Outcome(spec, kind, detail, time.monotonic() - start)

    async def _send(self, client: httpx.AsyncClient, spec: Spec) -> tuple[str, str]:
        path, body = _body(spec)
        url = self.target() + path
        if not spec.stream:
            request = client.post(url, json=body)
            if spec.abort_after_s >= 0:
                try:
                    response = await asyncio.wait_for(request, spec.abort_after_s)
                except asyncio.TimeoutError:
                    return ABORTED, ""
            else:
                response = await request
            if response.status_code != 200:
                return ERRORED, _error_kind(f"http {response.status_code}", _json_error(response))
            return (COMPLETED, "") if _has_output(response.json()) else (ERRORED, "200 without output")
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return ERRORED, _error_kind(f"http {response.status_code}", _json_error(response))
            chunks = 0
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    return (COMPLETED, "") if chunks else (ERRORED, "[DONE] without output")
                event = json.loads(data)
                if "error" in event:
                    return ERRORED, _error_kind("stream error", event["error"])
                if event.get("choices"):
                    chunks += 1
                if 0 <= spec.abort_after_chunks <= chunks:
                    return ABORTED, ""  # leaving the block closes the connection mid-stream
            return ERRORED, "stream cut before [DONE]"


# -- checks ----------------------------------------------------------------------------------


def node_load(url: str, token: str = "") -> NodeLoad:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    r = httpx.get(f"{url}/internal/load", headers=headers, timeout=5)
    r.raise_for_status()
    return decode(r.content, NodeLoad)


def settle(node_urls: list[str], token: str = "", timeout: float = 30.0) -> tuple[int, int, dict]:
    """Wait until every node is idle; return (leaked blocks, requests still busy, last loads).

    Idle means the pool is back at its free count (cached prefix blocks count as free) and the
    node holds no running, waiting or waiting-for-KV request. A dead node holds nothing.
    """
    deadline = time.monotonic() + timeout
    while True:
        loads = {}
        for url in node_urls:
            with contextlib.suppress(httpx.HTTPError):
                loads[url] = node_load(url, token)
        leaked = sum(lo.total_blocks - lo.free_blocks for lo in loads.values())
        busy = sum(lo.running + lo.waiting + lo.waiting_for_kv for lo in loads.values())
        if len(loads) == len(node_urls) and leaked == 0 and busy == 0:
            return 0, 0, loads
        if time.monotonic() > deadline:
            if len(loads) != len(node_urls):
                missing = sorted(set(node_urls) - set(loads))
                raise AssertionError(f"surviving nodes do not answer /internal/load: {missing}")
            return leaked, busy, loads
        time.sleep(0.2)


def probe(proxy_url: str, attempts: int = 3, pause_s: float = 2.0, model: str = MODEL) -> tuple[bool, str]:
    """A fresh chat request and a fresh streaming completion through the proxy.

    A few attempts are allowed: a proxy notices a dead node within its load-poll interval.
    """
    last = ""
    for attempt in range(attempts):
        if attempt:
            time.sleep(pause_s)
        try:
            r = httpx.post(
                f"{proxy_url}/v1/chat/completions",
                json={
                    "model": model,
                    "messages": [{"role": "user", "content": "Say hello."}],
                    "max_tokens": 4,
                },
                timeout=60,
            )
            if r.status_code != 200 or not _has_output(r.json()):
                last = f"chat: {r.status_code} {r.text[:200]}"
                continue
            body = {"model": model, "prompt": "Once upon a time", "max_tokens": 4, "stream": True}
            with httpx.stream("POST", f"{proxy_url}/v1/completions", json=body, timeout=60) as s:
                lines = [line for line in s.iter_lines() if line.startswith("data: ")]
            if (
                s.status_code == 200
                and lines
                and lines[-1] == "data: [DONE]"
                and '"error"' not in "".join(lines)
            ):
                return True, ""
            last = f"stream: {s.status_code} {lines[-2:]}"
        except httpx.HTTPError as exc:
            last = f"{type(exc).__name__}: {exc}"
    return False, last


# -- injectors -------------------------------------------------------------------------------


def kill9(proc: subprocess.Popen) -> None:
    """SIGKILL a child's whole process group, as a crash would, and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


class Stutter:
    """SIGSTOP a process group for ``stop_s``, then SIGCONT it for ``run_s``, until stopped.

    With ``stop_s`` past the decode node's lease this is a stalled KV transfer; with short
    bursts a slow one. The process is always left running.
    """

    def __init__(self, proc: subprocess.Popen, stop_s: float, run_s: float, bursts: int = 1_000_000) -> None:
        self.proc = proc
        self.stop_s = stop_s
        self.run_s = run_s
        self.bursts = bursts
        self.num_stops = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Stutter:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(timeout=self.stop_s + 5)
        os.killpg(self.proc.pid, signal.SIGCONT)

    def _run(self) -> None:
        while not self._done.is_set() and self.num_stops < self.bursts:
            os.killpg(self.proc.pid, signal.SIGSTOP)
            self.num_stops += 1
            try:
                self._done.wait(self.stop_s)
            finally:
                os.killpg(self.proc.pid, signal.SIGCONT)
            self._done.wait(self.run_s)


class Relay:
    """A TCP relay on a free loopback port in front of ``target`` ("host:port"); while
    ``chaos`` is on it resets a random connection every ``interval_s``, preferring one that
    carried bytes in the last 0.2 s (a response mid-stream)."""

    def __init__(self, target: str, interval_s: float = 0.3, seed: int = 0) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.interval_s = interval_s
        self.rng = random.Random(seed)
        self.chaos = False
        self.num_cuts = 0
        self.num_connections = 0
        self.port = 0
        self._conns: dict[int, list] = {}  # id -> [client writer, upstream writer, last activity]
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Relay:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        self._chaos_task = asyncio.ensure_future(self._chaos())

    async def _stop(self) -> None:
        self._chaos_task.cancel()
        self._server.close()
        for conn in list(self._conns.values()):
            for w in conn[:2]:
                w.transport.abort()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        key = self.num_connections
        self.num_connections += 1
        conn = [writer, up_writer, time.monotonic()]
        self._conns[key] = conn

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    conn[2] = time.monotonic()
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                with contextlib.suppress(OSError):
                    if dst.can_write_eof():
                        dst.write_eof()

        try:
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        finally:
            self._conns.pop(key, None)
            writer.transport.abort()
            up_writer.transport.abort()

    async def _chaos(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if not self.chaos or not self._conns:
                continue
            now = time.monotonic()
            active = [c for c in self._conns.values() if now - c[2] < 0.2]
            victim = self.rng.choice(active or list(self._conns.values()))
            self.num_cuts += 1
            victim[0].transport.abort()  # RST to the proxy
            victim[1].transport.abort()  # and to the node


def proxy_flags(proc: subprocess.Popen) -> list[str]:
    """A running proxy's flags minus --host/--port, to start its twin with ``add_proxy``."""
    args = list(proc.args)[list(proc.args).index("proxy") + 1 :]
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in ("--host", "--port"):
            skip = True
        else:
            out.append(arg)
    return out


def replace_flag(flags: list[str], name: str, value: str) -> list[str]:
    out = list(flags)
    if name in out:
        out[out.index(name) + 1] = value
    else:
        out += [name, value]
    return out


# -- a cluster under test, and the scenarios -----------------------------------------------


class FaultCluster:
    """A ``LocalCluster`` (2 prefill + 2 decode nodes, Redis, a proxy with a short lease and
    request timeout) and what the scenarios need of it: live nodes, the current proxy, restarts.
    """

    def __init__(
        self,
        cluster,
        token: str,
        deadline_s: float,
        lease_s: float,
        settle_s: float = 30.0,
        model: str = MODEL,
    ) -> None:
        self.cluster = cluster
        self.model = model  # what the probe asks for
        self.token = token
        self.deadline_s = deadline_s
        self.lease_s = lease_s
        self.settle_s = settle_s
        self.proxy = next(c for c in cluster.children if c.role.startswith("proxy"))
        self.ended: set[str] = set()  # roles of the children the harness killed or stopped

    def kill(self, child) -> None:
        self.ended.add(child.role)
        kill9(child.proc)

    def stop(self, child) -> None:
        self.ended.add(child.role)
        os.killpg(child.proc.pid, signal.SIGTERM)
        try:
            child.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            kill9(child.proc)

    def crashed(self) -> list[str]:
        """Nodes and proxies that died on their own (a bug, or the OOM killer on a shared host)."""
        return [
            f"{c.role} (exit code {c.proc.returncode}; log {c.log}, its end:\n{log_tail(c.log, 40)}\n)"
            for c in self.cluster.children
            if c.proc.poll() is not None and c.role not in self.ended
        ]

    @property
    def proxy_url(self) -> str:
        return self.proxy.url

    def alive(self, role: str) -> list:
        return [c for c in self.cluster.children if c.role.startswith(role + "-") and c.proc.poll() is None]

    def node_urls(self) -> list[str]:
        return [c.url for c in self.alive("prefill") + self.alive("decode")]

    def restart_proxy(self) -> None:
        """Start the dead proxy's twin (same flags, a new port) over the live nodes and use it from
        now on. A proxy starts only once every node it lists answers, so dead ones are left out."""
        flags = proxy_flags(self.proxy.proc)
        for role in ("prefill", "decode"):
            flags = replace_flag(flags, f"--{role}-urls", ",".join(c.url for c in self.alive(role)))
        self.cluster.add_proxy(*flags)
        self.proxy = self.cluster.children[-1]

    def busy_node(self, role: str, load: Load, timeout: float = 60.0, running_only: bool = False):
        """The first live ``role`` node seen with work (a prompt queued or running, or for decode
        nodes a running stream) while ``load`` runs."""
        found = []

        def busy() -> bool:
            for child in self.alive(role):
                with contextlib.suppress(httpx.HTTPError):
                    lo = node_load(child.url, self.token)
                    if lo.running or (not running_only and (lo.waiting or lo.waiting_for_kv)):
                        found.append(child)
                        return True
            return False

        load.wait_until(busy, timeout, f"a busy {role} node")
        return found[0]

    def run(
        self,
        name: str,
        specs: list[Spec],
        inject: Callable[[Load], str] | None = None,
        after: Callable[[], None] | None = None,
        concurrency: int = 16,
        target: Callable[[], str] | None = None,
    ) -> ScenarioResult:
        """Load, fault, wait for every request, settle the pools, ``after`` (restarts), probe."""
        start = time.monotonic()
        result = ScenarioResult(name)
        dead = self.crashed()
        if dead:
            raise AssertionError(f"died before {name!r} started, outside any fault: {dead}")
        load = Load(target or (lambda: self.proxy_url), specs, concurrency, self.deadline_s).start()
        try:
            result.notes = (inject(load) if inject else "") or ""
        finally:
            outcomes = load.wait()
        result.add(outcomes)
        result.crashed = self.crashed()
        settling = time.monotonic()
        leaked, busy, loads = settle(self.node_urls(), self.token, self.settle_s)
        result.leaked_blocks, result.busy_requests = leaked, busy
        result.settle_s = time.monotonic() - settling
        if result.leaked_blocks or result.busy_requests:
            result.notes += f" not idle after {self.settle_s:.0f} s: {loads}"
        if after is not None:
            after()
        probed = time.monotonic()
        result.served_after, why = probe(self.proxy_url, model=self.model)
        result.probe_s = time.monotonic() - probed
        if not result.served_after:
            result.notes += f" probe failed: {why}"
        result.duration_s = time.monotonic() - start
        record(result)
        return result


def _wait_done(load: Load) -> None:
    load.wait_until(lambda: load.num_finished >= len(load.specs), 600, "the end of the load")


def client_aborts(fc: FaultCluster, num_requests: int, seed: int = 1) -> ScenarioResult:
    """Half the clients hang up: streams after 0-4 chunks, plain requests after 0-1.5 s."""
    specs = make_specs(num_requests, seed, abort_fraction=0.5)
    return fc.run(f"client aborts ({num_requests})", specs, concurrency=24)


def dropped_connections(fc: FaultCluster, num_requests: int, seed: int = 2) -> ScenarioResult:
    """A second proxy reaches one prefill and one decode node through relays that reset a random
    connection (a token stream mid-flight if one is) every 0.3 s."""
    prefill, decode_ = fc.alive("prefill")[0], fc.alive("decode")[0]
    flags = proxy_flags(fc.proxy.proc)

    def via(urls: list[str], node, relay: Relay) -> str:
        return ",".join(relay.url if u == node.url else u for u in urls)

    with (
        Relay(prefill.url.removeprefix("http://"), seed=seed) as rp,
        Relay(decode_.url.removeprefix("http://"), seed=seed + 1) as rd,
    ):
        flags = replace_flag(flags, "--prefill-urls", via([c.url for c in fc.alive("prefill")], prefill, rp))
        flags = replace_flag(flags, "--decode-urls", via([c.url for c in fc.alive("decode")], decode_, rd))
        fc.cluster.add_proxy(*flags)
        relayed = fc.cluster.children[-1]

        def inject(load: Load) -> str:
            rp.chaos = rd.chaos = True
            try:
                _wait_done(load)
            finally:
                rp.chaos = rd.chaos = False
            return f"{rp.num_cuts + rd.num_cuts} connections reset"

        def after() -> None:
            ok, why = probe(relayed.url)
            assert ok, f"the relayed proxy does not serve after the cuts: {why}"
            fc.stop(relayed)

        try:
            return fc.run(
                "dropped connections",
                make_specs(num_requests, seed, max_tokens=(4, 12)),
                inject,
                after,
                target=lambda: relayed.url,
            )
        finally:
            if relayed.proc.poll() is None:
                fc.kill(relayed)


def slow_kv(fc: FaultCluster, num_requests: int, seed: int = 3) -> ScenarioResult:
    """A prefill node freezes for 0.4 s in every 0.8 s (well inside the lease): KV arrives late,
    every request still completes."""
    victim = fc.alive("prefill")[0]

    def inject(load: Load) -> str:
        with Stutter(victim.proc, stop_s=0.4, run_s=0.4) as s:
            _wait_done(load)
        return f"{s.num_stops} stops of {victim.role}"

    specs = make_specs(num_requests, seed, prompt_words=(40, 120))
    return fc.run("slow KV transfer", specs, inject)


def stalled_kv(fc: FaultCluster, num_requests: int, seed: int = 4) -> ScenarioResult:
    """A prefill node busy with prompts freezes for twice the lease plus a second: the decode
    node's leases run out; after SIGCONT its late KV must be refused, not land in freed blocks."""

    def inject(load: Load) -> str:
        victim = fc.busy_node("prefill", load)
        stop_s = 2 * fc.lease_s + 1
        with Stutter(victim.proc, stop_s=stop_s, run_s=0, bursts=1):
            time.sleep(stop_s)
        return f"{victim.role} stopped {stop_s:.0f} s with a {fc.lease_s:g} s lease"

    specs = make_specs(num_requests, seed, prompt_words=(100, 250))
    return fc.run("stalled KV transfer", specs, inject, concurrency=12)


def redis_kill(fc: FaultCluster, num_requests: int, seed: int = 5) -> ScenarioResult:
    """kill -9 of the prefix index's Redis under load, restarted (empty) on its port 2 s later."""
    redis = fc.cluster.redis

    def inject(load: Load) -> str:
        load.wait_until(lambda: load.num_finished >= len(load.specs) // 4, 120, "a quarter of the load")
        redis.kill()
        time.sleep(2.0)
        redis.start()
        return "redis killed and restarted on its port"

    return fc.run("kill -9 redis", make_specs(num_requests, seed, prompt_words=(20, 60)), inject)


def proxy_kill(fc: FaultCluster, num_requests: int, seed: int = 6) -> ScenarioResult:
    """kill -9 of the proxy under load: its clients get connection errors, every node frees what
    the dead proxy's requests held (checked before the restart), a restarted proxy serves."""

    def inject(load: Load) -> str:
        load.wait_until(lambda: load.num_finished >= len(load.specs) // 4, 120, "a quarter of the load")
        in_flight = load.num_started - load.num_finished
        fc.kill(fc.proxy)
        return f"{in_flight} requests in flight at the kill"

    specs = make_specs(num_requests, seed, max_tokens=(4, 16))
    return fc.run("kill -9 proxy", specs, inject, after=fc.restart_proxy)


def prefill_kill(fc: FaultCluster, num_requests: int, seed: int = 7) -> ScenarioResult:
    """kill -9 of a prefill node with prompts queued or running on it."""

    def inject(load: Load) -> str:
        victim = fc.busy_node("prefill", load)
        fc.kill(victim)
        return f"{victim.role} killed"

    specs = make_specs(num_requests, seed, prompt_words=(60, 200))
    return fc.run("kill -9 prefill node", specs, inject, concurrency=12)


def decode_kill(fc: FaultCluster, num_requests: int, seed: int = 8) -> ScenarioResult:
    """kill -9 of a decode node with streams running on it."""

    def inject(load: Load) -> str:
        load.wait_until(lambda: load.num_finished >= len(load.specs) // 4, 120, "a quarter of the load")
        victim = fc.busy_node("decode", load, running_only=True)
        fc.kill(victim)
        return f"{victim.role} killed"

    specs = make_specs(num_requests, seed, max_tokens=(8, 16))
    return fc.run("kill -9 decode node", specs, inject)


SCENARIOS: dict[str, Callable[..., ScenarioResult]] = {
    "client_aborts": client_aborts,
    "dropped_connections": dropped_connections,
    "slow_kv": slow_kv,
    "stalled_kv": stalled_kv,
    "redis_kill": redis_kill,
    "proxy_kill": proxy_kill,
    "decode_kill": decode_kill,
    "prefill_kill": prefill_kill,
}
"""In the order a shared cluster can run them: the kills that leave it smaller come last."""

CI_SIZES = {
    "client_aborts": 200,
    "dropped_connections": 60,
    "slow_kv": 50,
    "stalled_kv": 40,
    "redis_kill": 60,
    "proxy_kill": 60,
    "prefill_kill": 50,
    "decode_kill": 60,
}
"""Requests per scenario in the CI run (tests/test_fault_suite.py): about three minutes on 2 cores."""

TOKEN = "fault-suite-token"
LEASE_S = 8.0
"""The proxy's --lease-s: short, so that a stalled transfer outlives it within seconds."""
DEADLINE_S = 30.0
"""The proxy's --request-timeout-s: every request ends within it (the hung rule adds slack)."""


@contextlib.contextmanager
def fault_cluster(log_dir: str):
    """Start the scenarios' cluster (one intra-op thread per node) and stop it afterwards."""
    from pdserve.cluster import ClusterConfig, LocalCluster, free_port
    from pdserve.config import ModelConfig

    cfg = ClusterConfig(
        port=free_port(),
        prefill_nodes=2,
        decode_nodes=2,
        threads_per_node=1,
        log_dir=log_dir,
        startup_timeout_s=300.0,  # the model is converted already; a node that cannot start is a failure
        cluster_token=TOKEN,
        min_remote_prefill_tokens=0,  # every prompt goes through a prefill node and a KV transfer
        # A small KV cache: the host is shared, and four nodes at the default 1 GiB each invite
        # the OOM killer.
        extra_node_flags=(
            "--heartbeat-ttl-s 2 --kv-transfer-timeout-s 10 --kv-cache-memory-gib 0.25 --max-model-len 1024"
            + (f" --kv-transport {os.environ[KV_TRANSPORT_ENV]}" if os.environ.get(KV_TRANSPORT_ENV) else "")
        ),
        extra_proxy_flags=(
            f"--lease-s {LEASE_S:g} --request-timeout-s {DEADLINE_S:g} --load-poll-interval-s 0.5 "
            "--startup-timeout-s 60"
        ),
    )
    cluster = LocalCluster(cfg, [], ModelConfig())
    try:
        cluster.start()
        yield FaultCluster(cluster, TOKEN, DEADLINE_S, LEASE_S)
    finally:
        cluster.stop()

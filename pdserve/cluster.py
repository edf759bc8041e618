"""`pdserve up`: a local cluster — prefill nodes, decode nodes and the proxy — as child processes.

Each role runs as ``python -m pdserve <role> ...`` (exactly what a person would type
in separate terminals; see deploy/local/README.md), with its log in a file. The
launcher converts the default model once before anything starts, waits for every
node's ``/health`` before starting the proxy, and stops all children on Ctrl-C,
SIGTERM, or when any child dies.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.config import ModelConfig, cpu_count
from pdserve.utils import die_with_parent, free_port


@dataclass(frozen=True)
class ClusterConfig:
    host: str = "127.0.0.1"
    """Interface of the proxy (nodes always bind to 127.0.0.1 in a local cluster)."""
    port: int = 8000
    """Port of the OpenAI-compatible proxy."""
    prefill_nodes: int = 1
    """Number of prefill nodes."""
    decode_nodes: int = 1
    """Number of decode nodes."""
    both_nodes: int = 0
    """Number of co-located nodes (`--role both`), each serving whole requests."""
    threads_per_node: int = 0
    """torch threads per node; 0 splits the machine's cores between the nodes."""
    log_dir: str = ""
    """Where each role's log goes; empty means a new folder for this run under <cache dir>/logs
    (two clusters never write into each other's logs)."""
    startup_timeout_s: float = 900.0
    """How long to wait for every role to answer /health."""
    cluster_token: str = ""
    """Shared secret for the internal APIs; empty means none."""
    redis_url: str = ""
    """Redis of the prefix index. Empty: start a private redis-server if one is installed, else run
    without the index; `none`: run without it."""
    routing: str = "prefix-aware"
    """The proxy's --routing."""
    min_remote_prefill_tokens: int = -1
    """The proxy's --min-remote-prefill-tokens; -1 leaves the proxy's default."""
    gpus: str = ""
    """Comma-separated CUDA device ids handed to the nodes in turn (CUDA_VISIBLE_DEVICES of each);
    empty: every node sees what the launcher sees."""
    extra_node_flags: str = ""
    """More flags for every node, e.g. "--kv-transport zmq" (engine flags go directly)."""
    proxy_workers: int = 0
    """The proxy's --workers; 0 picks one per 8 cores of this machine, 1 to 8."""
    extra_proxy_flags: str = ""
    """More flags for the proxy, e.g. "--api-key KEY"."""


class ClusterStartError(RuntimeError):
    """The cluster cannot start; the message says why in one line."""


@dataclass
class _Child:
    role: str
    url: str
    log: Path
    proc: subprocess.Popen = field(repr=False)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def log_tail(path: Path | str, lines: int = 30) -> str:
    """The last ``lines`` lines of a child's log (why it died), or why they cannot be read."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"(unreadable: {e})"


class LocalRedis:
    """A ``redis-server`` child on a free loopback port, without persistence (the index is a
    hint that nodes republish, so nothing on disk is worth keeping)."""

    def __init__(self, log: Path, port: int = 0, binary: str = "") -> None:
        self.binary = binary or shutil.which("redis-server") or ""
        self.port = port or free_port()
        self.log = log
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        if not self.binary:
            raise RuntimeError("redis-server is not installed (on Debian: apt-get install -y redis-server)")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        cmd += ["--save", "", "--appendonly", "no"]
        with open(self.log, "a") as f:
            self.proc = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent
            )
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                raise RuntimeError(f"redis-server exited with code {code}: {log_tail(self.log)}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout_s} s")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL, as a crash would (its data is gone; a restart comes up empty)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()


class LocalCluster:
    """Starts and stops the processes of a local cluster."""

    def __init__(self, cfg: ClusterConfig, engine_flags: list[str], model: ModelConfig) -> None:
        self.cfg = cfg
        self.engine_flags = engine_flags
        self.model = model
        self.children: list[_Child] = []
        self.redis: LocalRedis | None = None
        self.redis_url = ""
        self.log_dir = Path(cfg.log_dir) if cfg.log_dir else model.resolved_cache_dir / "logs"

    def _spawn(self, role: str, port: int, args: list[str]) -> _Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        index = sum(1 for c in self.children if c.role.startswith(role))
        log = self.log_dir / f"{role}-{index}.log"
        command = [role] if role == "proxy" else ["node", "--role", role]
        cmd = [sys.executable, "-m", "pdserve", *command, *args]
        env = None
        gpus = [g.strip() for g in self.cfg.gpus.split(",") if g.strip()]
        if gpus and role != "proxy":
            num_nodes = sum(1 for c in self.children if not c.role.startswith("proxy"))
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus[num_nodes % len(gpus)]}
        with open(log, "w") as f:
            proc = subprocess.Popen(
                cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
                preexec_fn=die_with_parent,
            )
        child = _Child(f"{role}-{index}", f"http://127.0.0.1:{port}", log, proc)
        self.children.append(child)
        return child

    def _wait_healthy(self, children: list[_Child]) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        pending = list(children)
        while pending:
            for child in list(pending):
                if child.proc.poll() is not None:
                    raise RuntimeError(
                        f"{child.role} exited with code {child.proc.returncode}; its log ({child.log}):\n"
                        f"{log_tail(child.log)}"
                    )
                if _healthy(child.url):
                    pending.remove(child)
            if pending and time.monotonic() > deadline:
                names = ", ".join(c.role for c in pending)
                raise RuntimeError(f"{names} not healthy after {self.cfg.startup_timeout_s} s")
            time.sleep(0.25)

    def check(self) -> None:
        """What can fail before anything starts, each with one line saying why: the model (a bad path
        or preset), the proxy's port (taken by another cluster, say). The default model is converted
        here, once, before the nodes race for it."""
        from pdserve.model_source import resolve_model

        try:
            resolve_model(self.model)
        except (FileNotFoundError, ValueError) as e:
            raise ClusterStartError(str(e)) from None
        with socket.socket() as s:
            s.setsockopt(
                socket.SOL_SOCKET, socket.SO_REUSEADDR, 1
            )  # as the server will: only a listener counts
            try:
                s.bind((self.cfg.host, self.cfg.port))
            except OSError as e:
                raise ClusterStartError(
                    f"port {self.cfg.port} on {self.cfg.host} is taken ({e.strerror}): another pdserve up, "
                    "or another server, listens there; stop it or pass --port"
                ) from None

    def start(self) -> str:
        cfg = self.cfg
        self.check()
        if not cfg.log_dir:  # a folder of this run's own
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self.log_dir = Path(
                tempfile.mkdtemp(prefix=time.strftime("run-%Y%m%d-%H%M%S-"), dir=self.log_dir)
            )
        redis_url = self._start_redis()
        counts = (("prefill", cfg.prefill_nodes), ("decode", cfg.decode_nodes), ("both", cfg.both_nodes))
        num_nodes = sum(n for _, n in counts)
        if cfg.decode_nodes + cfg.both_nodes < 1:
            raise RuntimeError("a cluster needs at least one decode or both node")
        threads = cfg.threads_per_node or max(1, cpu_count() // num_nodes)
        token = ["--cluster-token", cfg.cluster_token] if cfg.cluster_token else []
        index = ["--redis-url", redis_url] if redis_url else []
        nodes = []
        for role, count in counts:
            for _ in range(count):
                port = free_port()
                args = ["--port", str(port), "--num-threads", str(threads), *token, *index]
                args += [*shlex.split(cfg.extra_node_flags), *self.engine_flags]
                nodes.append(self._spawn(role, port, args))
        self._wait_healthy(nodes)
        proxy_args = ["--host", cfg.host, "--port", str(cfg.port), "--model", self.model.model]
        proxy_args += [*token, *index, "--routing", cfg.routing]
        proxy_args += ["--workers", str(cfg.proxy_workers or max(1, min(8, cpu_count() // 8)))]
        if cfg.min_remote_prefill_tokens >= 0:
            proxy_args += ["--min-remote-prefill-tokens", str(cfg.min_remote_prefill_tokens)]
        if self.model.cache_dir:
            proxy_args += ["--cache-dir", self.model.cache_dir]
        for role, _ in counts:
            urls = ",".join(c.url for c in nodes if c.role.startswith(role))
            proxy_args += [f"--{role}-urls", urls]
        proxy_args += shlex.split(cfg.extra_proxy_flags)
        proxy = self._spawn("proxy", cfg.port, proxy_args)
        self._wait_healthy([proxy])
        self.redis_url = redis_url
        return f"http://{cfg.host}:{cfg.port}"

    def node_urls(self, role: str) -> list[str]:
        return [c.url for c in self.children if c.role.startswith(role + "-")]

    def add_proxy(self, *flags: str) -> str:
        """Another proxy over (some of) the running nodes, e.g. with another routing policy."""
        port = free_port()
        args = ["--port", str(port), "--model", self.model.model, *flags]
        if self.cfg.cluster_token:
            args += ["--cluster-token", self.cfg.cluster_token]
        if self.model.cache_dir:
            args += ["--cache-dir", self.model.cache_dir]
        proxy = self._spawn("proxy", port, args)
        self._wait_healthy([proxy])
        return proxy.url

    def _start_redis(self) -> str:
        """The prefix index's Redis URL: the given one, a private redis-server, or "" for none."""
        url = self.cfg.redis_url
        if url == "none":
            return ""
        if url:
            return url
        self.redis = LocalRedis(self.log_dir / "redis.log")
        if not self.redis.binary:
            print(
                "pdserve up: redis-server not found, so no prefix index: routing uses load alone "
                "(install redis-server, or pass --redis-url redis://host:port/0)",
                file=sys.stderr,
                flush=True,
            )
            self.redis = None
            return ""
        self.redis.start()
        return self.redis.url

    def wait(self) -> int:
        """Block until a child dies (returning its code) or a signal arrives."""
        while True:
            for child in self.children:
                code = child.proc.poll()
                if code is not None:
                    print(f"pdserve: {child.role} exited with code {code}; log: {child.log}", file=sys.stderr)
                    print(log_tail(child.log), file=sys.stderr)
                    return code or 1
            time.sleep(0.5)

    def stop(self, timeout_s: float = 45.0) -> None:
        """SIGTERM the proxies, which drain their requests in flight, then the nodes, which drain
        theirs (--shutdown-timeout-s, 30 s by default); SIGKILL what is left after ``timeout_s``."""
        proxies = [c for c in self.children if c.role.startswith("proxy")]
        nodes = [c for c in self.children if not c.role.startswith("proxy")]
        for group in (proxies, nodes):
            for child in group:
                if child.proc.poll() is None:
                    os.killpg(child.proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            for child in group:
                try:
                    child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    os.killpg(child.proc.pid, signal.SIGKILL)
                    child.proc.wait()
        if self.redis is not None:
            self.redis.stop()


def run(cfg: ClusterConfig, engine_flags: list[str], model: ModelConfig) -> int:
    cluster = LocalCluster(cfg, engine_flags, model)

    def _terminate(signum, frame):
        raise KeyboardInterrupt

    # SIGINT too: a shell starts a backgrounded `pdserve up` with SIGINT ignored, and Python then
    # leaves it ignored.
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, _terminate)
    try:
        url = cluster.start()
        names = ", ".join(c.role for c in cluster.children)
        print(f"pdserve is up: OpenAI API at {url}/v1 ({names}; logs in {cluster.log_dir})", flush=True)
        return cluster.wait()
    except KeyboardInterrupt:
        print("pdserve: stopping: the proxy finishes its streams, then the nodes drain", flush=True)
        return 0
    except RuntimeError as e:
        print(f"pdserve up failed: {e}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()

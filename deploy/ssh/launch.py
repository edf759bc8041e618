#!/usr/bin/env python3
"""Start a pdserve cluster on several hosts from one hosts file, and stop it again.

Each role — Redis, prefill nodes, decode nodes, the proxy — runs as the same command a person
would type on that host (``python -m pdserve node ...``, ``redis-server ...``), started by a
*runner* that turns "run this shell script at <target>" into a local command:

    ssh     ssh -o BatchMode=yes <target> 'sh -c ...'        (the default; one host per target)
    netns   ip netns exec <target> sh -c ...                 (network namespaces on this machine)
    local   sh -c ...                                        (everything on this machine)

Everything else — command lines, pid files, start order, health checks, stopping — is one code
path for all three. Start order: Redis (answers PING), then every node (answers /health), then
the proxy (answers /health). Each role's stdout and stderr stream into ``<log dir>/<name>.log``
on the machine running the launcher. ``up`` stays in the foreground and stops everything on
Ctrl-C, SIGTERM, or when any role exits; ``down`` stops what a crashed launcher left behind,
through the pid files each role writes on its host (``<run dir>/<name>.pid``).

The launcher reaches every role's port directly for its health checks, so run it where the
cluster network is reachable (a login node, or one of the hosts). It needs Python 3.10 and
nothing else; the hosts need pdserve installed (or ``--workdir`` pointing at a checkout) and
``redis-server`` on the Redis host.

Hosts file: one role per line, ``#`` starts a comment::

    # role    host        gpus   port   options
    redis     10.0.0.1    -      6379
    proxy     10.0.0.1    -      8000
    prefill   10.0.0.2    0      8100   kv_port=8200
    prefill   10.0.0.2    1      8101   kv_port=8201   --max-num-batched-tokens=4096
    decode    10.0.0.3    0      8100   kv_port=8200   kv_lane_port=8300   UCX_NET_DEVICES=mlx5_0:1

``role`` is redis, proxy, prefill, decode or both. ``host`` is the address the role binds to
and the others reach it at (nodes also bind their KV receiver to it). ``gpus`` becomes
CUDA_VISIBLE_DEVICES (``-``: leave it unset). Options: ``at=<target>`` (where the runner starts
it: an ssh destination such as user@gpu-a, or a namespace name; default: host),
``kv_port=N``, ``kv_lane_port=N`` (a decode node's KV lane port: fix it where a firewall opens
only named ports between hosts), ``num_threads=N``; ``NAME=value`` with an upper-case name sets an environment
variable; ``--flag=value`` is passed to that role's command line.
"""

from __future__ import annotations

import argparse
import http.client
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

ROLES = ("redis", "proxy", "prefill", "decode", "both")
NODE_ROLES = ("prefill", "decode", "both")
# A pid file holds "<pid> <start time>" (field 22 of /proc/<pid>/stat, in clock ticks since
# boot; exec keeps both). The stop script signals the pid only while that process still has that
# start time, so a stale pid file never hits another process that reused the pid. (Not the
# environment: redis-server rewrites that memory for its process title.)
_STAT_START = "sed 's/.*) //' /proc/{pid}/stat | cut -d' ' -f20"

_ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")
_OPTION = re.compile(r"^[a-z_]+$")


# -- hosts file --------------------------------------------------------------------------------


@dataclass(frozen=True)
class RoleSpec:
    """One line of the hosts file: a process to run somewhere."""

    name: str
    """Unique name in logs and pid files: redis, proxy, prefill-0, decode-1, ..."""
    role: str
    host: str
    port: int
    gpus: str = ""
    """CUDA_VISIBLE_DEVICES; empty leaves it unset."""
    at: str = ""
    """Runner target; empty means ``host``."""
    kv_port: int = 0
    kv_lane_port: int = 0
    num_threads: int | None = None
    env: tuple[tuple[str, str], ...] = ()
    args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}; choose one of {', '.join(ROLES)}")
        if not 0 < self.port < 65536:
            raise ValueError(f"{self.name}: port must be in [1, 65535], got {self.port}")
        for key in ("kv_port", "kv_lane_port"):
            if not 0 <= getattr(self, key) < 65536:
                raise ValueError(f"{self.name}: {key} must be in [0, 65535], got {getattr(self, key)}")

    @property
    def target(self) -> str:
        return self.at or self.host

    @property
    def address(self) -> str:
        """host:port as a URL authority (IPv6 addresses in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"


def parse_hosts(text: str) -> list[RoleSpec]:
    """Parse a hosts file; raises ValueError naming the line of any mistake."""
    specs: list[RoleSpec] = []
    counts: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        words = shlex.split(raw, comments=True)
        if not words:
            continue
        try:
            if len(words) < 4:
                raise ValueError("expected: role host gpus port [options]")
            role, host, gpus, port = words[:4]
            kw: dict = {"env": [], "args": []}
            for word in words[4:]:
                if word.startswith("--"):
                    kw["args"].append(word)
                    continue
                key, sep, value = word.partition("=")
                if not sep:
                    raise ValueError(f"option {word!r} is not key=value or --flag=value")
                if _ENV_NAME.match(key):
                    kw["env"].append((key, value))
                elif key in ("at",):
                    kw[key] = value
                elif key in ("kv_port", "kv_lane_port", "num_threads"):
                    kw[key] = int(value)
                else:
                    raise ValueError(
                        f"unknown option {key!r} "
                        "(at, kv_port, kv_lane_port, num_threads, ENV=value, --flag=v)"
                    )
            index = counts.get(role, 0)
            counts[role] = index + 1
            name = role if role in ("redis", "proxy") else f"{role}-{index}"
            specs.append(
                RoleSpec(
                    name=name,
                    role=role,
                    host=host,
                    port=int(port),
                    gpus="" if gpus == "-" else gpus,
                    env=tuple(kw.pop("env")),
                    args=tuple(kw.pop("args")),
                    **kw,
                )
            )
        except ValueError as e:
            raise ValueError(f"hosts file line {lineno}: {e}: {raw.strip()!r}") from None
    _check_cluster(specs)
    return specs


def _check_cluster(specs: list[RoleSpec]) -> None:
    roles = [s.role for s in specs]
    if roles.count("proxy") != 1:
        raise ValueError(f"the hosts file needs exactly one proxy line, found {roles.count('proxy')}")
    if roles.count("redis") > 1:
        raise ValueError("the hosts file may have at most one redis line")
    if not any(r in ("prefill", "both") for r in roles):
        raise ValueError("the hosts file needs at least one prefill (or both) node")
    if not any(r in ("decode", "both") for r in roles):
        raise ValueError("the hosts file needs at least one decode (or both) node")
    seen: dict[tuple[str, int], str] = {}
    for s in specs:
        for port in (s.port, s.kv_port, s.kv_lane_port):
            if port and (s.host, port) in seen:
                raise ValueError(f"{s.name} and {seen[(s.host, port)]} both use {s.host}:{port}")
            if port:
                seen[(s.host, port)] = s.name


# -- runners -------------------------------------------------------------------------------------


class Runner(ABC):
    """Turns "run this POSIX shell script at <target>" into a local command.

    The script's stdout and stderr come back on the local process's; its exit status is the
    local process's. A runner does nothing else: the launcher's start and stop logic is the
    same whichever runner carries it."""

    @abstractmethod
    def argv(self, target: str, script: str) -> list[str]: ...


class SshRunner(Runner):
    def __init__(self, options: list[str] | None = None) -> None:
        self.options = options or []

    def argv(self, target: str, script: str) -> list[str]:
        # BatchMode: fail instead of prompting for a password; the remote login shell runs sh -c.
        return [
            "ssh",
            "-o",
            "BatchMode=yes",
            "-o",
            "ConnectTimeout=10",
            *self.options,
            target,
            shlex.join(["sh", "-c", script]),
        ]


class NetnsRunner(Runner):
    """Runs in network namespace <target> on this machine (needs root: ``ip netns exec``)."""

    def argv(self, target: str, script: str) -> list[str]:
        return ["ip", "netns", "exec", target, "sh", "-c", script]


class LocalRunner(Runner):
    def argv(self, target: str, script: str) -> list[str]:
        return ["sh", "-c", script]


RUNNERS = {"ssh": SshRunner, "netns": NetnsRunner, "local": LocalRunner}


# -- commands ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchConfig:
    """What every role shares; the hosts file says where each one runs."""

    model: str = "default"
    """--model of every node and the proxy."""
    cache_dir: str = ""
    """--cache-dir of every node and the proxy (converted models); empty: their default."""
    python: str = "python3"
    """Python on the hosts (one with pdserve installed)."""
    redis_server: str = "redis-server"
    """redis-server on the Redis host."""
    workdir: str = ""
    """Directory the roles start in on their host (a checkout, if pdserve is not installed)."""
    run_dir: str = "/tmp/pdserve-deploy"
    """Directory for pid files on each host."""
    log_dir: str = "logs"
    """Local directory for each role's log."""
    cluster_token: str = ""
    routing: str = ""
    """--routing of the proxy; empty: the proxy's default."""
    num_threads: int | None = None
    """--num-threads of every node unless its line says otherwise."""
    node_args: tuple[str, ...] = ()
    proxy_args: tuple[str, ...] = ()
    startup_timeout_s: float = 900.0
    stop_timeout_s: float = 15.0
    deploy_id: str = "pdserve"
    """Names this cluster's pid files and marks its processes; two clusters sharing hosts need two."""


def redis_url(specs: list[RoleSpec], cfg: LaunchConfig) -> str:
    """The Redis URL nodes and the proxy get; the cluster token, if any, is Redis's password."""
    redis = next((s for s in specs if s.role == "redis"), None)
    if redis is None:
        return ""
    auth = f":{urllib.parse.quote(cfg.cluster_token, safe='')}@" if cfg.cluster_token else ""
    return f"redis://{auth}{redis.address}/0"


def role_command(spec: RoleSpec, specs: list[RoleSpec], cfg: LaunchConfig) -> list[str]:
    """The command line of one role (what a person would type on that host)."""
    if spec.role == "redis":
        # No persistence: the index is a hint that nodes republish after a restart.
        cmd = [
            cfg.redis_server,
            "--bind",
            spec.host,
            "--port",
            str(spec.port),
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        # Protected mode refuses every remote client of a Redis without a password.
        auth = ["--requirepass", cfg.cluster_token] if cfg.cluster_token else ["--protected-mode", "no"]
        return [*cmd, *auth, *spec.args]
    common = ["--model", cfg.model]
    if cfg.cache_dir:
        common += ["--cache-dir", cfg.cache_dir]
    if redis_url(specs, cfg):
        common += ["--redis-url", redis_url(specs, cfg)]
    if cfg.cluster_token:
        common += ["--cluster-token", cfg.cluster_token]
    if spec.role == "proxy":
        prefill = ",".join(s.url for s in specs if s.role in ("prefill", "both"))
        decode = ",".join(s.url for s in specs if s.role in ("decode", "both"))
        cmd = [cfg.python, "-m", "pdserve", "proxy", "--host", spec.host, "--port", str(spec.port)]
        cmd += ["--prefill-urls", prefill, "--decode-urls", decode, *common]
        if cfg.routing:
            cmd += ["--routing", cfg.routing]
        return [*cmd, *cfg.proxy_args, *spec.args]
    cmd = [cfg.python, "-m", "pdserve", "node", "--role", spec.role, "--host", spec.host]
    cmd += ["--port", str(spec.port), "--kv-host", spec.host, *common]
    if spec.kv_port:
        cmd += ["--kv-port", str(spec.kv_port)]
    if spec.kv_lane_port:
        cmd += ["--kv-lane-port", str(spec.kv_lane_port)]
    threads = spec.num_threads if spec.num_threads is not None else cfg.num_threads
    if threads is not None:
        cmd += ["--num-threads", str(threads)]
    return [*cmd, *cfg.node_args, *spec.args]


def _pidfile(spec: RoleSpec, cfg: LaunchConfig) -> str:
    return f"{cfg.run_dir}/{cfg.deploy_id}-{spec.name}.pid"


def start_script(spec: RoleSpec, specs: list[RoleSpec], cfg: LaunchConfig) -> str:
    """Shell script that records its pid and execs the role (so the pid is the role's)."""
    env = []
    if spec.gpus:
        env.append(f"CUDA_VISIBLE_DEVICES={spec.gpus}")
    env += [f"{k}={v}" for k, v in spec.env]
    q = shlex.quote
    pidfile = _pidfile(spec, cfg)
    start = _STAT_START.format(pid="$$")
    lines = [f"mkdir -p {q(cfg.run_dir)}", f'echo "$$ $({start})" > {q(pidfile)}']
    if cfg.workdir:
        lines.append(f"cd {q(cfg.workdir)}")
    lines.append("exec env " + shlex.join([*env, *role_command(spec, specs, cfg)]))
    return " && ".join(lines)


def stop_script(spec: RoleSpec, cfg: LaunchConfig) -> str:
    """Shell script: SIGTERM the role if its pid file names a live process of ours, wait up to
    ``stop_timeout_s``, then SIGKILL; remove the pid file. Exits 0 when nothing is left."""
    q = shlex.quote
    ticks = max(1, int(cfg.stop_timeout_s / 0.2))
    # ours: the pid is alive, not a zombie, and started when the pid file says.
    return (
        f'f={q(_pidfile(spec, cfg))}; [ -f "$f" ] || exit 0; read -r pid start < "$f"; '
        "ours() { s=$(sed 's/.*) //' /proc/$pid/stat 2>/dev/null) || return 1; set -- $s; "
        '[ "$1" != Z ] && [ -n "$start" ] && [ "${20}" = "$start" ]; }; '
        f'if ours; then kill -TERM "$pid" 2>/dev/null; i=0; '
        f"while ours && [ $i -lt {ticks} ]; do sleep 0.2; i=$((i+1)); done; "
        f'ours && kill -KILL "$pid" 2>/dev/null; fi; rm -f "$f"'
    )


# -- health ----------------------------------------------------------------------------------

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_healthy(url: str, timeout: float = 2.0) -> bool:
    """GET <url>/health answers 200 (never through an HTTP proxy from the environment)."""
    try:
        with _NO_PROXY.open(f"{url}/health", timeout=timeout) as r:
            return r.status == 200
    except (OSError, http.client.HTTPException):
        return False


def redis_healthy(host: str, port: int, password: str = "", timeout: float = 2.0) -> bool:
    """Redis answers PING (after AUTH when it has a password): +PONG, not -NOAUTH or -DENIED."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as conn:
            if password:
                arg = password.encode()
                conn.sendall(b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(arg), arg))
                if not conn.recv(64).startswith(b"+OK"):
                    return False
            conn.sendall(b"PING\r\n")
            return conn.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def healthy(spec: RoleSpec, cluster_token: str = "") -> bool:
    if spec.role == "redis":
        return redis_healthy(spec.host, spec.port, cluster_token)
    return http_healthy(spec.url)


def tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# -- the launcher ------------------------------------------------------------------------------


@dataclass
class _Started:
    spec: RoleSpec
    log: Path
    proc: subprocess.Popen = field(repr=False)


class Launcher:
    """Starts the roles of a hosts file through a runner, waits for them, stops them."""

    def __init__(self, specs: list[RoleSpec], cfg: LaunchConfig, runner: Runner) -> None:
        self.specs = specs
        self.cfg = cfg
        self.runner = runner
        self.started: list[_Started] = []
        self.forced: list[str] = []
        """Roles whose local end had to be killed after their stop script (should stay empty)."""
        self.log_dir = Path(cfg.log_dir)

    @property
    def proxy(self) -> RoleSpec:
        return next(s for s in self.specs if s.role == "proxy")

    def _redacted(self, argv: list[str]) -> str:
        text = shlex.join(argv)
        token = self.cfg.cluster_token
        if token:
            for form in (token, urllib.parse.quote(token, safe="")):
                text = text.replace(form, "<cluster token>")
        return text

    def _start(self, spec: RoleSpec) -> _Started:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{spec.name}.log"
        argv = self.runner.argv(spec.target, start_script(spec, self.specs, self.cfg))
        with open(log, "w") as f:
            f.write(f"# {self._redacted(argv)}\n")
            f.flush()
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
            )
        started = _Started(spec, log, proc)
        self.started.append(started)
        return started

    def _wait_healthy(self, group: list[_Started], deadline: float) -> None:
        pending = list(group)
        while pending:
            for s in list(pending):
                if s.proc.poll() is not None:
                    raise RuntimeError(
                        f"{s.spec.name} on {s.spec.target} exited with code {s.proc.returncode}; "
                        f"its log ({s.log}):\n{tail(s.log)}"
                    )
                if healthy(s.spec, self.cfg.cluster_token):
                    pending.remove(s)
            if pending and time.monotonic() > deadline:
                names = ", ".join(f"{s.spec.name} ({s.spec.address})" for s in pending)
                raise RuntimeError(f"not healthy after {self.cfg.startup_timeout_s:g} s: {names}")
            time.sleep(0.25)

    def start(self) -> str:
        """Redis, then the nodes, then the proxy, each group healthy before the next starts.
        Returns the proxy's URL; on failure the caller still owes a ``stop()``."""
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        for group in (("redis",), NODE_ROLES, ("proxy",)):
            started = [self._start(s) for s in self.specs if s.role in group]
            self._wait_healthy(started, deadline)
        return self.proxy.url

    def stop(self, specs: list[RoleSpec] | None = None) -> None:
        """Stop roles (default: all) in reverse start order through their pid files: the proxy
        first, so no request reaches a node that is going away. Safe to call twice."""
        order = {"proxy": 0, "prefill": 1, "decode": 1, "both": 1, "redis": 2}
        targets = sorted(specs if specs is not None else self.specs, key=lambda s: order[s.role])
        for rank in sorted({order[s.role] for s in targets}):
            group = [s for s in targets if order[s.role] == rank]
            stoppers = [
                subprocess.Popen(
                    self.runner.argv(s.target, stop_script(s, self.cfg)),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                for s in group
            ]
            for p in stoppers:
                try:
                    p.wait(timeout=self.cfg.stop_timeout_s + 30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            names = {s.name for s in group}
            for s in self.started:
                if s.spec.name in names:
                    self._reap(s)

    def _reap(self, s: _Started) -> None:
        """The local end (ssh, ip netns exec) ends with the role; make sure it does."""
        try:
            s.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.forced.append(s.spec.name)  # the stop script did not end it: worth a look
            print(f"launch: {s.spec.name} outlived its stop script; killing its local end", file=sys.stderr)
            os.killpg(s.proc.pid, signal.SIGKILL)
            s.proc.wait()

    def wait(self) -> int:
        """Block until a role exits (returning its code)."""
        while True:
            for s in self.started:
                code = s.proc.poll()
                if code is not None:
                    print(f"launch: {s.spec.name} exited with code {code}; log: {s.log}", file=sys.stderr)
                    print(tail(s.log), file=sys.stderr)
                    return code or 1
            time.sleep(0.5)


# -- command line ------------------------------------------------------------------------------


def _read_token(args: argparse.Namespace) -> str:
    if args.cluster_token_file:
        return Path(args.cluster_token_file).read_text().strip()
    return os.environ.get("PDSERVE_CLUSTER_TOKEN", "")


def build_parser() -> argparse.ArgumentParser:
    d = LaunchConfig()
    p = argparse.ArgumentParser(
        prog="launch.py",
        description="Start (up) or stop (down) a pdserve cluster described by a hosts file.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("command", choices=("up", "down", "print"), help="print: show each role's command")
    p.add_argument("hosts", help="hosts file (see the top of this script)")
    p.add_argument("--runner", choices=sorted(RUNNERS), default="ssh")
    p.add_argument("--ssh-option", action="append", default=[], help="extra ssh argument (repeatable)")
    p.add_argument("--model", default=d.model)
    p.add_argument("--cache-dir", default=d.cache_dir)
    p.add_argument(
        "--python", default="", help="Python on the hosts; default: python3 over ssh, this one otherwise"
    )
    p.add_argument("--redis-server", default=d.redis_server)
    p.add_argument(
        "--workdir",
        default=d.workdir,
        help="where roles start; default: home over ssh, this directory otherwise",
    )
    p.add_argument("--run-dir", default=d.run_dir)
    p.add_argument("--log-dir", default=d.log_dir)
    p.add_argument(
        "--cluster-token-file",
        default="",
        help="file holding the cluster token; default: $PDSERVE_CLUSTER_TOKEN, else no token",
    )
    p.add_argument("--routing", default=d.routing)
    p.add_argument("--num-threads", type=int, default=d.num_threads)
    p.add_argument("--node-args", default="", help="extra flags for every node, one shell-quoted string")
    p.add_argument("--proxy-args", default="", help="extra flags for the proxy, one shell-quoted string")
    p.add_argument("--startup-timeout-s", type=float, default=d.startup_timeout_s)
    p.add_argument("--stop-timeout-s", type=float, default=d.stop_timeout_s)
    p.add_argument("--deploy-id", default=d.deploy_id)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    d = LaunchConfig()
    specs = parse_hosts(Path(args.hosts).read_text())
    cfg = LaunchConfig(
        model=args.model,
        cache_dir=args.cache_dir,
        python=args.python or (d.python if args.runner == "ssh" else sys.executable),
        redis_server=args.redis_server,
        workdir=args.workdir or ("" if args.runner == "ssh" else os.getcwd()),
        run_dir=args.run_dir,
        log_dir=args.log_dir,
        cluster_token=_read_token(args),
        routing=args.routing,
        num_threads=args.num_threads,
        node_args=tuple(shlex.split(args.node_args)),
        proxy_args=tuple(shlex.split(args.proxy_args)),
        startup_timeout_s=args.startup_timeout_s,
        stop_timeout_s=args.stop_timeout_s,
        deploy_id=args.deploy_id,
    )
    runner = SshRunner(args.ssh_option) if args.runner == "ssh" else RUNNERS[args.runner]()
    launcher = Launcher(specs, cfg, runner)
    if args.command == "print":
        for s in specs:
            print(f"{s.name} at {s.target}: {launcher._redacted(role_command(s, specs, cfg))}")
        return 0
    if args.command == "down":
        launcher.stop()
        print("launch: stopped every role of the hosts file", file=sys.stderr)
        return 0

    def _terminate(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    if not cfg.cluster_token:
        print(
            "launch: no cluster token (--cluster-token-file or $PDSERVE_CLUSTER_TOKEN): the nodes' "
            "internal APIs and Redis accept anyone who reaches them",
            file=sys.stderr,
        )
    try:
        url = launcher.start()
        print(f"launch: pdserve is up: OpenAI API at {url}/v1 (logs in {launcher.log_dir})", flush=True)
        return launcher.wait()
    except KeyboardInterrupt:
        return 0
    except RuntimeError as e:
        print(f"launch: up failed: {e}", file=sys.stderr)
        return 1
    finally:
        # A second Ctrl-C during the stop would leave roles running: ignore it until done.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        launcher.stop()


if __name__ == "__main__":
    sys.exit(main())

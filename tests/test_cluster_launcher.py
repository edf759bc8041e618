"""`pdserve up` as a process: a launcher killed with SIGKILL takes its nodes and proxy with it; SIGINT
after traffic ends the cluster within seconds."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pdserve.cluster import free_port
from pdserve.utils import child_pids, is_alive


def start_up(tmp_path: Path, **popen) -> tuple[subprocess.Popen, int]:
    """`pdserve up` on random:tiny (no Redis), once its proxy answers /health: (process, port)."""
    port = free_port()
    up = subprocess.Popen(
        [sys.executable, "-m", "pdserve", "up", "--port", str(port), "--model", "random:tiny"]
        + ["--threads-per-node", "1", "--redis-url", "none", "--log-dir", str(tmp_path)],
        **popen,
    )
    deadline = time.monotonic() + 180
    while True:
        if up.poll() is not None:
            raise AssertionError("pdserve up exited")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return up, port
        except OSError:
            pass
        if time.monotonic() > deadline:
            up.kill()
            raise AssertionError("cluster did not come up")
        time.sleep(0.5)


def test_killed_launcher_leaves_no_processes(tmp_path):
    up, _ = start_up(tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        kids = child_pids(up.pid)
        assert len(kids) == 3  # prefill, decode, proxy
        os.kill(up.pid, signal.SIGKILL)
        up.wait()
        deadline = time.monotonic() + 20
        while any(is_alive(k) for k in kids):
            assert time.monotonic() < deadline, f"left behind: {[k for k in kids if is_alive(k)]}"
            time.sleep(0.2)
    finally:
        if up.poll() is None:
            up.kill()


def test_up_exits_promptly_after_serving(tmp_path):
    """After 20 requests, SIGINT to a backgrounded `pdserve up` ends it within 5 s. The launcher SIGTERMs the
    proxy, then both nodes, waiting for each in turn (it would SIGKILL only after 45 s), so every
    node also drained and exited within 5 s of its SIGTERM. (A prefill node kept each prompt's
    output slot after it was read and waited its 30 s drain timeout out: ~37 s.)"""
    up, port = start_up(
        tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # As a shell starts `pdserve up &`: SIGINT ignored, which Python keeps unless told otherwise.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        kids = child_pids(up.pid)
        body = {"model": "random:tiny", "prompt": "hello there", "max_tokens": 4, "temperature": 0}

        def one(i: int) -> int:
            data = json.dumps({**body, "stream": i % 2 == 0}).encode()
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions", data, {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=60) as r:
                r.read()
                return r.status

        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(one, range(20))) == [200] * 20
        started = time.monotonic()
        os.kill(up.pid, signal.SIGINT)
        up.wait(timeout=30)
        took = time.monotonic() - started
        assert took < 5.0, f"pdserve up took {took:.1f} s to exit after SIGINT"
        assert not any(is_alive(k) for k in kids)
        assert "stopping" in up.stdout.read()
    finally:
        if up.poll() is None:
            up.kill()


def _up(*args: str, tmp_path: Path, cache_dir: Path | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pdserve", "up", "--threads-per-node", "1", "--redis-url", "none", *args]
    env = dict(os.environ)
    if cache_dir is not None:
        env["PDSERVE_CACHE_DIR"] = str(cache_dir)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)


def test_busy_port_is_refused_before_anything_starts(tmp_path):
    """A second `pdserve up` on a port in use says which port, starts nothing (no node logs), and never
    claims to be up (it used to find the first cluster's proxy healthy)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        logs = tmp_path / "logs"
        proc = _up("--port", str(port), "--model", "random:tiny", "--log-dir", str(logs), tmp_path=tmp_path)
    assert proc.returncode == 1
    assert "pdserve is up" not in proc.stdout
    assert f"port {port} on 127.0.0.1 is taken" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list(logs.glob("*.log"))


def test_bad_model_path_is_one_line(tmp_path):
    proc = _up("--port", str(free_port()), "--model", str(tmp_path / "nonexistent"), tmp_path=tmp_path)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "nonexistent" in lines[0] and "HF-format folder" in lines[0], proc.stderr


def test_each_run_logs_into_a_folder_of_its_own(tmp_path):
    """Two clusters with the default log folder never share (and truncate) each other's logs."""
    from pdserve.cluster import ClusterConfig, LocalCluster
    from pdserve.config import ModelConfig

    model = ModelConfig(model="random:llama-3-8b", cache_dir=str(tmp_path))  # no tokenizer to convert
    dirs = []
    for _ in range(2):
        c = LocalCluster(ClusterConfig(port=free_port(), redis_url="none", decode_nodes=0), [], model)
        try:
            c.start()  # refused after its log folder is made: a cluster needs a decode node
        except RuntimeError as e:
            assert "at least one decode" in str(e)
        dirs.append(c.log_dir)
    assert dirs[0] != dirs[1]
    assert all(d.parent == tmp_path / "logs" and d.is_dir() for d in dirs)

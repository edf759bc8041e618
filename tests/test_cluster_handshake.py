"""Mismatched peers are refused when the cluster forms, with an error naming the mismatch."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx

from pdserve.cluster import free_port


def _start(role: str, port: int, *flags: str, log) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "pdserve",
        "node",
        "--role",
        role,
        "--port",
        str(port),
        "--num-threads",
        "1",
        "--model",
        "random:tiny",
        *flags,
    ]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def _wait(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{url} exited"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} never became healthy")


def test_proxy_refuses_block_size_mismatch(default_model_dir, tmp_path):
    pp, dp = free_port(), free_port()
    with open(tmp_path / "nodes.log", "w") as log:
        prefill = _start("prefill", pp, "--block-size", "16", log=log)
        decode = _start("decode", dp, "--block-size", "32", log=log)
        try:
            _wait(f"http://127.0.0.1:{pp}", prefill)
            _wait(f"http://127.0.0.1:{dp}", decode)
            proxy = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pdserve",
                    "proxy",
                    "--port",
                    str(free_port()),
                    "--model",
                    "random:tiny",
                    "--prefill-urls",
                    f"127.0.0.1:{pp}",
                    "--decode-urls",
                    f"127.0.0.1:{dp}",
                    "--startup-timeout-s",
                    "60",
                ],
                capture_output=True,
                text=True,
                timeout=120,
            )
        finally:
            prefill.kill()
            decode.kill()
    assert proxy.returncode != 0
    assert "block_size" in proxy.stderr and "16" in proxy.stderr and "32" in proxy.stderr, proxy.stderr

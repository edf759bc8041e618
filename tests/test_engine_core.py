"""The engine core in a process of its own (as vLLM V1's EngineCore), on real processes.

A node spawns its engine core; requests cross to it as typed messages and their tokens come back
once per step; the core's counters reach the node's /metrics. Neither process outlives the other:
a node whose core dies exits at once (a dead node, to the proxy, which migrates its streams), and
a core whose node dies goes with it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from pdserve.cluster import free_port
from pdserve.messages import LandingDescriptor, PrefillRequest, Reply, ReserveRequest, StreamRequest
from pdserve.sampling_params import SamplingParams
from tests import node_link


class _Node:
    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-m", "pdserve", "node", "--role", "both", "--port", str(self.port)]
        cmd += ["--model", "random:tiny", "--num-threads", "1", "--max-model-len", "4096"]
        cmd += ["--kv-transfer-timeout-s", "2"]  # a handshake with nobody fails fast
        with open(log, "w") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_healthy(self, timeout: float = 180.0) -> None:
        give_up = time.monotonic() + timeout
        while time.monotonic() < give_up:
            assert self.proc.poll() is None, f"node exited:\n{self.log.read_text()[-3000:]}"
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"node never became healthy:\n{self.log.read_text()[-3000:]}")

    @property
    def core_pid(self) -> int:
        found = re.search(r"engine core process (\d+) started", self.log.read_text())
        assert found, self.log.read_text()[-3000:]
        return int(found.group(1))

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead too
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("engine-core")
    pair = [_Node(folder / "a.log"), _Node(folder / "b.log")]
    try:
        for node in pair:
            node.wait_healthy()
        yield pair
    finally:
        for node in pair:
            node.stop()


def _reserve(link: node_link.NodeLink, rid: str, max_tokens: int) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    reply = link.call(ReserveRequest(rid, list(range(10, 40)), params, lease_s=30.0, local_prefill=True))
    assert reply.status == 200, reply


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} missing from /metrics")


def test_the_engine_runs_in_a_child_process_and_serves_through_it(nodes):
    node = nodes[0]
    core = node.core_pid
    assert core != node.proc.pid and _parent(core) == node.proc.pid and _alive(core)
    before = _metric(node.url, "pdserve_prompt_tokens_computed_total")
    with node_link.NodeLink(node.url) as link:
        _reserve(link, "r1", 8)
        events = link.stream("r1")
    assert sum(len(e.token_ids) for e in events) == 8 and events[-1].finish_reason == "length"
    assert all(e.num_prompt_tokens == 30 for e in events)
    # Counters that live in the core reach the node's /metrics.
    assert _metric(node.url, "pdserve_prompt_tokens_computed_total") >= before + 30
    assert _metric(node.url, "pdserve_kv_blocks_free") == _metric(node.url, "pdserve_kv_blocks_total")
    # Both processes froze their start-up heap out of the collector's passes (pdserve.gc_heap).
    for process in ("core", "node"):
        assert _metric(node.url, f'pdserve_gc_frozen_objects{{process="{process}"}}') > 10_000


def test_every_reply_carries_the_node_s_load(nodes):
    """The node's load as of its last step rides on each call's reply (the proxy routes on it)."""
    node = nodes[0]
    params = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)

    def probe_until(enough) -> Reply:
        give_up = time.monotonic() + 30
        while True:  # a reply after the engine turned with the requests counts them
            reply = link.call(ReserveRequest("probe", list(range(10, 40)), params, 30.0, local_prefill=True))
            assert reply.status == 200 and reply.load is not None, reply
            link.abort("probe")
            if enough(reply.load):
                return reply
            assert time.monotonic() < give_up, reply.load

    with node_link.NodeLink(node.url) as link:
        # Reserved with a local prefill, streams not opened: the node holds them outside the
        # engine, and they wait as much as queued ones (the probe itself is at most one more).
        for i in range(3):
            _reserve(link, f"held-{i}", 8)
        probe_until(lambda load: load.waiting >= 3)
        for i in range(3):
            link.abort(f"held-{i}")
        _reserve(link, "busy", 4000)
        assert link.reply(link.start(StreamRequest("busy"))).status == 200  # it runs once its stream opened
        reply = probe_until(lambda load: load.running >= 1)
        assert reply.load.total_blocks > reply.load.free_blocks
        refused = link.call(ReserveRequest("busy", list(range(10, 40)), params, 30.0, local_prefill=True))
        assert refused.status != 200 and refused.load is not None, refused  # refusals say it too
        link.abort("busy")


def test_a_prefill_whose_decode_node_never_answers_the_handshake_fails_and_leaves_nothing(nodes):
    """The handshake runs inside the prefill's one call to the core (``AddPrefill``): a decode node
    that never answers it fails the call with 502, each time, and nothing stays queued."""
    node = nodes[0]
    dead = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    with node_link.NodeLink(node.url) as link:
        for rid in ("hs-1", "hs-2"):  # a failed handshake is tried again by the next prompt
            landing = LandingDescriptor(rid, "decode-x", dead, [7], 16, time.time() + 30)
            msg = PrefillRequest(rid, list(range(10, 26)), SamplingParams(max_tokens=4), landing)
            started = time.monotonic()
            reply = link.call(msg, timeout=30)
            assert reply.status == 502 and reply.error_type == "prefill_failed", reply
            assert time.monotonic() - started < 15
        _reserve(link, "after-hs", 2)  # the node still serves
        assert sum(len(e.token_ids) for e in link.stream("after-hs")) == 2
    assert _metric(node.url, "pdserve_waiting_requests") == 0
    assert _metric(node.url, "pdserve_kv_blocks_free") == _metric(node.url, "pdserve_kv_blocks_total")


def test_a_node_whose_core_dies_exits_and_its_streams_see_it_go(nodes):
    """To the proxy a node whose core died is a node that died: its connection drops (so the proxy
    migrates the streams), it does not sit there without an engine."""
    node = nodes[0]
    with node_link.NodeLink(node.url) as link:
        _reserve(link, "long", 4000)
        call = link.start(StreamRequest("long"))
        assert link.reply(call).status == 200
        give_up = time.monotonic() + 30
        while not any(e.request_id == "long" and e.token_ids for e in link._events):
            assert time.monotonic() < give_up, "no token came"
            link._recv(1.0)
        os.kill(node.core_pid, signal.SIGKILL)
        assert node.proc.wait(10) != 0
        assert "engine core is gone (its process was killed by SIGKILL)" in node.log.read_text()
        with pytest.raises(TimeoutError):  # no final event: the stream was cut, not finished
            link.read("long", timeout=1)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{node.url}/health", timeout=2)


def _core_sockets(node_pid: int) -> list[str]:
    """The node's sockets to its core: abstract ipc names, listed in /proc/net/unix while open."""
    name = f"@pdserve-core-{node_pid}-"
    return [line for line in Path("/proc/net/unix").read_text().splitlines() if name in line]


def test_a_core_whose_node_dies_goes_with_it(nodes):
    """... and a node killed with SIGKILL leaves nothing behind: no process, no socket file."""
    node = nodes[1]
    core = node.core_pid
    assert _alive(core)
    assert _core_sockets(node.proc.pid)
    files_before = set(Path(tempfile.gettempdir()).glob("pdserve-core-*"))
    os.kill(node.proc.pid, signal.SIGKILL)  # the node alone, not its process group
    node.proc.wait(10)
    give_up = time.monotonic() + 10
    while _alive(core):
        assert time.monotonic() < give_up, "the engine core outlived its node"
        time.sleep(0.1)
    assert not _core_sockets(node.proc.pid)
    assert set(Path(tempfile.gettempdir()).glob("pdserve-core-*")) == files_before

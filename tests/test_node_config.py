"""Node and proxy configuration: roles, the cluster token from the environment, URL lists, exposed
nodes without a token."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pdserve import envs
from pdserve.config import NodeConfig
from pdserve.prefix_index import redacted
from pdserve.proxy.config import ProxyConfig


def test_cluster_token_from_the_environment(monkeypatch):
    monkeypatch.setattr(envs, "PDSERVE_CLUSTER_TOKEN", "from-env")
    assert NodeConfig().cluster_token == "from-env"
    assert NodeConfig(cluster_token="flag").cluster_token == "flag"
    assert ProxyConfig(decode_urls=("d:1",)).cluster_token == "from-env"


def test_roles_and_url_lists():
    with pytest.raises(ValueError, match="unknown node role"):
        NodeConfig(role="router")
    with pytest.raises(ValueError, match="at least one decode or co-located"):
        ProxyConfig(prefill_urls=("p:1",))
    with pytest.raises(ValueError, match="listed as decode and as co-located"):
        ProxyConfig(decode_urls=("n:1",), both_urls=("n:1",))
    cfg = ProxyConfig(prefill_urls=("b:1",), both_urls=("b:1",))  # a both node may also prefill for others
    assert cfg.both_urls == ("http://b:1",) and cfg.prefill_urls == ("http://b:1",)


def test_ports_in_range_and_the_lane_port_of_its_own():
    assert NodeConfig(kv_port=8200, kv_lane_port=8201).kv_lane_port == 8201
    with pytest.raises(ValueError, match="the lane needs a port of its own"):
        NodeConfig(kv_port=8200, kv_lane_port=8200)
    with pytest.raises(ValueError, match=r"kv_lane_port must be in \[0, 65535\], got 70000"):
        NodeConfig(kv_lane_port=70000)
    with pytest.raises(ValueError, match="kv_port must be in"):
        NodeConfig(kv_port=-1)


def test_redis_password_is_masked_in_logs():
    assert redacted("redis://:secret@10.0.0.1:6379/0") == "redis://:***@10.0.0.1:6379/0"
    assert redacted("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_exposed_node_needs_a_cluster_token(monkeypatch):
    monkeypatch.setattr(envs, "PDSERVE_CLUSTER_TOKEN", "")
    with pytest.raises(ValueError, match="without a cluster token"):
        NodeConfig(host="0.0.0.0")
    with pytest.raises(ValueError, match="10.1.2.3"):
        NodeConfig(kv_host="10.1.2.3")
    assert NodeConfig(host="0.0.0.0", cluster_token="s").host == "0.0.0.0"
    assert NodeConfig(host="0.0.0.0", insecure_no_cluster_token=True).cluster_token == ""
    assert NodeConfig(host="localhost", kv_host="::1").cluster_token == ""


def test_cli_refuses_an_exposed_node_in_one_line():
    """What the operator sees: one line saying why and what to pass, no traceback, nothing started."""
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_CLUSTER_TOKEN"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve",
            "node",
            "--role",
            "decode",
            "--host",
            "0.0.0.0",
            "--model",
            "random:tiny",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert "--insecure-no-cluster-token" in proc.stderr.strip().splitlines()[-1]

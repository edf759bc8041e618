#!/usr/bin/env python3
"""A multi-host testbed on one machine: one network namespace per host, joined by a bridge.

Each namespace gets loopback up and one veth whose far end (``eth0``) carries its own address
on a /24 taken from 198.18.0.0/15 (RFC 2544's range for network tests, so it collides with no
real network); the bridge holds ``.1`` in the root namespace, so this machine reaches every
"host". Names carry a random suffix so parallel labs never collide. Needs root.

    python deploy/ssh/netns_lab.py create redis proxy prefill-0 prefill-1 decode-0   # prints the lab
    python deploy/ssh/launch.py --runner netns up hosts-file                          # at=<namespace>
    python deploy/ssh/netns_lab.py destroy <suffix>

Cutting a host off the network is ``ip link set <its veth> down`` (``NetnsLab.cut``).
"""

from __future__ import annotations

import argparse
import ipaddress
import random
import secrets
import subprocess
import sys
from dataclasses import dataclass

RANGE = ipaddress.ip_network("198.18.0.0/15")


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@dataclass(frozen=True)
class LabHost:
    name: str
    netns: str
    address: str
    veth: str
    """The veth end on the bridge, in the root namespace."""


def _used_subnets() -> set[ipaddress.IPv4Network]:
    used = set()
    for line in ip("-4", "-o", "addr", "show").stdout.splitlines() + ip("-4", "route").stdout.splitlines():
        for word in line.split():
            try:
                net = ipaddress.ip_interface(word).network if "/" in word else None
            except ValueError:
                continue
            if net is not None and net.overlaps(RANGE):
                used.add(ipaddress.ip_network(f"{net.network_address}/24", strict=False))
    return used


def permitted() -> str:
    """Empty when namespaces can be made here, else why not."""
    probe = f"pdprobe{secrets.token_hex(3)}"
    try:
        r = ip("netns", "add", probe, check=False)
    except FileNotFoundError:
        return "the `ip` command (iproute2) is not installed"
    if r.returncode != 0:
        return f"`ip netns add` is not permitted here: {r.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    bridge = f"pdprobe{secrets.token_hex(3)}"
    r = ip("link", "add", bridge, "type", "bridge", check=False)
    if r.returncode != 0:
        return f"cannot create a bridge here: {r.stderr.strip()}"
    ip("link", "del", bridge, check=False)
    return ""


class NetnsLab:
    """Creates the namespaces, veths and bridge; ``destroy`` removes them even half-made."""

    def __init__(self, names: list[str], suffix: str = "") -> None:
        if len(set(names)) != len(names) or len(names) > 250:
            raise ValueError(f"need up to 250 distinct host names, got {names}")
        self.names = names
        self.suffix = suffix or secrets.token_hex(3)
        self.bridge = f"pdb{self.suffix}"
        self.hosts: dict[str, LabHost] = {}

    def create(self) -> dict[str, LabHost]:
        try:
            self._create()
        except BaseException:
            self.destroy()
            raise
        return self.hosts

    def _create(self) -> None:
        used = _used_subnets()
        free = [n for n in RANGE.subnets(new_prefix=24) if n not in used]
        subnet = random.choice(free)
        addrs = list(subnet.hosts())
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{addrs[0]}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for i, name in enumerate(self.names, 1):
            host = LabHost(name, f"pd{self.suffix}-{name}", str(addrs[i]), f"pv{self.suffix}{i:03d}")
            self.hosts[name] = host
            ip("netns", "add", host.netns)
            ip("link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
            ip("link", "set", host.veth, "master", self.bridge, "up")
            ns = ["netns", "exec", host.netns, "ip"]
            ip(*ns, "link", "set", "lo", "up")
            ip(*ns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            ip(*ns, "link", "set", "eth0", "up")

    def cut(self, name: str) -> None:
        """Take the host off the network, as a pulled cable would (no RST, packets vanish)."""
        ip("link", "set", self.hosts[name].veth, "down")

    def restore(self, name: str) -> None:
        ip("link", "set", self.hosts[name].veth, "up")

    def destroy(self) -> None:
        destroy(self.suffix)


def destroy(suffix: str) -> None:
    """Remove every namespace, veth and the bridge of lab ``suffix`` (ignores what is gone).
    Processes still running inside a namespace keep it alive but unnamed: stop them first."""
    for line in ip("netns", "list", check=False).stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        if ns.startswith(f"pd{suffix}-"):
            ip("netns", "del", ns, check=False)
    for line in ip("-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":")
        if len(parts) > 1:
            dev = parts[1].strip().split("@")[0]
            if dev.startswith(f"pv{suffix}"):
                ip("link", "del", dev, check=False)
    ip("link", "del", f"pdb{suffix}", check=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("create", help="create a lab and print its hosts (name, namespace, address, veth)")
    c.add_argument("names", nargs="+")
    d = sub.add_parser("destroy", help="remove a lab by its suffix")
    d.add_argument("suffix")
    args = p.parse_args(argv)
    if args.command == "destroy":
        destroy(args.suffix)
        return 0
    why = permitted()
    if why:
        print(f"netns_lab: {why}", file=sys.stderr)
        return 1
    lab = NetnsLab(args.names)
    lab.create()
    print(f"# lab {lab.suffix} (bridge {lab.bridge}); remove with: netns_lab.py destroy {lab.suffix}")
    for h in lab.hosts.values():
        print(f"{h.name}\tat={h.netns}\t{h.address}\t{h.veth}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

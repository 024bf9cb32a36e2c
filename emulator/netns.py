"""Real rate-limited links on this machine: network namespaces behind one bridge, each link
shaped by the kernel's token-bucket filter (``tc qdisc ... tbf``).

A ``Lab`` builds a star: a switch namespace holding a bridge, and one namespace per node (the
coordinator, a relay, each device), joined to the switch by a veth pair. A node's uplink is
shaped on its own end of the pair (what it sends), its downlink on the switch's end (what the
switch sends it), so the coordinator's link is one shared bottleneck for every device, as a
real server's is. This kernel has no netem: round trips are the kernel's own (microseconds);
add latency in user space if a measurement needs it.

Every namespace's name starts with the lab's prefix (``cleave-`` and 6 random hex digits), so
labs do not meet; ``close`` (or leaving the ``with`` block) removes every namespace the lab
made, and with them its links and their processes' sockets, even after a failure. Traffic
stays inside the lab: its addresses are 10.77.0.0/24 on links no other namespace sees.

Needs root and iproute2 (``ip``, ``tc``); ``available()`` says whether this machine can.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field

from cleave.wire.errors import CleaveError

SUBNET = "10.77.0"  # /24, inside the lab only
MIN_BURST = 16 * 1024  # bytes a tbf may send at line rate (at least a few full frames)
LATENCY_MS = 200  # how long a packet may wait in a tbf queue before it is dropped


class LabError(CleaveError, RuntimeError):
    """A namespace, link or shaping rule could not be made."""


@dataclass(frozen=True)
class Link:
    """A node's link to the switch, in bits per second each way (0: not shaped)."""

    down: float
    up: float


@dataclass
class Node:
    name: str  # its role in the lab: "ps", "relay", "d0", ...
    netns: str
    address: str
    link: Link


def available() -> str | None:
    """Why this machine cannot make a lab, or None when it can."""
    if os.name != "posix" or os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} (iproute2) is not installed"
    probe = f"cleave-probe-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _tbf(rate_bits: float) -> list[str]:
    burst = max(MIN_BURST, int(rate_bits / 8 / 50))  # 20 ms at the rate
    return ["tbf", "rate", f"{int(rate_bits)}bit", "burst", str(burst), "latency", f"{LATENCY_MS}ms"]


@dataclass
class Lab:
    """A star of namespaces around a bridge (module doc). Use as a context manager."""

    prefix: str = field(default_factory=lambda: f"cleave-{secrets.token_hex(3)}")
    nodes: dict[str, Node] = field(default_factory=dict)
    _made: list[str] = field(default_factory=list)

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def __enter__(self) -> Lab:
        try:
            self._netns(self.switch)
            self._ip(self.switch, "link", "add", "br0", "type", "bridge")
            self._ip(self.switch, "link", "set", "br0", "up")
            self._ip(self.switch, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add(self, name: str, link: Link) -> Node:
        """A node ``name`` behind ``link``; its address is returned with it."""
        if name in self.nodes or not name.isalnum() or len(name) > 6:
            raise LabError(f"node names are unique, alphanumeric, at most 6 characters: {name!r}")
        index = len(self.nodes) + 1
        node = Node(name, f"{self.prefix}-{name}", f"{SUBNET}.{index}", link)
        # Interface names are at most 15 characters: "v" + 6 hex of the lab + index + end.
        mine, theirs = f"v{self.prefix[-6:]}{index}n", f"v{self.prefix[-6:]}{index}s"
        self._netns(node.netns)
        # Made inside the node's namespace with its peer in the switch's: nothing touches the host's.
        self._ip(node.netns, "link", "add", mine, "type", "veth", "peer", "name", theirs, "netns", self.switch)
        self._ip(node.netns, "link", "set", "lo", "up")
        self._ip(node.netns, "addr", "add", f"{node.address}/24", "dev", mine)
        self._ip(node.netns, "link", "set", mine, "up")
        self._ip(self.switch, "link", "set", theirs, "master", "br0")
        self._ip(self.switch, "link", "set", theirs, "up")
        if link.up > 0:  # what it sends
            self._shape(node.netns, mine, link.up)
        if link.down > 0:  # what the switch sends it
            self._shape(self.switch, theirs, link.down)
        self.nodes[name] = node
        return node

    def command(self, name: str, argv: list[str]) -> list[str]:
        """``argv`` run inside node ``name``'s namespace."""
        return ["ip", "netns", "exec", self.nodes[name].netns, *argv]

    def counters(self, name: str) -> tuple[int, int]:
        """Bytes node ``name`` has sent and received on its link (its interface's counters)."""
        out = subprocess.run(
            ["ip", "netns", "exec", self.nodes[name].netns, "cat", "/proc/net/dev"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for line in out.splitlines():
            iface, _, rest = line.partition(":")
            if iface.strip().startswith("v"):
                fields = rest.split()
                return int(fields[8]), int(fields[0])  # transmitted, received
        raise LabError(f"node {name} has no link")

    def close(self) -> None:
        """Remove every namespace this lab made (their links and processes' sockets with them)."""
        for netns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        self._made.clear()

    def _netns(self, netns: str) -> None:
        self._run(["ip", "netns", "add", netns])
        self._made.append(netns)

    def _shape(self, netns: str, iface: str, rate_bits: float) -> None:
        self._run(["ip", "netns", "exec", netns, "tc", "qdisc", "add", "dev", iface, "root", *_tbf(rate_bits)])

    def _ip(self, netns: str, *args: str) -> None:
        self._run(["ip", "-n", netns, *args])

    @staticmethod
    def _run(argv: list[str]) -> None:
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            raise LabError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")


def leftovers(prefix: str = "cleave-") -> list[str]:
    """Namespaces whose names start with ``prefix`` (a lab that was killed leaves these)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]

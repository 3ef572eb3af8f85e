"""Several hosts on one machine, for tests: each host a network namespace, joined by veth pairs to a
bridge in a namespace of its own. No address, link or route is added to the root namespace; the test
talks to the hosts from inside one of them (``Lab.call_in``: a thread that joined that namespace), and
``Lab.remove`` deletes every namespace it made (their links go with them). Needs root and ``ip``.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")
CLONE_NEWNET = 0x40000000
SUBNET = "10.77.0"  # private; it exists only inside the lab's namespaces


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def can_make_namespaces() -> str | None:
    """None if this process can build a lab; else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    try:
        subprocess.run(["ip", "netns", "list"], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"`ip netns` does not work here: {exc}"
    return None


@dataclass
class Lab:
    """Hosts by name, each with one address on the lab's bridge."""

    prefix: str = field(default_factory=lambda: f"kvt{os.getpid() % 100000}")
    hosts: dict[str, str] = field(default_factory=dict)  # name -> address
    _made: list[str] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"{self.prefix}-br"

    def namespace(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def add_host(self, host: str) -> str:
        """A namespace for ``host``, its ``eth0`` on the bridge; returns its address."""
        if not self._made:
            self._netns(self.bridge)
            ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
            ip("-n", self.bridge, "link", "set", "br0", "up")
        address = f"{SUBNET}.{len(self.hosts) + 1}"
        namespace, port = self.namespace(host), self._bridge_port(host, len(self.hosts))
        self._netns(namespace)
        ip("link", "add", "eth0", "netns", namespace, "type", "veth", "peer", "name", port, "netns", self.bridge)
        ip("-n", self.bridge, "link", "set", port, "master", "br0")
        ip("-n", self.bridge, "link", "set", port, "up")
        ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
        ip("-n", namespace, "link", "set", "eth0", "up")
        ip("-n", namespace, "link", "set", "lo", "up")
        self.hosts[host] = address
        return address

    def _netns(self, name: str) -> None:
        ip("netns", "add", name)
        self._made.append(name)

    def cut(self, host: str) -> None:
        """Cut ``host`` off: its port on the bridge goes down (its own link stays up, as a pulled cable)."""
        ip("-n", self.bridge, "link", "set", self._bridge_port(host), "down")

    def reconnect(self, host: str) -> None:
        ip("-n", self.bridge, "link", "set", self._bridge_port(host), "up")

    def _bridge_port(self, host: str, index: int | None = None) -> str:
        """The bridge's end of ``host``'s veth pair (an interface name: at most 15 characters)."""
        index = list(self.hosts).index(host) if index is None else index
        return f"p{index}-{host}"[:15]

    def command(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace (``ip netns exec`` execs it: the pid is the command's)."""
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def call_in(self, host: str, fn: Callable[[], T], timeout_s: float | None = None) -> T:
        """``fn()`` on a thread that joined ``host``'s network namespace: its sockets are that host's."""
        namespace = self.namespace(host)

        def joined() -> T:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {namespace} failed")
            finally:
                os.close(fd)
            return fn()

        # A fresh thread each time: a thread that joined a namespace never serves anything else.
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            return pool.submit(joined).result(timeout=timeout_s)

    def remove(self) -> None:
        """Delete every namespace the lab made (their veth pairs with them)."""
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self._made.clear()

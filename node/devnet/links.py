"""``intellect-node devnet --links``: every role in its own network namespace, behind a capped link.

Topology: a bridge namespace holding ``br0``; per node a namespace whose ``eth0`` is one end of a
veth pair, the other end a port of ``br0``; one more veth from the host's own namespace into the
bridge, so the devnet process (which stays in the host namespace) reaches the coordinator's run
page and status. Every node's link is capped in both directions by a token bucket (``tc`` ``tbf``):
its ``eth0`` egress (upload) and its bridge port's egress (download). ``netem`` is not available
on these machines, so links have a rate but no added latency.

Rates (:data:`LINK_MBIT`): coordinator and relays 1 Gb/s, validators 500 Mb/s, workers 100 Mb/s.

Set-up needs root (``ip netns``, ``tc``) and refuses with one line otherwise. Everything made here
carries the prefix ``idn<pid>`` (namespaces) and ``idnh<pid>`` (the host-side veth), and is removed
on exit — normal, exception or signal; a run killed outright (SIGKILL) leaves its namespaces
behind, and the next ``--links`` run removes those whose devnet process is gone
(:func:`sweep_stale`). Deleting a namespace deletes its veth ends, their peers and their qdiscs.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self

logger = logging.getLogger(__name__)

LINK_MBIT = {"coordinator": 1000, "relay": 1000, "validator": 500, "worker": 100}
"""Capacity of each role's link, Mb/s, in each direction (issue #25)."""
PREFIX = "idn"
"""Names made here start with this, then the devnet's pid."""
SUBNETS = ipaddress.ip_network("10.231.0.0/16")
"""Each run takes a free /24 of this range (the host side is .254, nodes .1, .2, …)."""
IP_TIMEOUT_S = 15.0
VETH_GONE_S = 2.0
"""How long the host-side veth may take to vanish after its peer's namespace is deleted, seconds."""


class LinksError(RuntimeError):
    """The links could not be set up (not root, no iproute2, a command failed)."""


def _run(*args: str) -> str:
    try:
        r = subprocess.run(list(args), capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LinksError(f"{' '.join(args)}: {e}") from e
    if r.returncode != 0:
        raise LinksError(f"{' '.join(args)}: {r.stderr.strip() or f'exit {r.returncode}'}")
    return r.stdout


def _link_exists(name: str) -> bool:
    try:
        _run("ip", "link", "show", name)
    except LinksError:
        return False
    return True


def unavailable() -> str | None:
    """Why ``--links`` cannot run here (one line), or ``None`` when it can."""
    if os.geteuid() != 0:
        return "--links needs root: it creates network namespaces and tc qdiscs (run as root, or leave out --links)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"--links needs iproute2's {tool!r} (apt-get install iproute2)"
    return None


def namespaces() -> list[str]:
    """Names of the network namespaces that exist now."""
    return [line.split()[0] for line in _run("ip", "netns", "list").splitlines() if line.strip()]


def sweep_stale() -> list[str]:
    """Remove namespaces of earlier ``--links`` runs whose devnet process no longer exists; returns them."""
    removed = []
    for ns in namespaces():
        m = re.fullmatch(rf"{PREFIX}(\d+)-.+", ns)
        if m and not os.path.exists(f"/proc/{m[1]}"):
            try:
                _run("ip", "netns", "del", ns)
                removed.append(ns)
            except LinksError as e:
                logger.warning("could not remove stale namespace %s: %s", ns, e)
    return removed


def tbf_args(mbit: int) -> list[str]:
    """``tc`` arguments of a token bucket at ``mbit`` Mb/s: the bucket holds 8 ms of traffic (≥ 128 KiB,
    so a veth's 64 KiB GSO packets pass) and up to 50 ms may queue before packets are dropped."""
    burst = max(128 * 1024, mbit * 1000)  # 8 ms at mbit × 10⁶ / 8 bytes per second
    return ["tbf", "rate", f"{mbit}mbit", "burst", str(burst), "latency", "50ms"]


@dataclass
class Node:
    """One node's namespace, address and link rate."""

    name: str
    role: str
    namespace: str
    ip: str
    mbit: int


@dataclass
class Links:
    """The namespaces and capped links of one devnet (a context manager: set up on enter, removed on exit).

    Args:
        nodes: ``name → role`` (roles are keys of :data:`LINK_MBIT`).
        mbit: override of :data:`LINK_MBIT` per role.
    """

    nodes_wanted: dict[str, str]
    mbit: dict[str, int] = field(default_factory=dict)
    nodes: dict[str, Node] = field(default_factory=dict)
    made: list[str] = field(default_factory=list)
    host_ip: str = ""
    host_veth: str = ""

    def __post_init__(self) -> None:
        self.tag = f"{PREFIX}{os.getpid()}"
        self.bridge = f"{self.tag}-br"

    # --- set-up and teardown --------------------------------------------------------------------

    def __enter__(self) -> Self:
        self.setup()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.teardown()

    def _free_subnet(self) -> ipaddress.IPv4Network:
        used = _run("ip", "-4", "-o", "addr", "show")
        for net in SUBNETS.subnets(new_prefix=24):
            if f" {str(net.network_address)[:-1]}" not in used:  # "10.231.7." not on any host interface
                return net  # type: ignore[return-value]
        raise LinksError(f"no free /24 left in {SUBNETS}")

    def setup(self) -> None:
        """Make the bridge, a namespace per node with its capped link, and the host's way in.

        Raises:
            LinksError: not root, a tool missing, or a command failed (what was made is removed first).
        """
        why = unavailable()
        if why:
            raise LinksError(why)
        for ns in sweep_stale():
            logger.warning("removed namespace %s left by a devnet that was killed", ns)
        try:
            self._setup()
        except BaseException:
            self.teardown()
            raise

    def _setup(self) -> None:
        net = self._free_subnet()
        hosts = list(net.hosts())
        _run("ip", "netns", "add", self.bridge)
        self.made.append(self.bridge)
        _run("ip", "-n", self.bridge, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.bridge, "link", "set", "br0", "up")
        for i, (name, role) in enumerate(self.nodes_wanted.items()):
            ns = f"{self.tag}-{name}"
            ip = str(hosts[i])
            mbit = self.mbit.get(role, LINK_MBIT[role])
            _run("ip", "netns", "add", ns)
            self.made.append(ns)
            port = f"p{i}"
            _run("ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", self.bridge)
            _run("ip", "-n", ns, "addr", "add", f"{ip}/{net.prefixlen}", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", self.bridge, "link", "set", port, "master", "br0")
            _run("ip", "-n", self.bridge, "link", "set", port, "up")
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", *tbf_args(mbit))  # upload
            _run("ip", "netns", "exec", self.bridge, "tc", "qdisc", "add", "dev", port, "root", *tbf_args(mbit))  # download
            self.nodes[name] = Node(name, role, ns, ip, mbit)
        # the host's own way in (uncapped): the devnet process polls the run page and status from here
        self.host_veth = f"{PREFIX}h{os.getpid() % 10**9}"[:15]
        self.host_ip = str(hosts[-1])
        _run("ip", "link", "add", self.host_veth, "type", "veth", "peer", "name", "ph", "netns", self.bridge)
        _run("ip", "addr", "add", f"{self.host_ip}/{net.prefixlen}", "dev", self.host_veth)
        _run("ip", "link", "set", self.host_veth, "up")
        _run("ip", "-n", self.bridge, "link", "set", "ph", "master", "br0")
        _run("ip", "-n", self.bridge, "link", "set", "ph", "up")
        logger.info("links: %s", ", ".join(f"{n.name} {n.ip} {n.mbit} Mb/s" for n in self.nodes.values()))

    def teardown(self) -> list[str]:
        """Remove every namespace made here (their veths and qdiscs go with them) and the host veth.

        Returns:
            What could not be removed (empty when everything is gone); each is logged at ERROR.
        """
        left = []
        for ns in reversed(self.made):
            try:
                _run("ip", "netns", "del", ns)
            except LinksError as e:
                if ns in namespaces():
                    logger.error("could not remove namespace %s: %s", ns, e)
                    left.append(ns)
        self.made = [ns for ns in self.made if ns in left]
        if self.host_veth:
            # it goes with its peer in the bridge namespace (the kernel may take a moment); removed here if not
            end = time.monotonic() + VETH_GONE_S
            while _link_exists(self.host_veth) and time.monotonic() < end:
                time.sleep(0.05)
            if _link_exists(self.host_veth):
                try:
                    _run("ip", "link", "del", self.host_veth)
                except LinksError as e:
                    if _link_exists(self.host_veth):
                        logger.error("could not remove veth %s: %s", self.host_veth, e)
                        left.append(self.host_veth)
            if self.host_veth not in left:
                self.host_veth = ""
        return left

    # --- use ------------------------------------------------------------------------------------

    def ip(self, name: str) -> str:
        """The address of node ``name``."""
        return self.nodes[name].ip

    def wrap(self, name: str, argv: list[str]) -> list[str]:
        """``argv`` run inside node ``name``'s namespace (``ip netns exec`` execs it: the same pid)."""
        return ["ip", "netns", "exec", self.nodes[name].namespace, *argv]

"""Separate hosts on one machine: Linux network namespaces joined by veth pairs to one switch.

Each host is a namespace with its own loopback and one interface, ``eth0``, cabled by a veth pair to
a port of a bridge (the switch). The switch is a namespace of its own, not the root namespace: the
root namespace of a machine that runs Docker has bridge netfilter on and a FORWARD policy of DROP,
which would filter the frames bridged there, and nothing of the test's should touch the machine's
own routes and rules. The test's client is a host too: the test process's thread enters its
namespace (``entered``), and the threads it starts are born there. No interface of the test's is
ever in the root namespace, where every UCX process on the machine would advertise it and fail
over it once it vanished (seen: another test's KV transfer failed on such a veth).

Addresses come from ``10.213.N.0/24``, a private range used for nothing else on these machines (N
from the test process's id, skipping any /24 the root namespace already routes). The hosts have no
route but their own subnet: they can reach each other and their own 127.0.0.1, and nothing else.

Every link is shaped on its egress (``eth0`` of each host): ``netem`` delay, rate and loss where
the kernel has it; where it does not (``sch_netem`` is not built into every kernel, e.g. these
development machines' 6.18 firecracker kernel), the rate by ``tbf`` and the loss by an iptables
``statistic`` rule on each host's input, with no delay: ``Network.shaping`` says which.

A partition cuts a host's cable at the switch (``cut``: its switch port down): frames neither leave
nor reach it and no endpoint is told, as when a switch port or a host's NIC fails. ``heal`` puts it
back.

Names carry the test process's id (``bnt<pid>-<host>``), so that runs never collide; ``close()``
kills whatever still runs in the namespaces (only this module's processes can) and deletes them,
which deletes their veths; namespaces a killed run left behind (its process gone) are removed by
the next ``Network.start()``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PREFIX = "bnt"
"""Every namespace this module makes starts with it."""
SUBNETS = ipaddress.ip_network("10.213.0.0/16")
"""The private range the test's subnets are carved from (one /24 per run)."""
CLONE_NEWNET = 0x40000000  # <linux/sched.h>


class NetnsError(RuntimeError):
    """A command that builds or changes the network failed (its stderr is in the message)."""


def unavailable() -> str | None:
    """Why namespaced hosts cannot be made here (not root, no ``ip``, ``ip netns add`` refused);
    None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=10)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    return None


def sh(*argv: str, timeout_s: float = 10.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one command (bounded); a failure raises ``NetnsError`` with the command and its stderr."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    if check and done.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()}")
    return done


@dataclass(frozen=True)
class LinkShape:
    """What every host's link does to the frames it sends."""

    delay_ms: float = 2.0
    """One-way delay added on each host's egress (netem only)."""
    rate_mbit: float = 1000.0
    """Bandwidth of each host's egress, Mbit/s."""
    loss_pct: float = 0.1
    """Share of packets lost, in percent."""


@dataclass(frozen=True)
class Host:
    """One namespace with one address."""

    name: str
    netns: str
    address: str

    def argv(self, *argv: str) -> list[str]:
        """``argv`` run inside this host (``ip netns exec`` execs it: the pid stays the command's)."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def sh(self, *argv: str, timeout_s: float = 10.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        return sh(*self.argv(*argv), timeout_s=timeout_s, check=check)

    def rx_bytes(self) -> int:
        """Bytes received on this host's ``eth0`` so far."""
        return int(self.sh("cat", "/sys/class/net/eth0/statistics/rx_bytes").stdout)


class Network:
    """The switch and its hosts. ``start()`` builds the switch; ``close()`` removes everything
    (idempotent, also after a half-built start)."""

    def __init__(self, shape: LinkShape = LinkShape()) -> None:
        self.tag = f"{PREFIX}{os.getpid()}"
        self.switch = f"{self.tag}-sw"
        self.shape = shape
        self.hosts: dict[str, Host] = {}
        self.subnet: ipaddress.IPv4Network | None = None
        self.shaping = ""
        """What ``shape`` became on this kernel, in words (set by the first ``add_host``)."""
        self._namespaces: list[str] = []
        self._addresses = 0  # hosts ever added: a host added again gets a new address
        self._netem: bool | None = None

    # -- building -------------------------------------------------------------------------------
    def start(self) -> None:
        """Remove what dead runs left, pick a free /24, make the switch."""
        remove_stale()
        self.subnet = _free_subnet(os.getpid())
        self._add_namespace(self.switch)
        sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.switch, "link", "set", "br0", "up")

    def add_host(self, name: str) -> Host:
        """A new namespace cabled to the switch, with the next address and the shaped link."""
        assert self.subnet is not None, "start() first"
        netns = f"{self.tag}-{name}"
        address = str(self.subnet.network_address + 10 + self._addresses)
        self._addresses += 1
        port = _port(name)
        self._add_namespace(netns)
        cable = ["eth0", "netns", netns, "type", "veth", "peer", "name", port, "netns", self.switch]
        sh("ip", "link", "add", *cable)
        host = Host(name, netns, address)
        host.sh("sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1")
        host.sh("ip", "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0")
        host.sh("ip", "link", "set", "lo", "up")
        host.sh("ip", "link", "set", "eth0", "up")
        self._plug(port)
        self._shape(host)
        self.hosts[name] = host
        return host

    def remove_host(self, name: str) -> None:
        """Host ``name`` gone: what runs there killed, its namespace and cable deleted. The cable
        goes first, at the switch: a namespace's devices go only once the kernel gets round to it,
        and the switch port's name would still be taken by a host added again at once."""
        host = self.hosts.pop(name)
        sh("ip", "-n", self.switch, "link", "del", _port(name))
        kill_namespace(host.netns)
        self._namespaces.remove(host.netns)

    def _add_namespace(self, netns: str) -> None:
        sh("ip", "netns", "add", netns)
        self._namespaces.append(netns)

    def _plug(self, port: str) -> None:
        sh("ip", "-n", self.switch, "link", "set", port, "master", "br0")
        sh("ip", "-n", self.switch, "link", "set", port, "up")

    def _shape(self, host: Host) -> None:
        """``shape`` on ``host``'s link; the first host finds out what this kernel can do."""
        s = self.shape
        if self._netem is None:
            self._netem = _netem(host, s, check=False)
            self.shaping = _described(s, self._netem, shutil.which("iptables") is not None)
        elif self._netem:
            _netem(host, s)
        if self._netem:
            return
        _tbf(host, s.rate_mbit)
        if s.loss_pct > 0 and shutil.which("iptables") is not None:
            probability = f"{s.loss_pct / 100:.6f}"
            host.sh(
                "iptables", "-A", "INPUT", "-i", "eth0", "-m", "statistic", "--mode", "random",
                "--probability", probability, "-j", "DROP",
            )  # fmt: skip

    def set_rate(self, name: str, rate_mbit: float) -> None:
        """Host ``name``'s egress at ``rate_mbit``, the rest of its shape unchanged."""
        host = self.hosts[name]
        if self._netem:
            _netem(host, LinkShape(self.shape.delay_ms, rate_mbit, self.shape.loss_pct))
        else:
            _tbf(host, rate_mbit)

    @contextlib.contextmanager
    def entered(self, name: str) -> Iterator[Host]:
        """The calling thread inside host ``name`` (its sockets, and those of the threads it starts
        meanwhile, are that host's); back where it was on exit. The network namespace is a thread's
        own: the rest of the process stays where it is."""
        host = self.hosts[name]
        back = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            _setns(f"/run/netns/{host.netns}")
            try:
                yield host
            finally:
                _setns_fd(back)
        finally:
            os.close(back)

    # -- faults ---------------------------------------------------------------------------------
    def cut(self, name: str) -> None:
        """Partition host ``name``: its switch port goes down, nothing crosses its cable."""
        sh("ip", "-n", self.switch, "link", "set", _port(name), "down")

    def heal(self, name: str) -> None:
        sh("ip", "-n", self.switch, "link", "set", _port(name), "up")

    # -- teardown -------------------------------------------------------------------------------
    def close(self) -> None:
        """Kill what still runs in the hosts and delete every namespace (their veths go with them).
        Checks nothing: it runs in teardown, also after a failure."""
        for netns in reversed(self._namespaces):
            kill_namespace(netns)
        self._namespaces.clear()
        self.hosts.clear()


def kill_namespace(netns: str) -> None:
    """SIGKILL every process in ``netns`` (waiting up to 10 s for them to go), then delete it."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pids = [int(p) for p in sh("ip", "netns", "pids", netns, check=False).stdout.split()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    sh("ip", "netns", "del", netns, check=False)


def remove_stale() -> None:
    """Delete the namespaces of runs whose process is gone (a SIGKILLed pytest)."""
    names = [line.split()[0] for line in sh("ip", "netns", "list").stdout.splitlines() if line.strip()]
    for netns in names:
        pid = _owner(netns.split("-", 1)[0])
        if pid is not None and not Path(f"/proc/{pid}").exists():
            kill_namespace(netns)


def _port(host: str) -> str:
    """The switch's port for ``host`` (an interface name: 15 characters at most)."""
    return f"p-{host}"[:15]


def _owner(tag: str) -> int | None:
    """The process id in one of this module's tags (``bnt1234``), None for any other name."""
    digits = tag[len(PREFIX) :]
    return int(digits) if tag.startswith(PREFIX) and digits.isdigit() else None


def _free_subnet(seed: int) -> ipaddress.IPv4Network:
    """A /24 of ``SUBNETS`` that no route of the root namespace overlaps, chosen from ``seed``."""
    routes = [
        ipaddress.ip_network(line.split()[0])
        for line in sh("ip", "-4", "route", "show", "table", "all").stdout.splitlines()
        if line and line.split()[0][0].isdigit()
    ]
    subnets = list(SUBNETS.subnets(new_prefix=24))[1:255]
    for i in range(len(subnets)):
        candidate = subnets[(seed + i) % len(subnets)]
        if not any(candidate.overlaps(r) for r in routes):
            return candidate
    raise NetnsError(f"every /24 of {SUBNETS} is routed already")


def _setns(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        _setns_fd(fd)
    finally:
        os.close(fd)


def _setns_fd(fd: int) -> None:
    """setns(2) of the calling thread into the network namespace ``fd`` (os.setns is 3.12+)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def _described(s: LinkShape, netem: bool, iptables: bool) -> str:
    """What ``s`` became: netem's own words, or the fallback's."""
    if netem:
        return (
            f"netem: {s.delay_ms} ms delay, {s.rate_mbit:g} Mbit/s, {s.loss_pct}% loss on each host's egress"
        )
    loss = f"iptables {s.loss_pct}% random drop on each host's input" if iptables else "no loss (no iptables)"
    return (
        f"no netem in this kernel: tbf {s.rate_mbit:g} Mbit/s on each host's egress, {loss}, no added delay"
    )


def _netem(host: Host, s: LinkShape, check: bool = True) -> bool:
    """Put netem on ``host``'s egress; False (nothing changed) when the kernel has no netem. Its
    queue holds the packets in flight over the delay plus 50 ms of the rate, as ``_tbf``'s."""
    packets = max(100, int(s.rate_mbit * 1e6 / 8 * (s.delay_ms / 1000 + 0.05) / 1500))
    done = host.sh(
        "tc", "qdisc", "replace", "dev", "eth0", "root", "netem", "delay", f"{s.delay_ms}ms",
        "rate", f"{s.rate_mbit:g}mbit", "loss", f"{s.loss_pct}%", "limit", str(packets),
        check=check,
    )  # fmt: skip
    return done.returncode == 0


def _tbf(host: Host, rate_mbit: float) -> None:
    """A token bucket on ``host``'s egress: ``rate_mbit``, bursts of 4 ms of it (at least 16 KB, as
    the kernel's timer needs), and at most 50 ms of queue, so that a gRPC ping's answer never waits
    long behind the KV it shares the link with."""
    bytes_per_s = rate_mbit * 1e6 / 8
    burst = max(16 * 1024, int(bytes_per_s * 0.004))
    host.sh(
        "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", f"{rate_mbit:g}mbit",
        "burst", str(burst), "latency", "50ms",
    )  # fmt: skip

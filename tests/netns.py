"""Separate network hosts on one machine: Linux network namespaces, two on a veth pair or N on a bridge.

    with netns.hosts(names=("node01", "node02")) as (a, b):
        subprocess.run(a.command(["python", "-c", "..."]))   # runs on "node01", 10.77.0.1

Each namespace has its own loopback and one end of the veth pair (10.77.0.1/24 and
10.77.0.2/24), so traffic between them can only cross the veth link, whose byte
counters ``Host.veth_bytes`` reads. With ``names``, each namespace gets its own
/etc/netns/<ns>/hosts, which ``ip netns exec`` mounts over /etc/hosts: the test's name
resolver. Everything is removed on leaving, even after a failure (processes still in a
namespace are killed first), and namespaces left by a test run that was killed are
removed on the next entry. Needs root and the ``ip`` tool; ``unavailable()`` says why not.

``bridged(n)`` makes N hosts (10.78.0.1 ...) whose veth links meet on a bridge inside a
namespace of its own (the machine's own network is untouched); ``Host.kill_all()`` kills
every process on a host at once, as when the machine dies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import shutil
import signal
import subprocess
from typing import Iterator, Sequence

SUBNET = "10.77.0"
BRIDGED_SUBNET = "10.78.0"
IP_TIMEOUT = 30  # seconds for one `ip` command: a stuck one fails the test instead of hanging CI
_PREFIX = "tfdn"  # tfdist netns: tfdn<pid>-<n><a|b> names the namespaces, tfdv<pid>-<n><a|b> the veth ends
_serial = itertools.count()


@dataclasses.dataclass(frozen=True)
class Host:
    namespace: str
    address: str
    device: str
    hostname: str | None

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host's network namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def pids(self) -> list[int]:
        """The processes running on this host."""
        listed = subprocess.run(["ip", "netns", "pids", self.namespace], capture_output=True, text=True,
                                timeout=IP_TIMEOUT).stdout
        return [int(pid) for pid in listed.split()]

    def kill_all(self) -> None:
        """SIGKILLs every process on this host: the machine died."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def veth_bytes(self) -> int:
        """Bytes sent plus received on this host's end of the veth pair."""
        counts = [_ip("netns", "exec", self.namespace, "cat", f"/sys/class/net/{self.device}/statistics/{name}")
                  for name in ("tx_bytes", "rx_bytes")]
        return sum(int(count) for count in counts)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None when they can)."""
    if shutil.which("ip") is None:
        return "the 'ip' tool (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"{_PREFIX}{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=IP_TIMEOUT)
    if made.returncode != 0:
        return f"'ip netns add' failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=IP_TIMEOUT)
    return None


@contextlib.contextmanager
def hosts(names: Sequence[str] | None = None, prefix: str = _PREFIX) -> Iterator[tuple[Host, Host]]:
    """Two namespaces on one veth link; ``names`` (two host names) go into their hosts files.

    ``prefix`` (4 characters) starts the namespaces' names, its first 3 the veth ends'.
    """
    _remove_stale(prefix)
    tag = f"{os.getpid()}-{next(_serial)}"
    made = [Host(f"{prefix}{tag}{end}", f"{SUBNET}.{i + 1}", f"{prefix[:3]}v{tag}{end}", names[i] if names else None)
            for i, end in enumerate("ab")]
    try:
        for host in made:
            _ip("netns", "add", host.namespace)
        _ip("link", "add", made[0].device, "type", "veth", "peer", "name", made[1].device)
        for host in made:
            _ip("link", "set", host.device, "netns", host.namespace)
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.device)
            _ip("-n", host.namespace, "link", "set", host.device, "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
            if names:
                _write_hosts_file(host, made)
        yield made[0], made[1]
    finally:
        for host in made:
            _remove(host.namespace)
        subprocess.run(["ip", "link", "del", made[0].device], capture_output=True, timeout=IP_TIMEOUT)  # if never moved


@contextlib.contextmanager
def bridged(count: int, names: Sequence[str] | None = None, prefix: str = _PREFIX) -> Iterator[list[Host]]:
    """``count`` (up to 26) namespaces, each on a veth link to one bridge in a namespace of its own."""
    _remove_stale(prefix)
    tag = f"{os.getpid()}-{next(_serial)}"
    switch = f"{prefix}{tag}s"
    made = [Host(f"{prefix}{tag}{end}", f"{BRIDGED_SUBNET}.{i + 1}", f"{prefix[:3]}v{tag}{end}",
                 names[i] if names else None) for i, end in enumerate("abcdefghijklmnopqrstuvwxyz"[:count])]
    try:
        _ip("netns", "add", switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for host in made:
            _ip("netns", "add", host.namespace)
            port = f"{prefix[:3]}w{host.namespace[len(prefix):]}"
            _ip("link", "add", host.device, "type", "veth", "peer", "name", port)
            _ip("link", "set", port, "netns", switch)
            _ip("-n", switch, "link", "set", port, "master", "br0")
            _ip("-n", switch, "link", "set", port, "up")
            _ip("link", "set", host.device, "netns", host.namespace)
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.device)
            _ip("-n", host.namespace, "link", "set", host.device, "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
        if names:
            for host in made:
                _write_hosts_file(host, made)
        yield made
    finally:
        for host in made:
            _remove(host.namespace)
            subprocess.run(["ip", "link", "del", host.device], capture_output=True, timeout=IP_TIMEOUT)
        _remove(switch)


@contextlib.contextmanager
def bridged_or_skip(count: int) -> Iterator[list[Host]]:
    """``bridged(count)`` for a pytest fixture: the test is skipped, with the reason, where namespaces are unavailable."""
    import pytest

    reason = unavailable()
    if reason:
        pytest.skip(f"network namespaces are not available on this machine: {reason}")
    with bridged(count) as made:
        yield made


def _write_hosts_file(host: Host, every: Sequence[Host]) -> None:
    os.makedirs(f"/etc/netns/{host.namespace}", exist_ok=True)
    lines = ["127.0.0.1 localhost"] + [f"{h.address} {h.hostname}" for h in every]
    with open(f"/etc/netns/{host.namespace}/hosts", "w") as f:
        f.write("\n".join(lines) + "\n")


def _remove(namespace: str) -> None:
    """Kills what still runs in ``namespace``, then deletes it (its veth end goes with it) and its hosts file."""
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=IP_TIMEOUT).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=IP_TIMEOUT)
    shutil.rmtree(f"/etc/netns/{namespace}", ignore_errors=True)


def _remove_stale(prefix: str = _PREFIX) -> None:
    """Removes namespaces of earlier test processes that no longer run (killed before they cleaned up)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=IP_TIMEOUT).stdout.split("\n")
    for line in listed:
        name = line.split(" ")[0]
        owner = name[len(prefix):].split("-")[0]
        if name.startswith(prefix) and owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
            _remove(name)


def _ip(*args: str) -> str:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout

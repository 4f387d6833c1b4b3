"""Host lists as mpirun and horovodrun take them: ``-H a:2,b:2`` and ``--hostfile FILE``.

Pure functions: a list of (host, slots), and how many workers each host gets. A hostfile
line is ``host slots=N`` (Open MPI, Horovod) or ``host:N``; ``#`` starts a comment; a host
without a count has 1 slot. Standard library only.
"""

from __future__ import annotations

import re
import socket
from typing import Sequence

from tfdist.errors import HostListError

_HOSTFILE_LINE = re.compile(r"(?P<host>[^\s:#]+|\[[^\]]+\])(?::(?P<colon>\d+)|\s+slots\s*=\s*(?P<slots>\d+))?"
                            r"(?:\s+max[-_]slots\s*=\s*\d+)?")


_HOST_SLOTS = re.compile(r"(?P<host>\[[^\]]+\]|[^\s:\[\],]+)(?::(?P<slots>\d+))?")


def parse_hosts(value: str) -> list[tuple[str, int]]:
    """``"a:2,b:2"`` -> [("a", 2), ("b", 2)]; a host without ``:N`` has 1 slot."""
    hosts = []
    for part in value.split(","):
        match = _HOST_SLOTS.fullmatch(part.strip())
        if not match or int(match.group("slots") or 1) < 1:
            raise HostListError(f"-H {value!r}: cannot read {part.strip()!r}; give host:slots, comma-separated, "
                                "e.g. -H node1:2,node2:2.")
        hosts.append((match.group("host").strip("[]"), int(match.group("slots") or 1)))
    return _no_duplicates(hosts, f"-H {value!r}")


def parse_hostfile(path: str) -> list[tuple[str, int]]:
    """Reads an mpirun/Horovod hostfile: one ``host slots=N`` (or ``host:N``) per line."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as err:
        raise HostListError(f"--hostfile {path}: cannot read it ({err.strerror}).") from None
    hosts = []
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        match = _HOSTFILE_LINE.fullmatch(text)
        count = match and int(match.group("colon") or match.group("slots") or 1)
        if not match or count < 1:
            raise HostListError(f"--hostfile {path}, line {number}: cannot read {line.strip()!r}; write one host "
                                "per line as 'HOST slots=N' or 'HOST:N' (N >= 1), e.g. 'node1 slots=2'.")
        hosts.append((match.group("host").strip("[]"), count))
    if not hosts:
        raise HostListError(f"--hostfile {path} names no host; write one per line, e.g. 'node1 slots=2'.")
    return _no_duplicates(hosts, f"--hostfile {path}")


def assign(hosts: Sequence[tuple[str, int]], num_workers: int | None) -> list[tuple[str, int]]:
    """Fills hosts in order up to their slots: the (host, workers) of every host that gets any.

    ``num_workers`` None means every slot. Raises HostListError when the slots are too few.
    """
    total = sum(slots for _, slots in hosts)
    wanted = total if num_workers is None else num_workers
    if wanted > total:
        listed = ",".join(f"{host}:{slots}" for host, slots in hosts)
        raise HostListError(f"-n {wanted} workers do not fit in {total} slot(s) of {listed}: give fewer workers "
                            f"(-n {total}), or more slots (host:N in -H, 'slots=N' in the hostfile).")
    plan, left = [], wanted
    for host, slots in hosts:
        if left:
            plan.append((host, min(slots, left)))
            left -= plan[-1][1]
    return plan


def is_local(host: str) -> bool:
    """Whether ``host`` is this machine (workers start there without ssh)."""
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((sockaddr[0], 0))
            return True
        except OSError:
            continue
    return False


def _no_duplicates(hosts: list[tuple[str, int]], where: str) -> list[tuple[str, int]]:
    names = [host for host, _ in hosts]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise HostListError(f"{where} lists {twice} more than once; list each host once with all its slots "
                            "(host:N).")
    return hosts

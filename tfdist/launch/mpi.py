"""Jobs started by MPI (``mpirun``, ``mpiexec``): the workers' addresses, exchanged over MPI itself.

``tfdist.cluster`` reads rank and size from the MPI launcher's variables; this module asks
every rank, over ``MPI.COMM_WORLD`` (mpi4py, the optional extra ``tfdist[mpi]``), where its
TensorFlow server will listen, so every rank builds the same cluster: 127.0.0.1 when MPI put
every rank on one machine, else the rank's address on the network the other machines share.
mpi4py is imported only here, only in worker processes. Standard library otherwise.
"""

from __future__ import annotations

import socket
from typing import Any, Sequence

from tfdist import cluster as cluster_lib

_agreed: tuple[str, ...] | None = None  # this process's exchange, reused: every rank exchanges once

INSTALL_HINT = 'pip install "tfdist[mpi]" (mpi4py, built for the MPI that runs mpirun)'


def comm_world() -> Any:
    """mpi4py's ``MPI.COMM_WORLD``; ClusterConfigError naming the extra when mpi4py is missing."""
    try:
        from mpi4py import MPI
    except ImportError as err:
        raise cluster_lib.ClusterConfigError(
            f"This process was started by MPI (mpirun/mpiexec) but mpi4py cannot be imported ({err}): tfdist "
            f"builds the cluster by asking every rank over MPI. Install it with {INSTALL_HINT}, or start the "
            "job with `tfdist run -n N` instead of mpirun.") from None
    return MPI.COMM_WORLD


def check_comm(info: cluster_lib.ClusterInfo, comm: Any) -> None:
    """Raises ClusterConfigError when MPI's own count of ranks differs from the launcher's variables."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if (size, rank) != (info.num_workers, info.worker_index):
        raise cluster_lib.ClusterConfigError(
            f"MPI.COMM_WORLD has {size} rank(s) (this is rank {rank}) but the MPI launcher's variables say "
            f"{info.num_workers} (rank {info.worker_index}): mpi4py is built for another MPI than the one that "
            f"started the job. Reinstall mpi4py against this MPI ({INSTALL_HINT}), or run mpirun of the MPI "
            "mpi4py was built for.")


def exchange_addresses(info: cluster_lib.ClusterInfo, comm: Any = None) -> tuple[str, ...]:
    """Every rank's "host:port", in rank order, agreed over MPI (a collective: every rank must call it).

    The first exchange over ``MPI.COMM_WORLD`` is kept: ``hvd.init()`` exchanges, and the strategy
    built later reuses its addresses.

    Args:
        info: this process's place in the job (source "mpi").
        comm: an mpi4py communicator (default: ``MPI.COMM_WORLD``).
    """
    global _agreed
    if comm is None and _agreed is not None:
        return _agreed
    world = comm is None
    comm = comm_world() if comm is None else comm
    check_comm(info, comm)
    machines = comm.allgather((socket.gethostname(), tuple(_interface_addresses())))
    one_machine = info.local_size == info.num_workers or len(set(machines)) == 1
    host = "127.0.0.1" if one_machine else _address_towards_peers(machines, info.worker_index)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.bind(("", 0))  # TensorFlow's server binds every interface
        port = sock.getsockname()[1]
    finally:
        sock.close()
    addresses = tuple(comm.allgather(f"[{host}]:{port}" if ":" in host else f"{host}:{port}"))
    if world:
        _agreed = addresses
    return addresses


def _interface_addresses() -> list[str]:
    """This machine's IPv4 addresses, loopback excluded (Linux: SIOCGIFADDR on every interface)."""
    import fcntl
    import struct

    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue  # no IPv4 address on it
            address = socket.inet_ntoa(packed[20:24])
            if not address.startswith("127."):
                found.append(address)
    return found


def _address_towards_peers(machines: Sequence[tuple[str, tuple[str, ...]]], rank: int) -> str:
    """Of this rank's addresses, the one on the same network as the other machines' (longest common prefix)."""
    mine = machines[rank][1]
    others = [address for machine in machines if machine != machines[rank] for address in machine[1]]
    if not mine:
        raise cluster_lib.ClusterConfigError(
            f"MPI rank {rank} has no network address but loopback, and the job spans several machines: "
            "give the machine a network interface its peers can reach.")

    def shared_bits(address: str) -> int:
        value = int.from_bytes(socket.inet_aton(address), "big")
        return max((32 - (value ^ int.from_bytes(socket.inet_aton(o), "big")).bit_length() for o in others),
                   default=0)

    return max(mine, key=shared_bits)

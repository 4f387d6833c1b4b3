"""Jobs started by MPI (``mpirun``, ``mpiexec``): the workers' addresses, exchanged over MPI itself.

``tfdist.cluster`` reads rank and size from the MPI launcher's variables; this module asks
every rank, over ``MPI.COMM_WORLD`` (mpi4py, the optional extra ``tfdist[mpi]``), where its
TensorFlow server will listen, so every rank builds the same cluster. mpi4py is imported
only here, only when a worker builds its strategy. Standard library otherwise.
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
    hostnames = comm.allgather(socket.gethostname())
    host = "127.0.0.1" if len(set(hostnames)) == 1 else _address_towards(hostnames, info.worker_index)
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


def _address_towards(hostnames: Sequence[str], rank: int) -> str:
    """This host's address on the route to another rank's host (no packet is sent)."""
    peer = next(name for name in hostnames if name != hostnames[rank])
    family, _, _, _, sockaddr = socket.getaddrinfo(peer, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(sockaddr)
        return probe.getsockname()[0]

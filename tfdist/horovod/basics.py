"""``hvd.init()``, the job's shape, reduce ops, process sets and build flags, as Horovod names them.

Horovod's semantics: a rank is a worker process, ``size()`` counts processes, and
``local_*`` / ``cross_*`` describe them by host. All of it comes from the environment the
launcher gave (``TF_CONFIG`` from ``tfdist run``, mpirun's variables, SLURM, or nothing: one
process), so it works before TensorFlow starts; under mpirun, ``init()`` also asks every rank
for its address over MPI (mpi4py). ``init()`` starts nothing either: in a multi-worker job
tfdist sets up TensorFlow's collective runtime just before TensorFlow's first op, which
leaves room for Horovod's GPU pinning (``set_visible_devices``) after ``init()``.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Sequence

from tfdist import cluster as cluster_lib
from tfdist import process_group, timeline

# Horovod's reduce ops; the values are tfdist.process_group's names for them.
Average, Sum, Min, Max, Product = "mean", "sum", "min", "max", "product"  # process_group.REDUCE_OPS' names
Adasum = "adasum"  # Horovod's; refused with a message
REDUCE_OPS = (*process_group.REDUCE_OPS, Adasum)


class ProcessSet:
    """Some of the job's ranks, for collectives among them only (Horovod's ``hvd.ProcessSet``).

    Register it with ``hvd.init(process_sets=[...])`` or ``hvd.add_process_set``; every
    rank must register the same sets. ``root_rank`` arguments stay global ranks.

    Args:
        ranks: the global ranks in the set (an MPI communicator is not accepted: there is no MPI).
    """

    def __init__(self, ranks: Sequence[int]):
        if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
            raise ValueError(f"ProcessSet takes a list of ranks (tfdist has no MPI communicators); "
                             f"received {ranks!r}.")
        ranks = sorted(ranks)
        if any(not isinstance(r, int) or isinstance(r, bool) for r in ranks):
            raise ValueError(f"ProcessSet ranks must be ints; received {ranks!r}.")
        self.ranks = ranks
        self.process_set_id: int | None = None

    def size(self) -> int | None:
        """Ranks in the set, or None before it is registered."""
        return None if self.process_set_id is None else len(self.ranks)

    def rank(self) -> int | None:
        """This process's index within the set, or None before it is registered or when not included."""
        if self.process_set_id is None or not self.included():
            return None
        return self.ranks.index(rank())

    def included(self) -> bool | None:
        """Whether this process belongs to the set (None before ``hvd.init()``)."""
        return rank() in self.ranks if _state.cluster is not None else None

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


@dataclasses.dataclass
class _State:
    cluster: cluster_lib.ClusterInfo | None = None
    process_sets: dict[int, ProcessSet] = dataclasses.field(default_factory=dict)
    next_id: int = 1
    noted: set = dataclasses.field(default_factory=set)


_state = _State()


def init(comm: Sequence[int] | None = None, process_sets: Sequence[ProcessSet] | str | None = None) -> None:
    """Initialises tfdist.horovod: reads the job from the environment; idempotent.

    Args:
        comm: None, or a list of all ranks (an MPI communicator, or a subset of the
            ranks, cannot be honoured: tfdist's collectives do not run over MPI).
        process_sets: ProcessSets to register besides the global one, or "dynamic".

    Raises:
        ValueError: ``comm`` names a subset of the ranks, a process set is duplicated or
            names ranks the job does not have.
        tfdist.cluster.ClusterConfigError: the environment describes a cluster tfdist
            cannot use.
        tfdist.strategy.StrategyError: in a multi-worker job, TensorFlow's runtime
            started before tfdist could set up its collectives (the message says which
            line to move).
    """
    cluster = cluster_lib.cluster_from_env()
    all_ranks = list(range(cluster.num_workers))
    if comm is not None and (not hasattr(comm, "__iter__") or sorted(comm) not in ([], all_ranks)):
        raise ValueError(f"hvd.init(comm=...) takes None or the list of all {cluster.num_workers} rank(s); received "
                         f"comm={comm!r}. tfdist has no MPI communicators: start only the processes you need "
                         "(tfdist run -n N), or use hvd.ProcessSet for collectives among some ranks.")
    if cluster.source == "mpi":  # every rank's host, for local_*/cross_*; fails now without mpi4py
        from tfdist.launch import mpi

        cluster = dataclasses.replace(cluster, worker_addresses=mpi.exchange_addresses(cluster))
    if cluster.is_multi_worker:
        from tfdist import strategy as strategy_lib

        if strategy_lib.runtime_initialized() and strategy_lib.current_multi_worker() is None:
            strategy_lib.get_strategy()  # too late to build it: raises, saying which line to move
    _state.cluster = cluster
    global_process_set.ranks = all_ranks
    if process_sets is not None and not isinstance(process_sets, str):
        for process_set in process_sets:
            add_process_set(process_set)


def shutdown() -> None:
    """Marks tfdist.horovod uninitialised (TensorFlow's collective runtime lives as long as the process)."""
    _state.cluster = None
    _state.process_sets.clear()


def is_initialized() -> bool:
    """Whether ``init()`` has been called (and not ``shutdown()``)."""
    return _state.cluster is not None


def _cluster(name: str) -> cluster_lib.ClusterInfo:
    if _state.cluster is None:
        raise ValueError(f"tfdist.horovod has not been initialized: call hvd.init() before hvd.{name}().")
    return _state.cluster


def size() -> int:
    """Processes in the job."""
    return _cluster("size").num_workers


def rank() -> int:
    """This process's rank, 0..size()-1."""
    return _cluster("rank").worker_index


def local_size() -> int:
    """Processes on this host."""
    return _cluster("local_size").local_size


def local_rank() -> int:
    """This process's index among the processes on its host (pin its GPU with it)."""
    return _cluster("local_rank").local_rank


def cross_size() -> int:
    """Hosts that have a process with this process's local rank."""
    return len(_same_local_rank(_cluster("cross_size")))


def cross_rank() -> int:
    """This host's index among the hosts that have a process with this local rank."""
    cluster = _cluster("cross_rank")
    return _same_local_rank(cluster).index(cluster.worker_index)


def is_homogeneous() -> bool:
    """Whether every host runs the same number of processes."""
    hosts = _hosts(_cluster("is_homogeneous"))
    return len({hosts.count(host) for host in hosts}) == 1


def _hosts(cluster: cluster_lib.ClusterInfo) -> list[str]:
    return [address.rsplit(":", 1)[0] for address in cluster.worker_addresses] or ["localhost"]


def _same_local_rank(cluster: cluster_lib.ClusterInfo) -> list[int]:
    """Ranks whose local rank (position among their host's ranks) equals this process's."""
    hosts = _hosts(cluster)
    local = [hosts[:r].count(hosts[r]) for r in range(len(hosts))]
    return [r for r in range(len(hosts)) if local[r] == local[cluster.worker_index]]


# Process sets ---------------------------------------------------------------------------------

def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Registers a process set (every rank must register the same ones, in the same order).

    Raises:
        ValueError: a duplicate, or ranks outside 0..size()-1.
    """
    cluster = _cluster("add_process_set")
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    bad = [r for r in process_set.ranks if not 0 <= r < cluster.num_workers]
    if bad or not process_set.ranks:
        raise ValueError(f"Process set {process_set.ranks} names rank(s) {bad or '(none)'} that this job of "
                         f"{cluster.num_workers} process(es) does not have; use ranks 0..{cluster.num_workers - 1}.")
    known = [global_process_set.ranks] + [s.ranks for s in _state.process_sets.values()]
    if process_set.ranks in known:
        raise ValueError(f"Attempted to add a duplicate process set: ranks {process_set.ranks} are already "
                         "registered; reuse that ProcessSet object.")
    process_set.process_set_id = _state.next_id
    _state.process_sets[_state.next_id] = process_set
    _state.next_id += 1
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregisters a process set; returns whether it was registered."""
    if process_set is global_process_set:
        raise ValueError("The global process set cannot be removed.")
    removed = _state.process_sets.pop(process_set.process_set_id, None) is process_set
    process_set.process_set_id = None
    return removed


def group_of(process_set: ProcessSet, name: str):
    """The ``tfdist.process_group.ProcessGroup`` that runs ``process_set``'s collectives for ``hvd.<name>``.

    Raises:
        ValueError: tfdist.horovod is not initialised, or the set is not registered.
    """
    from tfdist import collectives

    _cluster(name)
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be an hvd.ProcessSet; received {process_set!r}.")
    group = collectives.job_group()
    if process_set is global_process_set:
        return group
    if _state.process_sets.get(process_set.process_set_id) is not process_set:
        raise ValueError(f"Process set {process_set.ranks} has not been registered: pass it to "
                         "hvd.init(process_sets=[...]) or hvd.add_process_set(...) on every rank first.")
    return group.subgroup(process_set.ranks)


# Build flags and timeline -----------------------------------------------------------------------

def mpi_threads_supported() -> bool:
    """False: tfdist's collectives do not run over MPI (MPI only starts the job and shares addresses)."""
    _cluster("mpi_threads_supported")
    return False


def mpi_enabled() -> bool:
    """False: tfdist uses TensorFlow's collectives, not MPI."""
    return False


def mpi_built() -> bool:
    """False: tfdist uses TensorFlow's collectives, not MPI."""
    return False


def gloo_enabled() -> bool:
    """False: tfdist uses TensorFlow's collectives, not Gloo."""
    return False


def gloo_built() -> bool:
    """False: tfdist uses TensorFlow's collectives, not Gloo."""
    return False


def nccl_built() -> int:
    """1 when this TensorFlow was built with CUDA (its collectives then use NCCL between GPUs), else 0."""
    return int(cuda_built())


def ddl_built() -> bool:
    """False: no IBM DDL."""
    return False


def ccl_built() -> bool:
    """False: no oneCCL."""
    return False


def cuda_built() -> bool:
    """Whether this TensorFlow was built with CUDA."""
    import tensorflow as tf

    return bool(tf.test.is_built_with_cuda())


def rocm_built() -> bool:
    """Whether this TensorFlow was built with ROCm."""
    import tensorflow as tf

    return bool(tf.test.is_built_with_rocm())


def gpu_available(ext_base_name: str = "tensorflow", verbose: bool = False) -> bool:
    """Whether GPU collectives are available for ``ext_base_name`` (only "tensorflow" is)."""
    import tensorflow as tf

    available = ext_base_name.endswith("tensorflow") and bool(tf.test.is_built_with_gpu_support())
    if verbose and not available:
        print(f"tfdist.horovod: no GPU support for {ext_base_name!r}.")
    return available


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Starts tfdist's timeline (``tfdist.timeline``): rank 0 writes ``file_path``, a Chrome trace of every rank's
    steps, input, compute and gradient all-reduces, now and every half minute. Call it on every rank (as
    ``HOROVOD_TIMELINE`` is set for every rank). ``mark_cycles`` is accepted (tfdist has no cycles)."""
    _cluster("start_timeline")
    timeline.set_path(file_path)
    timeline.publish_soon()


def stop_timeline() -> None:
    """Writes the timeline as it is now and stops (rank 0 writes the file; call it on every rank)."""
    cluster = _cluster("stop_timeline")
    if timeline.path() is not None and cluster.is_multi_worker:
        timeline.publish(cluster.worker_index, cluster.num_workers, agreed=True)
    timeline.set_path(None)


def _note_once(key: str, message: str) -> None:
    if key not in _state.noted:
        _state.noted.add(key)
        warnings.warn(message, stacklevel=3)

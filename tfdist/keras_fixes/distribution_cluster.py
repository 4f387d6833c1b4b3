"""``keras.distribution.initialize``, ``list_devices``, ``num_processes``, ``process_id`` on TensorFlow (keras#18473).

Keras 3.15's TensorFlow backend has none of ``initialize``, ``num_processes``, ``process_id`` or
``get_device_count`` (``keras.distribution.initialize()`` raises AttributeError), and its
``list_devices`` drops job and task from device names. Here they answer as on JAX, from the
cluster tfdist reads (``tfdist run``, TF_CONFIG, mpirun, SLURM). ``initialize``'s arguments (or
Keras' ``KERAS_DISTRIBUTION_*`` variables, which Keras passes as arguments) become a TF_CONFIG
when nothing else describes the cluster; ``initialize`` then joins the job (builds tfdist's
MultiWorkerMirroredStrategy), as JAX's connects to its coordinator.
"""

from __future__ import annotations

import os

import tensorflow as tf
from keras.src.backend.tensorflow import distribution_lib as tf_distribution_lib

from tfdist import cluster as cluster_lib
from tfdist import strategy as strategy_lib
from tfdist.errors import DistributionError
from tfdist.patching import Patch

patch = Patch(
    "keras_distribution_cluster", "keras#18473",
    without="keras.distribution.initialize() raises AttributeError on TensorFlow, DataParallel sees one process, "
            "and list_devices() names this process's devices only, without job and task.")

_JOB_ORDER = ("chief", "worker")  # rank order of a TF_CONFIG cluster (tfdist.cluster)


def initialize(job_addresses=None, num_processes=None, process_id=None) -> None:
    """Joins the job: the cluster from the environment, or from these arguments (made a TF_CONFIG).

    Raises:
        DistributionError: arguments that describe no usable cluster, or another cluster than the
            environment's (``tfdist run``, mpirun, SLURM, TF_CONFIG).
    """
    requested = _requested_cluster(job_addresses, num_processes, process_id)
    found = cluster_lib.cluster_from_env()
    if requested is not None:
        if found.source != "none":
            _check_same(found, requested)
        elif requested.is_multi_worker:
            os.environ["TF_CONFIG"] = cluster_lib.make_tf_config(requested.worker_addresses, requested.worker_index)
    if cluster_lib.cluster_from_env().is_multi_worker:
        strategy_lib.get_strategy()


def num_processes() -> int:
    """Worker processes in the job (1 outside a cluster)."""
    return cluster_lib.cluster_from_env().num_workers


def process_id() -> int:
    """This process's rank in the job (0 is the chief)."""
    return cluster_lib.cluster_from_env().worker_index


def get_device_count(device_type=None) -> int:
    """How many devices ``list_devices(device_type)`` names: every worker's."""
    return len(tf_distribution_lib.list_devices(device_type))


patch.adds(tf_distribution_lib, "initialize", initialize)
patch.adds(tf_distribution_lib, "num_processes", num_processes)
patch.adds(tf_distribution_lib, "process_id", process_id)
patch.adds(tf_distribution_lib, "get_device_count", get_device_count)


@patch.replaces(tf_distribution_lib, "list_devices", ("device_type",))
def _list_devices(original, device_type=None):
    """In a multi-worker job: every worker's devices, in rank order, with job and task
    ('/job:worker/replica:0/task:1/device:CPU:0'); Keras' 'cpu:0' names in one process."""
    if not cluster_lib.cluster_from_env().is_multi_worker:
        return original(device_type)
    strategy_lib.get_strategy()  # joins the job: TensorFlow then lists every worker's devices
    found = [tf.DeviceSpec.from_string(d.name) for d in
             tf.config.list_logical_devices(device_type.upper() if device_type else None)]
    if not device_type:
        accelerators = [d for d in found if d.device_type != "CPU"]
        found = accelerators or found
    found.sort(key=lambda d: (_JOB_ORDER.index(d.job) if d.job in _JOB_ORDER else len(_JOB_ORDER), d.task,
                              d.device_type, d.device_index))
    return [d.to_string() for d in found]


def _requested_cluster(job_addresses, num_processes, process_id) -> cluster_lib.ClusterInfo | None:
    """What ``initialize``'s arguments describe (None: nothing); addresses may be left out of it."""
    if isinstance(job_addresses, str):
        addresses = [a.strip() for a in job_addresses.split(",") if a.strip()]
    else:
        addresses = [str(a) for a in job_addresses or ()]
    if not addresses and num_processes is None and process_id is None:
        return None
    count = num_processes if num_processes is not None else len(addresses) or None
    where = (f"received job_addresses={job_addresses!r}, num_processes={num_processes!r}, "
             f"process_id={process_id!r}")
    if count is None or count < 1:
        raise DistributionError(f"keras.distribution.initialize needs num_processes >= 1 ({where}); set "
                                "KERAS_DISTRIBUTION_NUM_PROCESSES or pass num_processes.")
    if (process_id is None and count > 1) or not 0 <= (process_id or 0) < count:
        raise DistributionError(f"keras.distribution.initialize needs process_id in 0..{count - 1} ({where}); "
                                "set KERAS_DISTRIBUTION_PROCESS_ID or pass process_id.")
    if len(addresses) > 1 and len(addresses) != count:
        raise DistributionError(f"job_addresses names {len(addresses)} processes but num_processes is {count} "
                                f"({where}): name every process once, in process_id order.")
    if len(addresses) < count and count > 1 and cluster_lib.cluster_from_env().source == "none":
        raise DistributionError(
            f"On TensorFlow every process needs the address of every other ({where}): pass "
            f"job_addresses='host0:port0,host1:port1,...' with {count} addresses, in process_id order "
            "(JAX needs only the coordinator's), or start the processes with `tfdist run`, mpirun or srun, "
            "which describe the cluster themselves.")
    return cluster_lib.ClusterInfo(num_workers=count, worker_index=process_id or 0,
                                   worker_addresses=tuple(addresses) if len(addresses) == count else (),
                                   source="keras")


def _check_same(found: cluster_lib.ClusterInfo, requested: cluster_lib.ClusterInfo) -> None:
    same = (found.num_workers, found.worker_index) == (requested.num_workers, requested.worker_index) and (
        not (found.worker_addresses and requested.worker_addresses)
        or found.worker_addresses == requested.worker_addresses)
    if not same:
        raise DistributionError(
            f"keras.distribution.initialize was asked for process {requested.worker_index} of "
            f"{requested.num_workers} {list(requested.worker_addresses) or ''}, but this process is worker "
            f"{found.worker_index} of {found.num_workers} {list(found.worker_addresses) or ''} (from "
            f"{found.source}). Call keras.distribution.initialize() without arguments (and unset the "
            "KERAS_DISTRIBUTION_* variables) where the launcher describes the cluster.")

"""Who am I in the job: the cluster as the environment describes it.

Standard library only, so the launcher can use it without importing TensorFlow.
Every reader is a pure function of an environment mapping (default ``os.environ``).

Sources, in order of precedence:

* ``TF_CONFIG`` (TensorFlow's own format; ``tfdist run`` writes it too, together with
  the ``TFDIST_*`` rank variables, and is then reported as source ``"tfdist"``);
* MPI launchers: Open MPI's ``mpirun`` (``OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE``),
  MPICH and Intel MPI (``PMI_RANK``/``PMI_SIZE``, ``MPI_LOCALRANKID``): rank and size come
  from here; the workers' addresses are exchanged over MPI when the strategy is built
  (``tfdist.launch.mpi``), so ``worker_addresses`` is empty for source ``"mpi"``;
* SLURM (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_STEP_NODELIST``, ...; also what
  ``srun --mpi=pmix`` sets);
* nothing: a single worker.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Mapping, Sequence

from tfdist.errors import ClusterConfigError, TFConfigChangedError

# Variables ``tfdist run`` sets for each worker, besides TF_CONFIG.
ENV_WORKER_INDEX = "TFDIST_WORKER_INDEX"
ENV_NUM_WORKERS = "TFDIST_NUM_WORKERS"
ENV_LOCAL_RANK = "TFDIST_LOCAL_RANK"
ENV_LOCAL_SIZE = "TFDIST_LOCAL_SIZE"
ENV_CPU_DEVICES = "TFDIST_CPU_DEVICES"
# The TF_CONFIG ``tfdist run`` gave the worker: a script that sets another one itself is stopped.
ENV_LAUNCHER_TF_CONFIG = "TFDIST_TF_CONFIG"
# Set by a multi-node ``tfdist run --nnodes M``: this worker's node, and how many nodes.
ENV_NODE_RANK = "TFDIST_NODE_RANK"
ENV_NUM_NODES = "TFDIST_NUM_NODES"
# A directory where tfdist marks each worker "joining" and "joined" the cluster, so the
# launcher can stop a job whose workers never all join (see ``mark_stage``); and "port-clash"
# when its TensorFlow server could not listen on its TF_CONFIG port (the launcher retries on fresh ports);
# and "stops" once it handles stop signals (the launcher then sends its SIGTERM to that process alone).
ENV_STATUS_DIR = "TFDIST_STATUS_DIR"
STAGES = ("joining", "joined", "port-clash", "stops")
# A directory that lives as long as the launcher's job, across its restarts (``tfdist run``
# creates and removes it): where ``tfdist.horovod.elastic`` keeps committed state.
ENV_JOB_DIR = "TFDIST_JOB_DIR"
# "1" when ``tfdist run --horovod`` asks the workers to resolve ``import horovod...`` to tfdist.horovod.
ENV_HOROVOD = "TFDIST_HOROVOD"
# Base port for SLURM jobs: worker with local id k listens on base + k.
ENV_SLURM_PORT = "TFDIST_PORT"
# Gradient bucket size in bytes, read by tfdist.buckets (0: one all-reduce per step); every worker needs the same.
ENV_BUCKET_BYTES = "TFDIST_BUCKET_BYTES"
# "0": no autotuning of the gradient buckets (tfdist.autotune); and where the chief records its choice.
ENV_AUTOTUNE = "TFDIST_AUTOTUNE"
# The gradient compression of optimizers that name none ("none", "fp16", "powersgd:RANK[:START_STEP]"), read by
# tfdist.compression.from_env; every worker needs the same.
ENV_COMPRESSION = "TFDIST_COMPRESSION"
ENV_AUTOTUNE_FILE = "TFDIST_AUTOTUNE_FILE"
# Seconds a worker may wait in a collective before tfdist.watchdog stops the job (0: never); and the
# exit code of a worker it stops (tfdist run --hang-timeout sets the variable in every worker).
ENV_HANG_TIMEOUT = "TFDIST_HANG_TIMEOUT"
EXIT_HANG = 86
# The exit code of a worker (and of ``tfdist run``) stopped by a signal after saving at the step every
# worker agreed on (``tfdist.preemption``): a scheduler may requeue the job (docs/preemption.md).
EXIT_PREEMPTED = 85
# The signals that make a worker stop at an agreed step and exit EXIT_PREEMPTED, comma-separated
# (default SIGTERM,SIGUSR1: Kubernetes, SLURM's scancel and --signal=USR1@T); "" turns it off.
ENV_STOP_SIGNALS = "TFDIST_STOP_SIGNALS"
# Seconds a worker has between a stop signal and SIGKILL (``tfdist run --grace-period``; launchers set it in
# every worker): every wait of an agreed stop ends inside it, and a signal no stop honours takes its default
# action when it runs out.
ENV_GRACE_PERIOD = "TFDIST_GRACE_PERIOD"
# Where worker 0 writes the job's timeline (``tfdist.timeline``; tfdist run --timeline FILE sets it).
ENV_TIMELINE = "TFDIST_TIMELINE"
DEFAULT_GRACE_SECONDS = 25.0  # inside Kubernetes' default 30 s between SIGTERM and SIGKILL
DEFAULT_SLURM_PORT = 23456

_TASK_TYPES = ("chief", "worker")
_EXAMPLE_TF_CONFIG = (
    '{"cluster": {"worker": ["host1:12345", "host2:12345"]}, '
    '"task": {"type": "worker", "index": 0}}'
)


@dataclasses.dataclass(frozen=True)
class ClusterInfo:
    """Where this process stands in the job.

    Attributes:
        num_workers: worker processes in the job (1 when there is no cluster).
        worker_index: this worker's rank, 0..num_workers-1 (the chief is 0).
        local_rank: rank among the workers on this host.
        local_size: workers on this host.
        is_chief: whether this worker writes checkpoints, logs and results.
        worker_addresses: "host:port" of every worker, in rank order.
        source: "tf_config", "tfdist", "mpi", "slurm" or "none". For "mpi" the addresses
            are empty until ``tfdist.launch.mpi.exchange_addresses`` asks every rank.
    """

    num_workers: int = 1
    worker_index: int = 0
    local_rank: int = 0
    local_size: int = 1
    is_chief: bool = True
    worker_addresses: tuple[str, ...] = ()
    source: str = "none"

    @property
    def is_multi_worker(self) -> bool:
        """True when the job has more than one worker process."""
        return self.num_workers > 1


def cluster_from_env(env: Mapping[str, str] | None = None) -> ClusterInfo:
    """Reads the cluster from TF_CONFIG, else SLURM, else returns a single worker.

    Args:
        env: environment mapping; ``os.environ`` when None.

    Returns:
        A new ClusterInfo.

    Raises:
        ClusterConfigError: TF_CONFIG or the SLURM variables are malformed.
    """
    env = os.environ if env is None else env
    check_tf_config_unchanged(env)
    mpi = _from_mpi(env)
    if env.get("TF_CONFIG", "").strip():
        info = _from_tf_config(env)
        if mpi is not None and mpi.num_workers != info.num_workers:
            raise ClusterConfigError(
                f"MPI started {mpi.num_workers} rank(s) ({mpi_size_variable(env)}={mpi.num_workers}) but TF_CONFIG "
                f"describes {info.num_workers} worker(s): start as many MPI ranks as TF_CONFIG has workers "
                f"(mpirun -np {info.num_workers}), or unset TF_CONFIG and let tfdist build the cluster over MPI.")
        return info
    if mpi is not None:
        return mpi
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return _from_slurm(env)
    return ClusterInfo()


def make_tf_config(worker_addresses: Sequence[str], index: int) -> str:
    """Returns the TF_CONFIG JSON string for worker ``index`` of ``worker_addresses``.

    Raises:
        ClusterConfigError: no addresses, or the index is out of range.
    """
    addresses = list(worker_addresses)
    if not addresses:
        raise ClusterConfigError("make_tf_config needs at least one worker address; received [].")
    if not 0 <= index < len(addresses):
        raise ClusterConfigError(
            f"Worker index {index} is out of range for {len(addresses)} workers; "
            f"use 0..{len(addresses) - 1}."
        )
    return json.dumps({"cluster": {"worker": addresses}, "task": {"type": "worker", "index": index}})


def _from_tf_config(env: Mapping[str, str]) -> ClusterInfo:
    raw = env["TF_CONFIG"]
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as err:
        raise _tf_config_error(f"TF_CONFIG is not valid JSON ({err.msg}): received {raw!r}.")
    if not isinstance(config, dict) or "cluster" not in config or "task" not in config:
        raise _tf_config_error(f"TF_CONFIG needs both 'cluster' and 'task' keys: received {raw!r}.")
    cluster, task = config["cluster"], config["task"]
    if not isinstance(cluster, dict) or not isinstance(task, dict):
        raise _tf_config_error(f"TF_CONFIG 'cluster' and 'task' must be objects: received {raw!r}.")
    unknown = sorted(set(cluster) - set(_TASK_TYPES))
    if unknown:
        raise _tf_config_error(
            f"TF_CONFIG cluster has task type(s) {unknown} that tfdist does not support "
            f"(parameter-server and evaluator jobs are not data-parallel); "
            f"use only {list(_TASK_TYPES)}."
        )
    task_type, index = task.get("type"), task.get("index")
    if task_type not in _TASK_TYPES:
        raise _tf_config_error(
            f"TF_CONFIG task type {task_type!r} is not one of {list(_TASK_TYPES)}."
        )
    members = cluster.get(task_type) or []
    if not isinstance(index, int) or not 0 <= index < len(members):
        raise _tf_config_error(
            f"TF_CONFIG task index {index!r} is out of range: cluster[{task_type!r}] has "
            f"{len(members)} address(es), so use 0..{len(members) - 1}."
        )
    # Rank order: the chief (if any) first, then the workers.
    addresses = tuple(cluster.get("chief", [])) + tuple(cluster.get("worker", []))
    rank = index if task_type == "chief" else len(cluster.get("chief", [])) + index
    local_rank, local_size = _local_position(addresses, rank)
    source = "tfdist" if ENV_WORKER_INDEX in env else "tf_config"
    return ClusterInfo(
        num_workers=len(addresses),
        worker_index=rank,
        local_rank=_int_var(env, ENV_LOCAL_RANK, local_rank),
        local_size=_int_var(env, ENV_LOCAL_SIZE, local_size),
        is_chief=rank == 0,
        worker_addresses=addresses,
        source=source,
    )


# (rank, size, local rank, local size) variables of each MPI launcher family.
_MPI_VARIABLES = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)


def mpi_size_variable(env: Mapping[str, str]) -> str | None:
    """The MPI variable that holds the job's size in ``env`` (None outside an MPI launcher)."""
    return next((size for rank, size, _, _ in _MPI_VARIABLES if rank in env and size in env), None)


def _from_mpi(env: Mapping[str, str]) -> ClusterInfo | None:
    """Rank, size and local rank from an MPI launcher's variables; None when no MPI launcher set them."""
    for rank_var, size_var, local_rank_var, local_size_var in _MPI_VARIABLES:
        if rank_var in env and size_var in env:
            break
    else:
        return None
    size, rank = _int_var(env, size_var, 1), _int_var(env, rank_var, 0)
    if not 0 <= rank < size:
        raise ClusterConfigError(f"{rank_var}={rank} is out of range for {size_var}={size}; start the script "
                                 "with mpirun/mpiexec, which sets both.")
    local_rank = _int_var(env, local_rank_var, 0)
    return ClusterInfo(num_workers=size, worker_index=rank, local_rank=local_rank,
                       local_size=max(_int_var(env, local_size_var, 1), local_rank + 1),
                       is_chief=rank == 0, worker_addresses=(), source="mpi")


def check_tf_config_unchanged(env: Mapping[str, str] | None = None) -> None:
    """Raises TFConfigChangedError when TF_CONFIG differs from the one ``tfdist run`` gave this worker.

    The same cluster and task written differently (spacing, key order) is not a change.
    """
    env = os.environ if env is None else env
    given, now = env.get(ENV_LAUNCHER_TF_CONFIG), env.get("TF_CONFIG", "")
    if given is None or now == given:
        return
    try:
        if json.loads(now) == json.loads(given):
            return
    except json.JSONDecodeError:
        pass
    raise TFConfigChangedError(
        f"TF_CONFIG was changed inside this worker{_lines_setting_tf_config()}: it is {now!r}, but `tfdist run` "
        f"gave this worker {given!r}. tfdist run sets TF_CONFIG for every worker (each its own task index and "
        "port); a TF_CONFIG fixed in the script gives every worker the same one. Fix: delete the line that sets "
        "os.environ['TF_CONFIG'] (or set it only when it is missing: os.environ.setdefault), or start the script "
        "without tfdist run, once per machine, as the TensorFlow guide does.")


def _lines_setting_tf_config() -> str:
    """' (train.py:11)' : the lines of the main script that assign TF_CONFIG, or '' when none is found."""
    import sys

    path = getattr(sys.modules.get("__main__"), "__file__", None)
    try:
        with open(path, encoding="utf-8") as script:
            lines = script.read().splitlines()
    except (OSError, TypeError, UnicodeDecodeError):
        return ""
    found = [f"{os.path.basename(path)}:{number}" for number, line in enumerate(lines, 1)
             if "TF_CONFIG" in line and ("=" in line.split("TF_CONFIG", 1)[1][:4] or "putenv" in line
                                         or "update" in line) and not line.lstrip().startswith("#")]
    return f" ({', '.join(found)}: {lines[int(found[0].rsplit(':', 1)[1]) - 1].strip()})" if found else ""


def _tf_config_error(message: str) -> ClusterConfigError:
    return ClusterConfigError(f"{message} A valid TF_CONFIG looks like: {_EXAMPLE_TF_CONFIG}")


def _local_position(addresses: Sequence[str], rank: int) -> tuple[int, int]:
    """Rank among the workers on the same host, and how many share that host."""
    hosts = [address.rsplit(":", 1)[0] for address in addresses]
    host = hosts[rank]
    return hosts[:rank].count(host), hosts.count(host)


def _from_slurm(env: Mapping[str, str]) -> ClusterInfo:
    num_workers = _int_var(env, "SLURM_NTASKS", 1)
    rank = _int_var(env, "SLURM_PROCID", 0)
    if not 0 <= rank < num_workers:
        raise ClusterConfigError(
            f"SLURM_PROCID={rank} is out of range for SLURM_NTASKS={num_workers}; "
            "run the script with srun so SLURM sets both."
        )
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    tasks_per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not nodelist or not tasks_per_node:
        raise ClusterConfigError(
            "SLURM_PROCID is set but SLURM_STEP_NODELIST/SLURM_TASKS_PER_NODE are not; "
            "start the workers with srun (it sets them), or set TF_CONFIG instead."
        )
    hosts = expand_slurm_nodelist(nodelist)
    counts = expand_slurm_tasks_per_node(tasks_per_node)
    if len(counts) != len(hosts) or sum(counts) != num_workers:
        raise ClusterConfigError(
            f"SLURM variables disagree: {len(hosts)} node(s) in {nodelist!r}, tasks per node "
            f"{tasks_per_node!r}, SLURM_NTASKS={num_workers}. Start the workers with srun."
        )
    port = _int_var(env, ENV_SLURM_PORT, DEFAULT_SLURM_PORT)
    addresses = tuple(
        f"{host}:{port + local_id}" for host, count in zip(hosts, counts) for local_id in range(count)
    )
    local_rank, local_size = _local_position(addresses, rank)
    return ClusterInfo(
        num_workers=num_workers,
        worker_index=rank,
        local_rank=_int_var(env, "SLURM_LOCALID", local_rank),
        local_size=local_size,
        is_chief=rank == 0,
        worker_addresses=addresses,
        source="slurm",
    )


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """Expands a SLURM host list: ``"gpu[01-03,07],login"`` -> gpu01, gpu02, gpu03, gpu07, login."""
    hosts = []
    for prefix, ranges, suffix in re.findall(r"([^,\[]+)(?:\[([^\]]+)\])?([^,\[]*)", nodelist):
        if not ranges:
            hosts.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            first, _, last = part.partition("-")
            if not (first.isdigit() and (not last or last.isdigit())):
                raise ClusterConfigError(f"Cannot read SLURM node range {part!r} in {nodelist!r}.")
            for number in range(int(first), int(last or first) + 1):
                hosts.append(f"{prefix}{number:0{len(first)}d}{suffix}")
    return hosts


def expand_slurm_tasks_per_node(value: str) -> list[int]:
    """Expands SLURM's tasks-per-node form: ``"2(x3),1"`` -> [2, 2, 2, 1]."""
    counts = []
    for part in value.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise ClusterConfigError(f"Cannot read SLURM tasks per node {value!r}.")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _int_var(env: Mapping[str, str], name: str, default: int) -> int:
    value = env.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ClusterConfigError(f"{name} must be an integer: received {value!r}.") from None


def cpu_devices_from_env(env: Mapping[str, str] | None = None) -> int | None:
    """Logical CPU devices requested by ``tfdist run --cpu-devices K`` (None if unset)."""
    env = os.environ if env is None else env
    if not env.get(ENV_CPU_DEVICES):
        return None
    count = _int_var(env, ENV_CPU_DEVICES, 1)
    if count < 1:
        raise ClusterConfigError(f"{ENV_CPU_DEVICES} must be >= 1: received {count}.")
    return count


def mark_stage(stage: str, env: Mapping[str, str] | None = None) -> None:
    """Tells ``tfdist run`` that this worker reached ``stage`` (a file in its status dir holding this process's id).

    Does nothing outside ``tfdist run`` (no status directory in the environment).
    """
    env = os.environ if env is None else env
    directory = env.get(ENV_STATUS_DIR)
    if directory and stage in STAGES:
        with open(os.path.join(directory, f"{stage}-{env.get(ENV_WORKER_INDEX, '0')}"), "w") as mark:
            mark.write(str(os.getpid()))  # the process that reached it


def timeline_path_problem(path: str) -> str | None:
    """Why worker 0 could not write a timeline to ``path`` (``--timeline``, TFDIST_TIMELINE), or None."""
    target = os.path.abspath(path)
    directory = os.path.dirname(target)
    if os.path.isdir(target):
        return f"the timeline {path!r} is a directory: give a file name, e.g. {os.path.join(path, 'trace.json')}"
    if not os.path.isdir(directory):
        return f"the timeline {path!r} cannot be written: its directory {directory} does not exist (create it first)"
    if not os.access(directory, os.W_OK):
        return f"the timeline {path!r} cannot be written: its directory {directory} is not writable"
    return None

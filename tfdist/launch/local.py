"""This machine's workers: each gets its own TF_CONFIG on free 127.0.0.1 ports plus tfdist's
rank variables, and tfdist's start-up hook first on its PYTHONPATH; its output is prefixed
with ``[index]``. ``launch`` runs a job here under ``launch.supervisor``; ``run_here`` starts
this machine's share of a multi-node job (``launch/nodes.py``). Never imports TensorFlow.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import threading
from typing import IO, Sequence

from tfdist import cluster
from tfdist.launch import lifeline, supervisor
from tfdist.launch.supervisor import DEFAULT_START_TIMEOUT, WorkerSettings

ENV_RESTART = "TFDIST_RESTART"  # the job's attempt a worker belongs to: 0, and 1 more after each restart of any kind

# The folder whose sitecustomize.py arms tfdist.startup in every worker (see site/).
SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")
SITE_HOOK = os.path.join(SITE_DIR, "sitecustomize.py")


def missing_site_hook() -> str | None:
    """What is wrong when this install lacks the workers' start-up hook (a wheel built without it), else None."""
    if os.path.isfile(SITE_HOOK):
        return None
    return (f"this tfdist install lacks its worker start-up hook {SITE_HOOK}, so tfdist run's workers would get no "
            "Keras fixes (keras#20585 and the rest). Reinstall tfdist: pip install --force-reinstall tfdist (or "
            "pass --no-fixes to run the command without them).")


_TFDIST_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Returns ``count`` distinct ports that were free a moment ago on ``host``."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def worker_env(addresses: Sequence[str], index: int, settings: WorkerSettings, restart: int,
               status_dir: str, base_env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of worker ``index``: a new dict, ``base_env`` untouched."""
    env = dict(os.environ if base_env is None else base_env)
    tf_config = cluster.make_tf_config(addresses, index)
    env.update({
        "TF_CONFIG": tf_config,
        cluster.ENV_LAUNCHER_TF_CONFIG: tf_config,
        cluster.ENV_WORKER_INDEX: str(index),
        cluster.ENV_NUM_WORKERS: str(len(addresses)),
        cluster.ENV_LOCAL_RANK: str(index),
        cluster.ENV_LOCAL_SIZE: str(len(addresses)),
        ENV_RESTART: str(restart),
        cluster.ENV_STATUS_DIR: status_dir,
        "PYTHONUNBUFFERED": "1",
    })
    if settings.cpu_devices is not None:
        env[cluster.ENV_CPU_DEVICES] = str(settings.cpu_devices)
    if settings.job_dir is not None:
        env[cluster.ENV_JOB_DIR] = settings.job_dir
    if settings.horovod:
        env[cluster.ENV_HOROVOD] = "1"
    if settings.hang_timeout is not None:
        env[cluster.ENV_HANG_TIMEOUT] = f"{settings.hang_timeout:g}"
    if settings.timeline is not None:
        env[cluster.ENV_TIMELINE] = settings.timeline
    if settings.grace_period is not None:
        env[cluster.ENV_GRACE_PERIOD] = f"{settings.grace_period:g}"
    if settings.hide_tf_logs:
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if settings.fixes:
        # SITE_DIR first, so its sitecustomize runs (and then chains to any other one);
        # tfdist's own root last, so the hook can import tfdist whatever the worker's Python.
        parts = [SITE_DIR, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep)), _TFDIST_ROOT]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    return env


class ThisMachine:
    """The workers of each attempt as child processes of this launcher, on free 127.0.0.1 ports."""

    def addresses(self, num_workers: int, base_port: int | None) -> list[str]:
        ports = list(range(base_port, base_port + num_workers)) if base_port else free_ports(num_workers)
        return [f"127.0.0.1:{port}" for port in ports]

    def run(self, workers, command, addresses, settings, restart, deadline, grace_period, start_timeout, out):
        """Starts every worker into ``workers`` and waits; returns the first failure, or None."""
        return run_here(workers, command, addresses, settings, restart, deadline, grace_period, start_timeout, out)


def launch(command: Sequence[str], num_workers: int, settings: WorkerSettings = WorkerSettings(),
           base_port: int | None = None, timeout: float | None = None, max_restarts: int = 0,
           grace_period: float = cluster.DEFAULT_GRACE_SECONDS, start_timeout: float = DEFAULT_START_TIMEOUT,
           out: IO[bytes] | None = None) -> int:
    """Runs the job's ``num_workers`` workers on this machine (``supervisor.launch``); returns the exit code."""
    return supervisor.launch(command, num_workers, settings, base_port, timeout, max_restarts, grace_period,
                             start_timeout, out, hosts=ThisMachine())


def run_here(workers, command, addresses, settings, restart, deadline, grace_period, start_timeout, out,
             node=None):
    """Starts this machine's workers of the job into ``workers`` and waits; returns the first failure, or None.

    ``node`` (``launch/nodes.py``) is this machine's share of a multi-node job: its ``ranks``,
    ``env(local_rank)`` (variables added to each worker's environment) and ``on_poll(codes)``
    (called with the workers' exit codes at every poll; may raise). Without it, every worker.
    """
    lock = threading.Lock()
    status_dir = tempfile.mkdtemp(prefix="tfdist-run-")
    ranks = list(range(len(addresses))) if node is None else list(node.ranks)

    def start(local_rank: int) -> supervisor.Worker:
        env = worker_env(addresses, ranks[local_rank], settings, restart, status_dir)
        env.update(node.env(local_rank) if node is not None else {})
        worker = _spawn(command, ranks[local_rank], env, settings, out, lock)
        worker.status_dir = status_dir
        return worker

    try:
        watch = supervisor.StartWatch(lambda: set(os.listdir(status_dir)), ranks, start_timeout)
        return supervisor.run_once(workers, start, len(ranks), deadline, grace_period, watch,
                                   None if node is None else node.on_poll)
    finally:
        shutil.rmtree(status_dir, ignore_errors=True)


def _spawn(command, index: int, env: dict[str, str], settings: WorkerSettings, out, lock) -> supervisor.Worker:
    try:
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, **lifeline.spawn_options())
    except OSError as err:  # what tfdist run's own checks could not foresee (out of descriptors, a race)
        raise supervisor.Stop(f"could not start worker {index} ({command[0]}: {err.strerror or err})",
                              127 if isinstance(err, FileNotFoundError) else 126) from None
    return supervisor.relay_output(supervisor.Worker(index, process), process.stdout, settings, out, lock)

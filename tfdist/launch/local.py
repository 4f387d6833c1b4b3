"""Start N workers on this machine, watch them, stop them all when one fails.

Each worker gets its own TF_CONFIG on free 127.0.0.1 ports plus tfdist's rank
variables; its output is prefixed with ``[index]``. When one worker fails, every
other worker is stopped (SIGTERM, then SIGKILL after a grace period, since
TensorFlow's preemption handler may swallow SIGTERM) and the launcher exits with
the failed worker's code, or restarts the whole job on fresh ports when
``max_restarts`` allows. The job ends with one summary line. Never imports TensorFlow.

Where the workers of an attempt run is the ``hosts`` seam of ``launch``: this machine by
default (``ThisMachine``), Ray actors in ``launch/ray.py``. ``launch/nodes.py`` starts one
node's share of a multi-node job through ``run_here``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Sequence

from tfdist import cluster
from tfdist.launch import output

ENV_RESTART = "TFDIST_RESTART"
EXIT_TIMEOUT = 124
DEFAULT_START_TIMEOUT = 300.0
EXIT_INTERRUPTED = 130
# The folder whose sitecustomize.py arms tfdist.startup in every worker (see site/).
SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")
_TFDIST_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PORT_CLASH = b"address already in use"
_PORT_CLASH_RETRIES = 3
_POLL_SECONDS = 0.05


@dataclasses.dataclass(frozen=True)
class WorkerSettings:
    """What every worker of a job gets besides its rank.

    Attributes:
        cpu_devices: split each worker's CPU into this many logical devices (None: leave it).
        fixes: arm tfdist.startup in every worker's Python (Keras fixes on import, the
            multi-worker strategy before TensorFlow's first op), even in scripts that
            never import tfdist. ``tfdist run --no-fixes`` turns it off.
        hide_tf_logs: quiet TensorFlow's C++ start-up logs (``--tf-logs`` keeps them).
        horovod: make ``import horovod`` (``horovod.tensorflow``, ``horovod.tensorflow.keras``,
            ...) resolve to ``tfdist.horovod`` in the workers (``tfdist run --horovod``),
            through the same start-up hook; needs ``fixes``.
        job_dir: a directory that outlives restarts (``cluster.ENV_JOB_DIR``; ``launch`` makes
            one per job unless the environment names it).
    """

    cpu_devices: int | None = None
    fixes: bool = True
    hide_tf_logs: bool = True
    horovod: bool = False
    job_dir: str | None = None


@dataclasses.dataclass
class _Worker:
    index: int
    process: subprocess.Popen
    reader: threading.Thread | None = None
    saw_port_clash: bool = False


@dataclasses.dataclass(frozen=True)
class _Failure:
    index: int
    returncode: int

    def describe(self) -> str:
        return f"worker {self.index} {describe_exit(self.returncode)}"

    @property
    def exit_code(self) -> int:
        return 128 - self.returncode if self.returncode < 0 else self.returncode


def describe_exit(returncode: int) -> str:
    """'exited with code 3' or 'was killed by SIGKILL'."""
    if returncode < 0:
        return f"was killed by {signal.Signals(-returncode).name}"
    return f"exited with code {returncode}"


class _Stop(Exception):
    """Raised in the main loop on SIGINT/SIGTERM or when the job's time runs out."""

    def __init__(self, reason: str, exit_code: int):
        super().__init__(reason)
        self.exit_code = exit_code


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
           grace_period: float = 5.0, start_timeout: float = DEFAULT_START_TIMEOUT,
           out: IO[bytes] | None = None, hosts=None) -> int:
    """Runs the job, restarting it up to ``max_restarts`` times; returns the exit code.

    ``hosts`` says where each attempt's workers run (``addresses`` and ``run``, as
    ``ThisMachine``, the default, has them).
    """
    out = out or sys.stdout.buffer
    hosts = hosts or ThisMachine()
    began = time.monotonic()
    deadline = None if timeout is None else began + timeout
    restarts = port_retries = 0
    workers: list[_Worker] = []
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous_handler = signal.signal(signal.SIGTERM, _raise_stop) if in_main_thread else None
    given_job_dir = os.environ.get(cluster.ENV_JOB_DIR)
    job_dir = given_job_dir or tempfile.mkdtemp(prefix="tfdist-job-")
    settings = dataclasses.replace(settings, job_dir=job_dir)
    try:
        while True:
            addresses = hosts.addresses(num_workers, base_port)
            started = time.monotonic()
            workers = []
            failure = hosts.run(workers, command, addresses, settings, restarts, deadline,
                                grace_period, start_timeout, out)
            if failure is None:
                output.say(out, f"{_summary(workers, began)}; all workers finished"
                                + (f" after {restarts} restart(s)" if restarts else ""))
                return 0
            if any(w.saw_port_clash for w in workers) and base_port is None and port_retries < _PORT_CLASH_RETRIES:
                port_retries += 1
                output.say(out, f"a port was taken before the workers bound it; retrying on fresh ports "
                                f"({port_retries}/{_PORT_CLASH_RETRIES})")
                continue
            if restarts >= max_restarts:
                output.say(out, f"{failure.describe()}; stopped all workers"
                                + (f" after {restarts} restart(s)" if restarts else "")
                                + f" ({_summary(workers, began)})")
                return failure.exit_code
            restarts += 1
            output.say(out, f"{failure.describe()} after {time.monotonic() - started:.1f}s; "
                            f"restarting all workers ({restarts}/{max_restarts})")
    except _Stop as stop:
        output.say(out, f"{stop}; stopped all workers ({_summary(workers, began)})")
        return stop.exit_code
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous_handler)
        if not given_job_dir:
            shutil.rmtree(job_dir, ignore_errors=True)


def _summary(workers: Sequence[_Worker], began: float) -> str:
    codes = [w.process.returncode for w in workers]
    shown = ", ".join("-" if c is None else str(c) if c >= 0 else signal.Signals(-c).name for c in codes)
    return f"{len(codes)} worker(s), exit codes [{shown}], {time.monotonic() - began:.1f}s"


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

    def start(local_rank: int) -> _Worker:
        env = worker_env(addresses, ranks[local_rank], settings, restart, status_dir)
        env.update(node.env(local_rank) if node is not None else {})
        return _spawn(command, ranks[local_rank], env, settings, out, lock)

    try:
        watch = _StartWatch(lambda: set(os.listdir(status_dir)), ranks, start_timeout)
        return _run_once(workers, start, len(ranks), deadline, grace_period, watch,
                         None if node is None else node.on_poll)
    finally:
        shutil.rmtree(status_dir, ignore_errors=True)


def _run_once(workers, start, count, deadline, grace_period, start_watch, on_poll=None):
    """Appends ``start(i)`` for i in 0..count-1 to ``workers``, waits, and stops them all.

    Returns the first failure, or None. Every worker has exited when it returns or raises.
    """
    try:
        with _signals_held():  # a Ctrl-C mid-spawn must not lose a started worker's handle
            for local_rank in range(count):
                workers.append(start(local_rank))
        return _wait(workers, deadline, start_watch, on_poll)
    except KeyboardInterrupt:
        raise _Stop("interrupted", EXIT_INTERRUPTED) from None
    finally:
        _stop_all(workers, grace_period)


def _spawn(command, index: int, env: dict[str, str], settings: WorkerSettings, out, lock) -> _Worker:
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, start_new_session=True)
    return relay_output(_Worker(index, process), process.stdout, settings, out, lock)


def relay_output(worker: _Worker, stream, settings: WorkerSettings, out, lock) -> _Worker:
    """Starts ``worker.reader``: copies ``stream`` to ``out`` prefixed ``[index]``, noting port clashes."""
    def note_port_clash(line: bytes) -> None:
        if _PORT_CLASH in line.lower():
            worker.saw_port_clash = True

    worker.reader = threading.Thread(target=output.pump, daemon=True, args=(
        stream, f"[{worker.index}] ", out, lock, settings.hide_tf_logs, note_port_clash))
    worker.reader.start()
    return worker


@contextlib.contextmanager
def _signals_held():
    """Defers SIGINT/SIGTERM (in the main thread) until the block ends; they are then handled.

    A handler notes them rather than a blocked signal mask, which every worker started in
    the block would inherit: such workers ignore SIGTERM and only die by SIGKILL.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if caught:
            signal.raise_signal(caught[0])  # now handled as it would have been


class _StartWatch:
    """Notices workers that never join the cluster (a peer stuck before it: TF then waits >10 min).

    ``marks()`` returns the stage marks seen so far ("joining-3", "joined-3"; see
    ``cluster.mark_stage``); ``ranks`` are the workers to watch.
    """

    def __init__(self, marks, ranks: Sequence[int], timeout: float):
        self.marks, self.ranks, self.timeout = marks, list(ranks), timeout
        self.first_joining: float | None = None
        self.done = False

    def check(self) -> None:
        """Raises _Stop when some worker tried to join and not all joined within the timeout."""
        if self.done:
            return
        marks = self.marks()
        joined = {i for i in self.ranks if f"joined-{i}" in marks}
        if len(joined) == len(self.ranks):
            self.done = True
        elif self.first_joining is None:
            if any(name.startswith("joining-") for name in marks):
                self.first_joining = time.monotonic()
        elif time.monotonic() - self.first_joining > self.timeout:
            missing = sorted(set(self.ranks) - joined)
            never = [i for i in missing if f"joining-{i}" not in marks]
            raise _Stop(f"worker(s) {missing} did not join the cluster within --start-timeout {self.timeout:g}s"
                        + (f"; worker(s) {never} never reached tfdist.scope()/init()" if never else "")
                        + " (check that every worker starts and can reach the others' ports)", EXIT_TIMEOUT)


def _wait(workers: list[_Worker], deadline: float | None, start_watch: _StartWatch, on_poll=None) -> _Failure | None:
    """Polls until all workers exit 0 (None) or one fails (its _Failure); ``on_poll(codes)`` sees every poll."""
    while True:
        start_watch.check()
        codes = [w.process.poll() for w in workers]
        if on_poll is not None:
            on_poll(codes)
        for worker, code in zip(workers, codes):
            if code not in (None, 0):
                return _Failure(worker.index, code)
        if all(code == 0 for code in codes):
            return None
        if deadline is not None and time.monotonic() > deadline:
            raise _Stop("the job ran past --timeout", EXIT_TIMEOUT)
        time.sleep(_POLL_SECONDS)


def _stop_all(workers: list[_Worker], grace_period: float) -> None:
    """SIGTERM every live worker's process group, then SIGKILL what is left after the grace period."""
    live = [w for w in workers if w.process.poll() is None]
    for worker in live:
        _signal_group(worker.process, signal.SIGTERM)
    end = time.monotonic() + grace_period
    while any(w.process.poll() is None for w in live) and time.monotonic() < end:
        time.sleep(_POLL_SECONDS)
    for worker in workers:
        _signal_group(worker.process, signal.SIGKILL)  # also reaps children a worker left behind
        worker.process.wait()
        worker.reader.join(timeout=5)


def _signal_group(process: subprocess.Popen, sig: signal.Signals) -> None:
    if hasattr(process, "signal_group"):  # a worker on another machine (launch/ray.py)
        process.signal_group(sig)
        return
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _raise_stop(signum, frame):
    raise _Stop("received SIGTERM", 128 + signal.SIGTERM)

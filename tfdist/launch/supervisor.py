"""The supervisor every launcher uses: start a job's workers, watch them, stop them all.

When one worker fails, every other worker is stopped (SIGTERM, then SIGKILL after at most
``FAILURE_GRACE_SECONDS``: the job's collectives are broken), and ``launch.policy`` decides what
follows: ``launch`` exits with the failed worker's code, or restarts the whole job on fresh ports
when ``max_restarts`` allows (uncounted when a worker's TensorFlow server could not bind its port). A signal
to the launcher is forwarded (SIGTERM) to every worker, which then stop at one agreed step,
save and exit ``cluster.EXIT_PREEMPTED`` (``tfdist.preemption``) within the grace period
(SIGKILL after it); the launcher then exits EXIT_PREEMPTED too. Workers that exit
EXIT_PREEMPTED on their own (a signal reached one of them) restart under ``max_restarts``. A start-up watchdog stops a job whose workers do not all join the cluster in time.
Every worker is told the grace period (``cluster.ENV_GRACE_PERIOD``). The job ends with one
summary line. Never imports TensorFlow.

Where the workers of an attempt run is the ``hosts`` seam of ``launch``: this machine
(``launch/local.py``), Ray actors (``launch/ray.py``); ``launch/nodes.py`` runs one node's
share of a multi-node job through ``local.run_here``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Sequence

from tfdist import cluster
from tfdist.launch import lifeline, output, policy
from tfdist.launch.lifeline import Stop

DEFAULT_START_TIMEOUT = 300.0
_POLL_SECONDS = 0.05
FAILURE_GRACE_SECONDS = 5.0


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
        hang_timeout: ``cluster.ENV_HANG_TIMEOUT`` for every worker (``--hang-timeout``; None: as set here).
        grace_period: ``cluster.ENV_GRACE_PERIOD`` for every worker (``job_settings`` sets the launcher's).
        timeline: ``cluster.ENV_TIMELINE`` for every worker (``--timeline``; None: as set here).
    """

    cpu_devices: int | None = None
    fixes: bool = True
    hide_tf_logs: bool = True
    horovod: bool = False
    job_dir: str | None = None
    hang_timeout: float | None = None
    grace_period: float | None = None
    timeline: str | None = None


@dataclasses.dataclass
class Worker:
    index: int
    process: subprocess.Popen
    reader: threading.Thread | None = None
    status_dir: str | None = None  # where it marks its stages (this machine's workers)
    port_clash: bool = False  # its TensorFlow server could not listen on its port (it marked "port-clash")


@dataclasses.dataclass(frozen=True)
class Failure:
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
    if returncode == cluster.EXIT_PREEMPTED:
        return f"exited with code {returncode} (preempted: it saved at the step every worker agreed on)"
    if returncode == cluster.EXIT_HANG:
        return f"exited with code {returncode} (tfdist's hang watchdog: a worker spent the hang timeout in one call, or went silent)"
    return f"exited with code {returncode}"


def launch(command: Sequence[str], num_workers: int, settings: WorkerSettings = WorkerSettings(),
           base_port: int | None = None, timeout: float | None = None, max_restarts: int = 0,
           grace_period: float = cluster.DEFAULT_GRACE_SECONDS, start_timeout: float = DEFAULT_START_TIMEOUT,
           out: IO[bytes] | None = None, *, hosts) -> int:
    """Runs the job, restarting it as ``launch.policy`` decides (``max_restarts``); returns the exit code.

    ``hosts`` says where each attempt's workers run: ``addresses(num_workers, base_port)``
    and ``run(...)``, as ``launch.local.ThisMachine`` has them.
    """
    out = out or sys.stdout.buffer
    began = time.monotonic()
    deadline = None if timeout is None else began + timeout
    rules = policy.RestartPolicy(max_restarts, fixed_ports=base_port is not None)
    workers: list[Worker] = []
    settings, made_job_dir = job_settings(settings, grace_period)
    previous_handlers = lifeline.stop_on_signals()
    try:
        for attempt in itertools.count():
            addresses = hosts.addresses(num_workers, base_port)
            started = time.monotonic()
            workers = []
            failure = hosts.run(workers, command, addresses, settings, attempt, deadline,
                                grace_period, start_timeout, out)
            verdict = rules.decide(policy.Outcome(
                None if failure is None else policy.Failure(failure.describe(), failure.exit_code),
                time.monotonic() - started, port_clashes(workers, addresses)))
            if verdict.exit_code is None:
                output.say(out, verdict.message)
                continue
            output.say(out, f"{summary(workers, began)}; {verdict.message}" if verdict.exit_code == 0 else
                       f"{verdict.message} ({summary(workers, began)})")
            return verdict.exit_code
    except Stop as stop:
        output.say(out, f"{stop}; stopped all workers ({summary(workers, began)})")
        return stop.exit_code
    finally:
        lifeline.restore(previous_handlers)
        if made_job_dir:
            shutil.rmtree(made_job_dir, ignore_errors=True)


def job_settings(settings: WorkerSettings, grace_period: float) -> tuple[WorkerSettings, str | None]:
    """``settings`` with the grace period and the job directory that outlives restarts (``TFDIST_JOB_DIR``, else
    a new one).

    Returns the settings and the directory made here (the caller removes it at the end), or None.
    """
    given = os.environ.get(cluster.ENV_JOB_DIR)
    job_dir = given or tempfile.mkdtemp(prefix="tfdist-job-")
    return dataclasses.replace(settings, job_dir=job_dir, grace_period=grace_period), None if given else job_dir


def port_clashes(workers: Sequence[Worker], addresses: Sequence[str]) -> list[str]:
    """The addresses (``addresses[rank]``) where a worker's TensorFlow server could not listen."""
    return [addresses[w.index] for w in workers if w.port_clash]


def summary(workers: Sequence[Worker], began: float) -> str:
    codes = [w.process.returncode for w in workers]
    shown = ", ".join("-" if c is None else str(c) if c >= 0 else signal.Signals(-c).name for c in codes)
    return f"{len(codes)} worker(s), exit codes [{shown}], {time.monotonic() - began:.1f}s"


def run_once(workers, start, count, deadline, grace_period, start_watch, on_poll=None):
    """Appends ``start(i)`` for i in 0..count-1 to ``workers``, waits, stops them all and notes their port clashes.

    Returns the first failure, or None. Every worker has exited when it returns or raises. A Stop
    (a signal, a timeout) after which every worker exited EXIT_PREEMPTED is raised again with that code.
    """
    failure = None
    try:
        with lifeline.signals_held():  # a Ctrl-C mid-spawn must not lose a started worker's handle
            for local_rank in range(count):
                workers.append(start(local_rank))
                lifeline.watch(workers[-1], functools.partial(signal_group, workers[-1].process, signal.SIGKILL))
        failure = _wait(workers, deadline, start_watch, on_poll)
        return failure
    except Stop as stop:
        _stop_all(workers, grace_period)
        if workers and all(w.process.returncode == cluster.EXIT_PREEMPTED for w in workers):
            raise Stop(f"{stop}: every worker saved at the step they agreed on (run the same command to resume; "
                       f"exit code {cluster.EXIT_PREEMPTED})", cluster.EXIT_PREEMPTED) from None
        raise
    finally:
        broken = failure is not None and failure.returncode != cluster.EXIT_PREEMPTED
        _stop_all(workers, min(grace_period, FAILURE_GRACE_SECONDS) if broken else grace_period)
        marks = start_watch.marks()
        for worker in workers:
            worker.port_clash = f"port-clash-{worker.index}" in marks


def _stop_all(workers: list[Worker], grace_period: float) -> None:
    """SIGTERM every live worker (the process that handles its stop signals, else its process group), then
    SIGKILL every worker's process group after the grace period."""
    with lifeline.stopping():  # a signal now SIGKILLs every worker rather than cutting this short
        live = [w for w in workers if w.process.poll() is None]
        for worker in live:
            if worker.status_dir is None or not signal_stop_handler(worker.process.pid, worker.status_dir,
                                                                   worker.index, signal.SIGTERM):
                signal_group(worker.process, signal.SIGTERM)
        end = time.monotonic() + grace_period
        while any(w.process.poll() is None for w in live) and time.monotonic() < end:
            time.sleep(_POLL_SECONDS)
        for worker in workers:
            signal_group(worker.process, signal.SIGKILL)  # also reaps children a worker left behind
            worker.process.wait()
            worker.reader.join(timeout=5)
            lifeline.unwatch(worker)


def relay_output(worker: Worker, stream, settings: WorkerSettings, out, lock) -> Worker:
    """Starts ``worker.reader``: copies ``stream`` to ``out`` prefixed ``[index]``."""
    worker.reader = threading.Thread(target=output.pump, daemon=True, args=(
        stream, f"[{worker.index}] ", out, lock, settings.hide_tf_logs))
    worker.reader.start()
    return worker


class StartWatch:
    """Notices workers that never join the cluster (a peer stuck before it: TF then waits >10 min).

    ``marks()`` returns the stage marks seen so far ("joining-3", "joined-3"; see
    ``cluster.mark_stage``); ``ranks`` are the workers to watch.
    """

    def __init__(self, marks, ranks: Sequence[int], timeout: float):
        self.marks, self.ranks, self.timeout = marks, list(ranks), timeout
        self.first_joining: float | None = None
        self.done = False

    def check(self) -> None:
        """Raises Stop when some worker tried to join and not all joined within the timeout."""
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
            raise Stop(f"worker(s) {missing} did not join the cluster within --start-timeout {self.timeout:g}s"
                        + (f"; worker(s) {never} never reached tfdist.scope()/init()" if never else "")
                        + " (check that every worker starts and can reach the others' ports)", policy.EXIT_TIMEOUT)


def _wait(workers: list[Worker], deadline: float | None, start_watch: StartWatch, on_poll=None) -> Failure | None:
    """Polls until all workers exit 0 (None) or one fails (its Failure); ``on_poll(codes)`` sees every poll."""
    while True:
        start_watch.check()
        codes = [w.process.poll() for w in workers]
        if on_poll is not None:
            on_poll(codes)
        for worker, code in zip(workers, codes):
            if code not in (None, 0):
                return Failure(worker.index, code)
        if all(code == 0 for code in codes):
            return None
        if deadline is not None and time.monotonic() > deadline:
            raise Stop("the job ran past --timeout", policy.EXIT_TIMEOUT)
        time.sleep(_POLL_SECONDS)


def signal_stop_handler(group: int, status_dir: str | None, index: int, sig: signal.Signals) -> bool:
    """Sends ``sig`` to the process of worker ``index`` that handles its stop signals (it marked "stops" in
    ``status_dir``), not to the rest of its process group: its children (a PyDataset's pool) keep serving it
    until it stops at the agreed step. Returns False when no such process of ``group`` is known."""
    try:
        with open(os.path.join(status_dir or "", f"stops-{index}")) as mark:
            pid = int(mark.read())
        if os.getpgid(pid) != group:
            return False  # not this worker's any more
        os.kill(pid, sig)
        return True
    except (OSError, ValueError):
        return False


def signal_group(process: subprocess.Popen, sig: signal.Signals) -> None:
    """Sends ``sig`` to the process group a child leads (it runs in a session of its own)."""
    if hasattr(process, "signal_group"):  # a worker on another machine (launch/ray.py)
        process.signal_group(sig)
        return
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


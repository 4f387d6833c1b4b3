"""``tfdist run``: start N workers of a multi-worker job on this machine and watch them.

Each worker gets its own TF_CONFIG on free 127.0.0.1 ports plus tfdist's rank
variables; its output is prefixed with ``[index]``. When one worker fails, every
other worker is stopped (SIGTERM, then SIGKILL after a grace period, since
TensorFlow's preemption handler may swallow SIGTERM) and the launcher exits with
the failed worker's code, or restarts the whole job on fresh ports when
``--max-restarts`` allows. Never imports TensorFlow.
"""

from __future__ import annotations

import argparse
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

ENV_RESTART = "TFDIST_RESTART"
EXIT_TIMEOUT = 124
DEFAULT_START_TIMEOUT = 300.0
EXIT_INTERRUPTED = 130
_PORT_CLASH = b"address already in use"
_PORT_CLASH_RETRIES = 3
_POLL_SECONDS = 0.05


class LaunchError(Exception):
    """Bad launcher arguments: the message says what to change."""


@dataclasses.dataclass
class _Worker:
    index: int
    process: subprocess.Popen
    reader: threading.Thread
    saw_port_clash: bool = False


@dataclasses.dataclass(frozen=True)
class _Failure:
    index: int
    returncode: int

    def describe(self) -> str:
        if self.returncode < 0:
            name = signal.Signals(-self.returncode).name
            return f"worker {self.index} was killed by {name}"
        return f"worker {self.index} exited with code {self.returncode}"

    @property
    def exit_code(self) -> int:
        return 128 - self.returncode if self.returncode < 0 else self.returncode


class _Stop(Exception):
    """Raised in the main loop on SIGINT/SIGTERM or when the job's time runs out."""

    def __init__(self, reason: str, exit_code: int):
        super().__init__(reason)
        self.exit_code = exit_code


def build_parser() -> argparse.ArgumentParser:
    """The ``tfdist run`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="tfdist run",
        description="Start N workers of a multi-worker job on this machine.",
        epilog="Example: tfdist run -n 2 -- python train.py --epochs 3",
    )
    parser.add_argument("-n", "--num-workers", type=int, required=True, help="worker processes to start")
    parser.add_argument("--cpu-devices", type=int, default=None, help="split each worker's CPU into K logical devices")
    parser.add_argument("--port", type=int, default=None, help="first port (workers use PORT..PORT+N-1); default: free ports")
    parser.add_argument("--timeout", type=float, default=None, help="stop the whole job after this many seconds")
    parser.add_argument("--max-restarts", type=int, default=0, help="restart all workers up to R times when one fails")
    parser.add_argument("--grace-period", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL when stopping workers")
    parser.add_argument("--start-timeout", type=float, default=DEFAULT_START_TIMEOUT,
                        help="stop the job when its workers have not all joined the tfdist cluster this many "
                             "seconds after the first tried (default: %(default)s)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``tfdist run`` and ``python -m tfdist.run``; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        command = _check_args(args)
    except LaunchError as err:
        parser.error(str(err))
    return launch(
        command,
        num_workers=args.num_workers,
        cpu_devices=args.cpu_devices,
        base_port=args.port,
        timeout=args.timeout,
        max_restarts=args.max_restarts,
        grace_period=args.grace_period,
        start_timeout=args.start_timeout,
    )


def _check_args(args: argparse.Namespace) -> list[str]:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if args.num_workers < 1:
        raise LaunchError(f"-n must be at least 1: received -n {args.num_workers}.")
    if args.cpu_devices is not None and args.cpu_devices < 1:
        raise LaunchError(f"--cpu-devices must be at least 1: received {args.cpu_devices}.")
    if args.timeout is not None and args.timeout <= 0:
        raise LaunchError(f"--timeout must be positive seconds: received {args.timeout}.")
    if args.start_timeout <= 0:
        raise LaunchError(f"--start-timeout must be positive seconds: received {args.start_timeout}.")
    if args.max_restarts < 0:
        raise LaunchError(f"--max-restarts must be 0 or more: received {args.max_restarts}.")
    if args.port is not None and not 1024 <= args.port <= 65535 - args.num_workers:
        raise LaunchError(f"--port must leave room for {args.num_workers} ports in 1024..65535: received {args.port}.")
    if not command:
        raise LaunchError("no command to run: put it after --, e.g. tfdist run -n 2 -- python train.py")
    if shutil.which(command[0]) is None:
        raise LaunchError(
            f"command {command[0]!r} was not found (not on PATH, or not executable); "
            "check the spelling, or give its full path."
        )
    return command


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


def worker_env(addresses: Sequence[str], index: int, cpu_devices: int | None, restart: int,
               status_dir: str, base_env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of worker ``index``: a new dict, ``base_env`` untouched."""
    env = dict(os.environ if base_env is None else base_env)
    env.update({
        "TF_CONFIG": cluster.make_tf_config(addresses, index),
        cluster.ENV_WORKER_INDEX: str(index),
        cluster.ENV_NUM_WORKERS: str(len(addresses)),
        cluster.ENV_LOCAL_RANK: str(index),
        cluster.ENV_LOCAL_SIZE: str(len(addresses)),
        ENV_RESTART: str(restart),
        cluster.ENV_STATUS_DIR: status_dir,
        "PYTHONUNBUFFERED": "1",
    })
    if cpu_devices is not None:
        env[cluster.ENV_CPU_DEVICES] = str(cpu_devices)
    return env


def launch(command: Sequence[str], num_workers: int, cpu_devices: int | None = None,
           base_port: int | None = None, timeout: float | None = None, max_restarts: int = 0,
           grace_period: float = 5.0, start_timeout: float = DEFAULT_START_TIMEOUT,
           out: IO[bytes] | None = None) -> int:
    """Runs the job, restarting it up to ``max_restarts`` times; returns the exit code."""
    out = out or sys.stdout.buffer
    deadline = None if timeout is None else time.monotonic() + timeout
    restarts = port_retries = 0
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous_handler = signal.signal(signal.SIGTERM, _raise_stop) if in_main_thread else None
    try:
        while True:
            ports = (list(range(base_port, base_port + num_workers)) if base_port
                     else free_ports(num_workers))
            addresses = [f"127.0.0.1:{port}" for port in ports]
            started = time.monotonic()
            failure, port_clash = _run_once(command, addresses, cpu_devices, restarts, deadline,
                                            grace_period, start_timeout, out)
            if failure is None:
                return 0
            if port_clash and base_port is None and port_retries < _PORT_CLASH_RETRIES:
                port_retries += 1
                _say(out, f"a port was taken before the workers bound it; retrying on fresh ports ({port_retries}/{_PORT_CLASH_RETRIES})")
                continue
            if restarts >= max_restarts:
                _say(out, f"{failure.describe()}; stopped all workers"
                          + (f" after {restarts} restart(s)" if restarts else ""))
                return failure.exit_code
            restarts += 1
            _say(out, f"{failure.describe()} after {time.monotonic() - started:.1f}s; "
                      f"restarting all workers ({restarts}/{max_restarts})")
    except _Stop as stop:
        _say(out, f"{stop}; stopped all workers")
        return stop.exit_code
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous_handler)


def _run_once(command, addresses, cpu_devices, restart, deadline, grace_period, start_timeout, out):
    """Starts every worker and waits; returns (first failure or None, saw a port clash)."""
    lock = threading.Lock()
    workers: list[_Worker] = []
    status_dir = tempfile.mkdtemp(prefix="tfdist-run-")
    try:
        with _signals_held():  # a Ctrl-C mid-spawn must not lose a started worker's handle
            for index in range(len(addresses)):
                process = subprocess.Popen(
                    command, env=worker_env(addresses, index, cpu_devices, restart, status_dir),
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
                worker = _Worker(index, process, threading.Thread(daemon=True))
                worker.reader = threading.Thread(target=_pump, args=(worker, out, lock), daemon=True)
                worker.reader.start()
                workers.append(worker)
        failure = _wait(workers, deadline, _StartWatch(status_dir, len(addresses), start_timeout))
        return failure, any(w.saw_port_clash for w in workers)
    except KeyboardInterrupt:
        raise _Stop("interrupted", EXIT_INTERRUPTED) from None
    finally:
        _stop_all(workers, grace_period)
        shutil.rmtree(status_dir, ignore_errors=True)


@contextlib.contextmanager
def _signals_held():
    """Defers SIGINT/SIGTERM (in the main thread) until the block ends; they are then handled."""
    held = {signal.SIGINT, signal.SIGTERM}
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, held)


class _StartWatch:
    """Notices workers that never join the cluster (a peer stuck before it: TF then waits >10 min)."""

    def __init__(self, status_dir: str, num_workers: int, timeout: float):
        self.status_dir, self.num_workers, self.timeout = status_dir, num_workers, timeout
        self.first_joining: float | None = None
        self.done = False

    def check(self) -> None:
        """Raises _Stop when some worker tried to join and not all joined within the timeout."""
        if self.done:
            return
        marks = set(os.listdir(self.status_dir))
        joined = {i for i in range(self.num_workers) if f"joined-{i}" in marks}
        if len(joined) == self.num_workers:
            self.done = True
        elif self.first_joining is None:
            if any(name.startswith("joining-") for name in marks):
                self.first_joining = time.monotonic()
        elif time.monotonic() - self.first_joining > self.timeout:
            missing = sorted(set(range(self.num_workers)) - joined)
            never = [i for i in missing if f"joining-{i}" not in marks]
            raise _Stop(f"worker(s) {missing} did not join the cluster within --start-timeout {self.timeout:g}s"
                        + (f"; worker(s) {never} never reached tfdist.scope()/init()" if never else "")
                        + " (check that every worker starts and can reach the others' ports)", EXIT_TIMEOUT)


def _wait(workers: list[_Worker], deadline: float | None, start_watch: _StartWatch) -> _Failure | None:
    """Polls until all workers exit 0 (None) or one fails (its _Failure)."""
    while True:
        start_watch.check()
        codes = [w.process.poll() for w in workers]
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
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _pump(worker: _Worker, out: IO[bytes], lock: threading.Lock) -> None:
    """Copies a worker's output to ``out``, each line prefixed with ``[index]``."""
    prefix = f"[{worker.index}] ".encode()
    for line in iter(worker.process.stdout.readline, b""):
        if _PORT_CLASH in line.lower():
            worker.saw_port_clash = True
        with lock:
            out.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
            out.flush()
    worker.process.stdout.close()


def _say(out: IO[bytes], message: str) -> None:
    out.write(f"tfdist run: {message}\n".encode())
    out.flush()


def _raise_stop(signum, frame):
    raise _Stop("received SIGTERM", 128 + signal.SIGTERM)


if __name__ == "__main__":
    sys.exit(main())

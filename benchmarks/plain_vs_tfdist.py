"""What one worker of a tfdist job costs in CPU against the same training on plain TensorFlow.

    python benchmarks/plain_vs_tfdist.py --rounds 3
    python benchmarks/plain_vs_tfdist.py --rounds 3 --arm plain --arm tfdist --arm tfdist:TFDIST_GC_FREEZE=0

Arms, run in turn every round (the order alternates so load drifts hit every arm alike):

* ``plain``: benchmarks/plain_multi_worker_fit.py (examples/multi_worker_fit.py with no tfdist, plain
  MultiWorkerMirroredStrategy and the two smallest user-side fixes Keras 3 needs under it), two workers
  started here with TF_CONFIG on free 127.0.0.1 ports;
* ``tfdist``: ``python -m tfdist.run -n 2 -- python examples/multi_worker_fit.py``;
* ``tfdist:NAME=VALUE,...``: the same with those variables set in the launcher's and workers' environment
  (``SCRIPT=path``: that script instead of the example, e.g. a copy with ``steps_per_execution=1``).

Every worker runs under ``/usr/bin/time``, so its user + system CPU (and peak RSS) is its own, the
launcher's apart. Both arms' workers get TF_CPP_MIN_LOG_LEVEL=2 and PYTHONUNBUFFERED=1, as tfdist run
sets them. Prints every round's figures, then the medians.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIME_FORMAT = "%U %S %e %M"


@dataclasses.dataclass(frozen=True)
class Job:
    arm: str
    worker_cpu_seconds: tuple[float, ...]  # user + system, per worker
    worker_user_seconds: tuple[float, ...]
    worker_sys_seconds: tuple[float, ...]
    worker_max_rss_mb: tuple[float, ...]
    total_cpu_seconds: float  # every process the job started, launcher included
    wall_seconds: float


def _free_ports(count: int) -> list[int]:
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def _timed(out_file: str, argv: list[str]) -> list[str]:
    return ["/usr/bin/time", "-f", TIME_FORMAT, "-o", out_file, *argv]


def _kill_groups(procs) -> None:
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _wait_all(procs: list[subprocess.Popen], timeout: float, log_name: str) -> float:
    """Waits for every process (killing all of their groups on a failure, the timeout or SIGTERM); their CPU
    seconds."""
    deadline = time.monotonic() + timeout
    cpu = 0.0
    pending = {p.pid: p for p in procs}
    try:
        while pending:
            for pid, proc in list(pending.items()):
                got, status, usage = os.wait4(pid, os.WNOHANG)
                if got:
                    proc.returncode = os.waitstatus_to_exitcode(status)
                    del pending[pid]
                    cpu += usage.ru_utime + usage.ru_stime
                    if proc.returncode != 0:
                        raise RuntimeError(f"{proc.args!r} exited {proc.returncode}: its output is in {log_name}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"still running after {timeout:g} s: {[p.args for p in pending.values()]} "
                                   f"(output in {log_name})")
            time.sleep(0.05)
    finally:
        _kill_groups(pending.values())
    return cpu


def _read_time(path: str) -> tuple[float, float, float, float]:
    with open(path) as f:
        user, system, _wall, rss_kb = f.read().split()[-4:]
    return float(user), float(system), float(_wall), float(rss_kb) / 1024


def run_job(arm: str, workers: int, timeout: float, log) -> Job:
    with tempfile.TemporaryDirectory(prefix="plain_vs_tfdist.") as out:
        procs: list[subprocess.Popen] = []
        try:
            return _run_in(out, arm, workers, timeout, log, procs)
        finally:
            _kill_groups(p for p in procs if p.returncode is None)  # a Popen that failed after another started


def _run_in(out: str, arm: str, workers: int, timeout: float, log, procs: list) -> Job:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    start = time.monotonic()
    if arm == "plain":
        ports = _free_ports(workers)
        for index in range(workers):
            tf_config = {"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                         "task": {"type": "worker", "index": index}}
            argv = _timed(os.path.join(out, f"w{index}"),
                          [sys.executable, os.path.join(ROOT, "benchmarks", "plain_multi_worker_fit.py"), out])
            procs.append(subprocess.Popen(argv, env=dict(env, TF_CONFIG=json.dumps(tf_config)), cwd=ROOT,
                                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    else:
        _, _, settings = arm.partition(":")
        script = "examples/multi_worker_fit.py"
        for pair in filter(None, settings.split(",")):
            name, _, value = pair.partition("=")
            if name == "SCRIPT":  # another script in the example's place (a variant of it)
                script = value
            else:
                env[name] = value
        worker = " ".join(shlex.quote(a) for a in _timed(os.path.join(out, "w"), [])) + "$TFDIST_WORKER_INDEX "
        worker += " ".join(shlex.quote(a) for a in [sys.executable, script, out])
        argv = [sys.executable, "-m", "tfdist.run", "-n", str(workers), "--", "sh", "-c", worker]
        procs.append(subprocess.Popen(argv, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    total = _wait_all(procs, timeout, log.name)
    wall = time.monotonic() - start
    times = [_read_time(os.path.join(out, f"w{i}")) for i in range(workers)]
    return Job(arm, tuple(u + s for u, s, _, _ in times), tuple(t[0] for t in times), tuple(t[1] for t in times),
               tuple(t[3] for t in times), total, wall)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--arm", action="append", help="plain, tfdist or tfdist:NAME=VALUE,... (default: plain, tfdist)")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--log", default=os.path.join(tempfile.gettempdir(), "plain_vs_tfdist.log"))
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # SystemExit: the jobs' finally kills their workers
    arms = args.arm or ["plain", "tfdist"]
    jobs: dict[str, list[Job]] = {arm: [] for arm in arms}
    with open(args.log, "ab") as log:
        for r in range(args.rounds):
            order = arms if r % 2 == 0 else arms[::-1]
            for arm in order:
                job = run_job(arm, args.workers, args.timeout, log)
                jobs[arm].append(job)
                per_worker = " ".join(f"{c:.2f}({u:.2f}+{s:.2f})" for c, u, s in
                                      zip(job.worker_cpu_seconds, job.worker_user_seconds, job.worker_sys_seconds))
                print(f"round {r + 1} {arm:<40} worker CPU s {per_worker}  total CPU {job.total_cpu_seconds:.2f} s"
                      f"  wall {job.wall_seconds:.2f} s  max RSS {'/'.join(f'{m:.0f}' for m in job.worker_max_rss_mb)} MB",
                      flush=True)
    base = statistics.median(c for j in jobs[arms[0]] for c in j.worker_cpu_seconds)
    for arm in arms:
        cpu = statistics.median(c for j in jobs[arm] for c in j.worker_cpu_seconds)
        w0 = statistics.median(j.worker_cpu_seconds[0] for j in jobs[arm])
        total = statistics.median(j.total_cpu_seconds for j in jobs[arm])
        wall = statistics.median(j.wall_seconds for j in jobs[arm])
        print(f"median {arm:<40} worker CPU {cpu:.2f} s ({cpu / base:.3f}x {arms[0]}), worker 0 {w0:.2f} s,"
              f" job total {total:.2f} s, wall {wall:.2f} s")


if __name__ == "__main__":
    main()

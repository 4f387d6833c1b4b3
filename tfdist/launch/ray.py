"""``tfdist run --ray [ADDRESS] -n N -- CMD``: the workers of a job placed by Ray.

Ray places N actors (``WorkerHost``), one per bundle of a placement group, so it places
every worker or none. Each actor picks a port on its node and starts CMD as its child
process with the environment local ``tfdist run`` gives (TF_CONFIG over the actors'
node addresses, ranks, tfdist's start-up hook), in the launcher's working directory when
that exists on its node. The launcher prefixes the workers' output with their rank,
watches their exit codes, stops all when one fails and restarts them together, through
the same loop as local ``tfdist run`` (``supervisor.launch`` with Ray as its ``hosts``); each
attempt gets fresh actors in the same placement group.

With no ADDRESS, ``ray.init()`` decides as Ray always does: ``RAY_ADDRESS``, a cluster
started on this machine with ``ray start``, else a new local Ray, shut down at the end.
Ray is imported only by ``launch`` (and in the actors); TensorFlow never.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from typing import IO, Sequence

from tfdist import cluster, extras
from tfdist.errors import RayLaunchError
from tfdist.launch import lifeline, local, output, policy, supervisor

EXIT_NO_RAY = 2
_POLL_SECONDS = 0.5


class WorkerHost:
    """A Ray actor that runs one worker process on its node and keeps its output for the launcher."""

    def __init__(self):
        self.process: subprocess.Popen | None = None
        self.lines: collections.deque = collections.deque()
        self.eof = False
        self.changed = threading.Condition()
        self.status_dir = tempfile.mkdtemp(prefix="tfdist-ray-")
        self.index = 0

    def address(self, port: int | None) -> str:
        """'node-ip:port' where this worker will listen (a free port unless ``port`` is given)."""
        import ray

        return f"{ray.util.get_node_ip_address()}:{port or local.free_ports(1, host='')[0]}"

    def start(self, command: Sequence[str], addresses: Sequence[str], index: int, settings: dict, restart: int,
              cwd: str, env_extra: dict[str, str]) -> None:
        self.index = index
        env = local.worker_env(addresses, index, supervisor.WorkerSettings(**settings), restart, self.status_dir)
        env.update(env_extra)
        self.process = subprocess.Popen(list(command), env=env, cwd=cwd if os.path.isdir(cwd) else None,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        **lifeline.spawn_options())
        threading.Thread(target=self._collect, daemon=True).start()

    def _collect(self) -> None:
        for line in iter(lambda: self.process.stdout.readline(output.CHUNK), b""):
            with self.changed:
                self.lines.append(line)
                self.changed.notify_all()
        with self.changed:
            self.eof = True
            self.changed.notify_all()

    def poll(self, wait: float) -> tuple[list[bytes], int | None, bool, list[str]]:
        """(new output lines, exit code or None, whether the output has ended, stage marks), waiting up to ``wait`` s."""
        with self.changed:
            self.changed.wait_for(lambda: self.lines or self.eof, timeout=wait)
            lines, eof = list(self.lines), self.eof
            self.lines.clear()
        return lines, self.process.poll(), eof, os.listdir(self.status_dir)

    def signal_group(self, signum: int) -> None:
        """SIGTERM: to the process that handles the worker's stop signals, when it marked itself; else (and any
        other signal) to the worker's process group."""
        if signum == signal.SIGTERM and supervisor.signal_stop_handler(self.process.pid, self.status_dir, self.index,
                                                                       signal.SIGTERM):
            return
        try:
            os.killpg(self.process.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def clean_up(self) -> None:
        """Kills what is left of the worker's process group; removes the status directory."""
        if self.process is not None:
            self.signal_group(signal.SIGKILL)
        shutil.rmtree(self.status_dir, ignore_errors=True)


class _RemoteProcess:
    """The part of ``subprocess.Popen`` local's loop uses, for a worker on a Ray actor.

    It is also the stream ``output.pump`` reads: ``readline`` fetches the actor's output.
    """

    def __init__(self, ray, actor):
        self.ray, self.actor = ray, actor
        self.returncode: int | None = None
        self.marks: set[str] = set()
        self.buffer: collections.deque = collections.deque()
        self.ended = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self) -> int:
        if not self.ended.wait(timeout=60) and self.returncode is None:
            self.returncode = 1  # its output never ended: the relay broke; count it as failed
        return self.returncode

    def signal_group(self, sig: signal.Signals) -> None:
        try:
            self.ray.get(self.actor.signal_group.remote(int(sig)), timeout=30)
        except Exception:  # the actor is gone: so is its process
            pass

    def readline(self, size: int = -1) -> bytes:
        """The next piece of output, as the actor cut it (``size`` is its limit there)."""
        while not self.buffer and not self.ended.is_set():
            try:
                lines, code, eof, marks = self.ray.get(self.actor.poll.remote(_POLL_SECONDS))
            except Exception as err:  # the actor (or its node) died
                lines, code, eof, marks = [f"tfdist run: lost this worker's Ray actor: {err}\n".encode()], 1, True, []
            self.buffer.extend(lines)
            self.marks.update(marks)
            self.returncode = code
            if eof and code is not None:
                self.ended.set()
        return self.buffer.popleft() if self.buffer else b""

    def close(self) -> None:
        pass


class _RayHosts:
    """``supervisor.launch``'s ``hosts``: every attempt's workers on fresh actors of one placement group."""

    def __init__(self, ray, num_workers: int, cpus: float, gpus: float, start_timeout: float):
        from ray.util.placement_group import placement_group

        self.ray, self.cwd = ray, os.getcwd()
        self.bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
        self.group = placement_group([dict(self.bundle)] * num_workers, strategy="PACK")
        self.actors: list = []
        try:
            ray.get(self.group.ready(), timeout=start_timeout)
        except ray.exceptions.GetTimeoutError:
            raise RayLaunchError(
                f"Ray could not place {num_workers} workers of {self.bundle} within --start-timeout {start_timeout:g}s "
                f"(the cluster has {_resources(ray.cluster_resources())}, {_resources(ray.available_resources())} "
                "free): ask for fewer workers, or less per worker with --cpus-per-worker/--gpus-per-worker") from None

    def addresses(self, num_workers: int, base_port: int | None) -> list[str]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._kill_actors()
        remote = self.ray.remote(WorkerHost)
        self.actors = [remote.options(
            num_cpus=self.bundle["CPU"], num_gpus=self.bundle.get("GPU", 0), max_concurrency=4,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=i),
        ).remote() for i in range(num_workers)]
        return self.ray.get([actor.address.remote(base_port + i if base_port else None)
                             for i, actor in enumerate(self.actors)])

    def run(self, workers, command, addresses, settings, restart, deadline, grace_period, start_timeout, out):
        lock = threading.Lock()
        hosts = [address.rsplit(":", 1)[0] for address in addresses]

        def start(index: int) -> supervisor.Worker:
            actor = self.actors[index]
            position = {cluster.ENV_LOCAL_RANK: str(hosts[:index].count(hosts[index])),
                        cluster.ENV_LOCAL_SIZE: str(hosts.count(hosts[index]))}
            self.ray.get(actor.start.remote(command, addresses, index, dataclasses.asdict(settings), restart,
                                            self.cwd, position))
            process = _RemoteProcess(self.ray, actor)
            return supervisor.relay_output(supervisor.Worker(index, process), process, settings, out, lock)

        watch = supervisor.StartWatch(lambda: set().union(*(w.process.marks for w in workers)),
                                  range(len(addresses)), start_timeout)
        return supervisor.run_once(workers, start, len(addresses), deadline, grace_period, watch)

    def close(self) -> None:
        from ray.util.placement_group import remove_placement_group

        self._kill_actors()
        remove_placement_group(self.group)

    def _kill_actors(self) -> None:
        try:
            self.ray.get([actor.clean_up.remote() for actor in self.actors], timeout=30)
        except Exception:  # a dead actor has nothing left to clean
            pass
        for actor in self.actors:
            self.ray.kill(actor)
        self.actors = []


def launch(command: Sequence[str], *, address: str | None, num_workers: int,
           settings: supervisor.WorkerSettings = supervisor.WorkerSettings(), base_port: int | None = None,
           timeout: float | None = None, max_restarts: int = 0, grace_period: float = cluster.DEFAULT_GRACE_SECONDS,
           start_timeout: float = supervisor.DEFAULT_START_TIMEOUT, cpus_per_worker: float | None = None,
           gpus_per_worker: float | None = None, out: IO[bytes] | None = None) -> int:
    """Runs the job on Ray (the cluster at ``address``, or Ray's default); returns the exit code."""
    out = out or sys.stdout.buffer
    try:
        ray = extras.require("ray", "tfdist run --ray")
    except extras.MissingExtraError as err:
        output.say(out, str(err))
        return EXIT_NO_RAY
    try:
        _check_reachable(address)
        context = ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    except (RayLaunchError, ConnectionError, ValueError, RuntimeError) as err:
        output.say(out, str(err) if isinstance(err, RayLaunchError) else
                   f"cannot reach the Ray cluster at {address or 'the default address'}: {err}")
        return EXIT_NO_RAY
    hosts = None
    try:
        cpus, gpus = 1.0 if cpus_per_worker is None else cpus_per_worker, gpus_per_worker or 0.0
        output.say(out, f"Ray cluster at {context.address_info.get('gcs_address') or address}; placing "
                        f"{num_workers} workers ({cpus:g} CPU{f', {gpus:g} GPU' if gpus else ''} each)")
        hosts = _RayHosts(ray, num_workers, cpus, gpus, start_timeout)
        return supervisor.launch(command, num_workers, settings, base_port, timeout, max_restarts, grace_period,
                            start_timeout, out, hosts=hosts)
    except RayLaunchError as err:
        output.say(out, str(err))
        return policy.EXIT_TIMEOUT
    finally:
        if hosts is not None:
            hosts.close()
        ray.shutdown()


def _check_reachable(address: str | None) -> None:
    """Fails fast where Ray would retry for minutes: nothing listens at a HOST:PORT address."""
    if address in (None, "auto", "local") or "://" in address:
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise RayLaunchError(f"--ray takes the head node's address as HOST:PORT (as `ray status` prints it), 'auto', "
                             f"'local' or ray://HOST:PORT: received {address!r}")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as err:
        raise RayLaunchError(f"nothing answers at the Ray address {address} ({err.strerror or err}): start Ray there "
                             "(ray start --head), or give the head node's address as `ray status` prints it") from None


def _resources(resources: dict) -> str:
    return "{" + ", ".join(f"{name}: {resources[name]:g}" for name in ("CPU", "GPU") if name in resources) + "}"

"""``tfdist run -H a:2,b:2`` / ``--hostfile FILE``: one command on one machine starts every host's workers.

A thin layer over the multi-node launcher (``nodes``, ``master``): this launcher runs the
master itself and starts, on every host, ``tfdist run --nnodes M --node-rank K`` (the
host's share), through the system's ``ssh`` (``BatchMode=yes``: the user's keys and
~/.ssh/config, no password prompt; ``StrictHostKeyChecking=accept-new``: a new host is
accepted, a changed host key refused), or as a child process on a host that is this
machine. The job's token goes over ssh's stdin, never on a command line. Every host's
output (``[rank]`` prefixes included) comes back here. The master's rendezvous, kill-all
and restarts do the rest; a host whose launcher dies (ssh refused, host down) stops every
other host, naming it. The remote hosts need tfdist, the same Python path and the script
at the same path (the current directory is used there too). Standard library only.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from typing import IO, Sequence

from tfdist import cluster
from tfdist.launch import hostlist, lifeline, local, master as master_lib, nodes, output, supervisor

# Variables a remote host's launcher gets from this one (besides the token, sent on stdin).
FORWARDED = ("PYTHONPATH", "TF_CPP_MIN_LOG_LEVEL", cluster.ENV_SLURM_PORT, cluster.ENV_BUCKET_BYTES,
             cluster.ENV_AUTOTUNE, cluster.ENV_AUTOTUNE_FILE, cluster.ENV_HANG_TIMEOUT)
_EXIT_SSH = 255


@dataclasses.dataclass(frozen=True)
class SshOptions:
    """How to reach the hosts (horovodrun's names): port, identity file, an ssh config file."""

    port: int | None = None
    identity_file: str | None = None
    config_file: str | None = None
    connect_timeout: float = 10.0

    def argv(self) -> list[str]:
        args = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new",
                "-o", f"ConnectTimeout={max(1, int(self.connect_timeout))}"]
        if self.config_file:
            args += ["-F", self.config_file]
        if self.port:
            args += ["-p", str(self.port)]
        if self.identity_file:
            args += ["-i", self.identity_file, "-o", "IdentitiesOnly=yes"]
        return args

    def hostname(self, host: str) -> str:
        """The address ssh connects to for ``host``: its HostName in the ssh config (``ssh -G``), else ``host``."""
        try:
            shown = subprocess.run([*self.argv(), "-G", host], capture_output=True, text=True, timeout=30,
                                   stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            return host  # no ssh here: starting the host says so
        if shown.returncode != 0:
            said = " | ".join(line for line in shown.stderr.splitlines() if line.strip()) or "no output"
            raise master_lib.MasterError(f"ssh cannot read its configuration for host {host!r} ({said}): check "
                                         "~/.ssh/config or --ssh-config-file.")
        names = [line.split(None, 1)[1] for line in shown.stdout.splitlines() if line.startswith("hostname ")]
        return names[0].strip() if names else host


@dataclasses.dataclass
class _Host:
    rank: int
    name: str
    workers: int
    local: bool
    process: subprocess.Popen | None = None
    reader: threading.Thread | None = None
    tail: deque = dataclasses.field(default_factory=lambda: deque(maxlen=5))

    def describe(self) -> str:
        return f"node {self.rank} ({self.name}{'' if self.local else ', over ssh'})"


def launch(command: Sequence[str], hosts: Sequence[tuple[str, int]], *, node_args: Sequence[str],
           ssh: SshOptions = SshOptions(), max_restarts: int = 0,
           grace_period: float = cluster.DEFAULT_GRACE_SECONDS,
           start_timeout: float = supervisor.DEFAULT_START_TIMEOUT, fixed_ports: bool = False,
           env: dict[str, str] | None = None, out: IO[bytes] | None = None) -> int:
    """Starts ``hosts`` ((host, workers) in rank order) and coordinates them; returns the exit code.

    ``node_args`` are the ``tfdist run`` options every host's launcher gets (``--cpu-devices``,
    ``--timeout``, ...); ``env``, variables every host's workers get (``-x``).
    """
    out = out or sys.stdout.buffer
    say = lambda message: output.say(out, message, who="tfdist run [hosts]")  # noqa: E731
    try:
        real = {name: name if hostlist.is_local(name) else ssh.hostname(name) for name, _ in hosts}
        members = [_Host(rank, name, workers, hostlist.is_local(real[name])) for rank, (name, workers) in enumerate(hosts)]
        address = _master_address({h.name: real[h.name] for h in members if not h.local})
    except master_lib.MasterError as err:
        say(str(err))
        return master_lib.EXIT_BAD_SETUP
    port = local.free_ports(1, host=address)[0]
    token = secrets.token_hex(16)
    coordinator = master_lib.Master((address, port), len(members), token, start_timeout=start_timeout,
                                    max_restarts=max_restarts, fixed_ports=fixed_ports, grace_period=grace_period,
                                    say=lambda message: output.say(out, message, who="tfdist run [master]"))
    lock = threading.Lock()
    previous_handlers = lifeline.stop_on_signals()
    exit_code = 1
    try:
        coordinator.start()
        say(", ".join(f"{h.describe()}: {h.workers} worker(s)" for h in members) + f"; master at {address}:{port}")
        for host in members:
            argv = [sys.executable, "-m", "tfdist.run", "--nnodes", str(len(members)), "--node-rank",
                    str(host.rank), "--master", f"{address}:{port}", "--join-only", "-n", str(host.workers),
                    *node_args, "--", *command]
            _start(host, argv, token, ssh, env or {}, out, lock)
        exit_code = _watch(members, coordinator, grace_period)
        return exit_code
    except supervisor.Stop as stop:
        coordinator.stop(stop.exit_code, f"{stop} (tfdist run on {socket.gethostname()})")
        exit_code = stop.exit_code
        return exit_code
    except master_lib.MasterError as err:
        say(str(err))
        return master_lib.EXIT_BAD_SETUP
    finally:
        coordinator.stop(exit_code, "tfdist run -H stopped")  # a no-op once the job has ended
        with lifeline.stopping():  # a signal now SIGKILLs every host's launcher (and so its workers)
            _stop_hosts(members, grace_period + master_lib.SILENCE_SECONDS)
        coordinator.close(timeout=grace_period + master_lib.SILENCE_SECONDS)
        lifeline.restore(previous_handlers)


def _master_address(remote: dict[str, str]) -> str:
    """127.0.0.1 when every host is this machine, else this machine's address on the route to the remote hosts.

    ``remote`` maps each remote host, as listed, to the address ssh connects to; MasterError
    names every one that does not resolve.
    """
    if not remote:
        return "127.0.0.1"
    resolved, failed = {}, []
    for name, real in remote.items():
        try:
            resolved[name] = socket.getaddrinfo(real, 22, type=socket.SOCK_DGRAM)[0]
        except OSError as err:
            failed.append(f"{name!r}{f' (HostName {real})' if real != name else ''}: {err.strerror or err}")
    if failed:
        raise master_lib.MasterError(f"cannot resolve {'; '.join(failed)}: check the host names in -H/--hostfile "
                                     "and ~/.ssh/config (or --ssh-config-file).")
    name, (family, _, _, _, sockaddr) = next(iter(resolved.items()))
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(sockaddr)  # no packet is sent
            return probe.getsockname()[0]
    except OSError as err:
        raise master_lib.MasterError(f"cannot find a route from this machine to host {name!r} "
                                     f"({err.strerror or err}): check the host name in -H/--hostfile.") from None


def _start(host: _Host, argv: list[str], token: str, ssh: SshOptions, exported: dict[str, str], out, lock) -> None:
    if host.local:
        process = subprocess.Popen(argv, env={**os.environ, **exported, nodes.ENV_TOKEN: token}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, **lifeline.spawn_options())
    else:
        forwarded = {name: os.environ[name] for name in FORWARDED if name in os.environ} | exported
        forwarded = " ".join(f"{name}={shlex.quote(value)}" for name, value in forwarded.items())
        remote = (f"cd {shlex.quote(os.getcwd())} && IFS= read -r {nodes.ENV_TOKEN} && export {nodes.ENV_TOKEN} && "
                  f"exec env {forwarded} {shlex.join(argv)}")
        process = subprocess.Popen([*ssh.argv(), host.name, remote], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, **lifeline.spawn_options())
        try:
            process.stdin.write(f"{token}\n".encode())
            process.stdin.close()
        except OSError:
            pass  # ssh already failed; its output says why
    host.process = process
    lifeline.watch(host, functools.partial(supervisor.signal_group, process, signal.SIGKILL))

    def note(line: bytes) -> None:
        host.tail.append(line.decode(errors="replace").rstrip())

    host.reader = threading.Thread(target=output.pump, args=(process.stdout, "", out, lock, False, note),
                                   daemon=True, name=f"tfdist-host-{host.rank}")
    host.reader.start()


def _watch(members: Sequence[_Host], coordinator: master_lib.Master, grace_period: float) -> int:
    """Waits for every host's launcher; a launcher that dies before the job's end stops the others."""
    codes: dict[int, int] = {}
    while len(codes) < len(members):
        for host in members:
            code = host.process.poll()
            if code is None or host.rank in codes:
                continue
            codes[host.rank] = code
            if code != 0 and coordinator.phase != "ended":
                host.reader.join(timeout=2)
                coordinator.stop(code if code != _EXIT_SSH else 1, _died(host, code, host.rank in coordinator.nodes))
        time.sleep(0.1)
    failed = [code for code in codes.values() if code != 0]
    return failed[0] if failed else 0


def _died(host: _Host, code: int, joined: bool) -> str:
    said = " | ".join(line for line in host.tail if line) or "no output"
    if joined:
        return (f"lost {host.describe()}: its launcher {'or ssh connection ' if not host.local else ''}exited with "
                f"code {code} ({said}); stopped all workers")
    if not host.local and code == _EXIT_SSH:
        return (f"could not start {host.describe()} over ssh (ssh exited with 255: {said}); check that "
                f"`ssh {host.name} true` works without a password prompt (BatchMode: keys or an agent, "
                "--ssh-identity-file, --ssh-port), that the host is up and reachable, and that its host key did "
                "not change; stopped all workers")
    return f"the launcher of {host.describe()} exited with code {code} ({said}); stopped all workers"


def _stop_hosts(members: Sequence[_Host], timeout: float) -> None:
    """Waits for every host's launcher to leave (the master told them), then kills what is left."""
    end = time.monotonic() + timeout
    for host in members:
        if host.process is None:
            continue
        try:
            host.process.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            supervisor.signal_group(host.process, signal.SIGKILL)
            host.process.wait()
        lifeline.unwatch(host)
        if host.reader is not None:
            host.reader.join(timeout=5)


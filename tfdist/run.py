"""``tfdist run``: start the workers of a multi-worker job and watch them.

    tfdist run -n 2 -- python train.py --epochs 3                     # this machine
    tfdist run --nnodes 2 --node-rank K --master HOST:PORT -n 2 -- ...  # on each of 2 machines
    tfdist run --nnodes 2:4 --master HOST:PORT -n 2 -- ...             # elastic: nodes join, die, come back
    TFDIST_NNODES=2 tfdist run train.py                                 # a Kubernetes Indexed Job/JobSet pod
    tfdist run --ray [ADDRESS] -n 4 -- python train.py                 # workers placed by Ray
    tfdist run -H host1:2,host2:2 -- python train.py                   # every host from here, over ssh

This module reads the command line; ``tfdist.launch`` does the work (``local``,
``nodes``, ``ssh``, ``ray``). Never imports TensorFlow (nor Ray, unless ``--ray`` is given).
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import shutil
import sys
import textwrap
from typing import Sequence

from tfdist import cluster
from tfdist.errors import LaunchError
from tfdist.launch import hostlist, kubernetes, local, nodes, output, policy, ssh, supervisor

_MAX_SECONDS = 1e8  # about three years: beyond it, timers overflow
_MAX_GRACE_SECONDS = 3600.0
_FILES_PER_WORKER = 3  # its output pipe and a port probed for it, with room to spare


# What ``tfdist run``'s exit code means: (code, meaning), shown by --help and docs/cli.md.
EXIT_CODES = (
    ("0", "every worker finished"),
    ("N", "the code of the worker that failed (128+S if signal S killed it), once --max-restarts are used"),
    ("2", "bad arguments, a missing extra, or nodes that cannot form one job"),
    (str(cluster.EXIT_PREEMPTED), "preempted: every worker saved at one agreed step; the same command resumes there"),
    (str(cluster.EXIT_HANG), "the hang watchdog stopped the job (--hang-timeout)"),
    (str(policy.EXIT_TIMEOUT), "the job ran past --timeout, or did not start within --start-timeout"),
    ("128+S", "signal S to this launcher stopped the job before the workers saved: 130 Ctrl-C, 143 SIGTERM, "
              "129 SIGHUP, 138 SIGUSR1"),
)


def build_parser() -> argparse.ArgumentParser:
    """The ``tfdist run`` argument parser: its groups, every flag's help ending with its default."""
    parser = argparse.ArgumentParser(
        prog="tfdist run", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_wrapped("Start N workers of a multi-worker job on this machine (or on each of several nodes, "
                             "on several hosts over ssh, or on Ray), prefix their output with the worker index, "
                             "and stop all of them when one fails."),
        epilog=_epilog())
    _add_workers(parser)
    _add_stops(parser)
    _add_inside(parser)
    _add_several_machines(parser)
    _add_hosts(parser)
    parser.add_argument("--join-only", action="store_true", help=argparse.SUPPRESS)  # a host's launcher under -H
    return parser


def _wrapped(text: str) -> str:
    """``text`` in lines that fit an 80-column terminal (the parser keeps its line breaks)."""
    return textwrap.fill(text, 76)


def _epilog() -> str:
    width = max(len(code) for code, _ in EXIT_CODES)
    lines = ["exit codes:"]
    for code, meaning in EXIT_CODES:
        lines += textwrap.wrap(meaning, 76, initial_indent=f"  {code:<{width}}  ", subsequent_indent=" " * (width + 4))
    return "\n".join(lines + ["", "example: tfdist run -n 2 -- python train.py --epochs 3"])


def _add_workers(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("the workers")
    group.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD ARGS...",
                       help="the command every worker runs; a script.py alone runs with this Python")
    group.add_argument("-n", "--num-workers", type=int, default=None, metavar="N",
                       help="worker processes to start (default: every slot of -H/--hostfile; otherwise required)")
    group.add_argument("--cpu-devices", type=int, default=None, metavar="K",
                       help="split each worker's CPU into K logical devices (default: one CPU device)")
    group.add_argument("--port", type=int, default=None, metavar="P",
                       help="first port: the workers use P..P+N-1; a port taken ends the job, naming it "
                            "(default: free ports, picked again when one is taken at start-up)")


def _add_stops(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("failures, signals and time limits")
    group.add_argument("--max-restarts", type=int, default=0, metavar="R",
                       help="restart all workers up to R times when one fails, or when a signal to one of them "
                            f"preempted the job (exit code {cluster.EXIT_PREEMPTED}), resuming from its backup "
                            "(default: %(default)s)")
    group.add_argument("--timeout", type=float, default=None, metavar="S",
                       help=f"stop the whole job after S seconds, exit code {policy.EXIT_TIMEOUT} (default: no limit)")
    group.add_argument("--start-timeout", type=float, default=supervisor.DEFAULT_START_TIMEOUT, metavar="S",
                       help="stop the job when its workers have not all joined the tfdist cluster S seconds "
                            "after the first tried (default: %(default)g)")
    group.add_argument("--hang-timeout", type=float, default=None, metavar="S",
                       help=f"stop the job (exit code {cluster.EXIT_HANG}) when a worker spends more than S seconds "
                            "in one call or goes silent, naming the call and the workers; 0: never "
                            f"(default: ${cluster.ENV_HANG_TIMEOUT}, else 600)")
    group.add_argument("--grace-period", type=float, default=cluster.DEFAULT_GRACE_SECONDS, metavar="S",
                       help="seconds the workers get to stop after a signal (SIGINT, SIGTERM, SIGHUP, SIGUSR1) to "
                            "this launcher: each stops at a step they all agree on, saves through the script's "
                            f"BackupAndRestore and exits {cluster.EXIT_PREEMPTED}, as this launcher then does; "
                            f"SIGKILL after it; told to every worker as ${cluster.ENV_GRACE_PERIOD} (default: "
                            f"%(default)g; after a worker failed, at most {supervisor.FAILURE_GRACE_SECONDS:g})")


def _add_inside(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("inside the workers")
    group.add_argument("--no-fixes", action="store_true",
                       help="run the command as it is: no tfdist start-up hook in the workers (no Keras fixes "
                            "for scripts that do not import tfdist, no early multi-worker strategy) "
                            "(default: off)")
    group.add_argument("--horovod", action="store_true",
                       help="run an unchanged Horovod script: 'import horovod.tensorflow.keras as hvd' (or "
                            "horovod.tensorflow, horovod) gives tfdist.horovod inside the workers (default: off)")
    group.add_argument("--tf-logs", action="store_true",
                       help="show TensorFlow's C++ start-up logs, which are hidden unless TF_CPP_MIN_LOG_LEVEL "
                            "is set (default: off)")
    group.add_argument("--timeline", default=None, metavar="FILE",
                       help=f"worker 0 writes a Chrome-trace timeline of every worker's steps, input, compute and "
                            f"gradient all-reduces to FILE (on worker 0's host), at every fit's end and every "
                            f"half minute; sets ${cluster.ENV_TIMELINE}; docs/timeline.md (default: none)")


def _add_several_machines(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "several machines",
        _wrapped("Run the same command on every node (-n workers each), or let Ray place the workers."))
    group.add_argument("--nnodes", default=None, metavar="N|MIN:MAX",
                       help="nodes in the job: N, or MIN:MAX for an elastic job that starts with MIN..MAX nodes, "
                            "takes in nodes that join later and goes on without nodes that die while MIN are left "
                            f"(default: ${kubernetes.ENV_NNODES}, else 1)")
    group.add_argument("--node-rank", type=int, default=None, metavar="K",
                       help="this node's rank, 0..N-1; node 0 is the master (default: a Kubernetes pod's "
                            f"${kubernetes.ENV_INDEX}, else the node that can listen on --master serves it as node 0 "
                            "and the master numbers the others as they arrive)")
    group.add_argument("--rdzv-wait", type=float, default=None, metavar="S",
                       help="with --nnodes MIN:MAX: once MIN nodes arrived, wait up to S seconds for more before "
                            f"starting (default: {nodes.DEFAULT_RDZV_WAIT:g})")
    group.add_argument("--master", default=None, metavar="ADDR:PORT",
                       help="node 0's address and a free port there: node 0 listens on it, the others connect "
                            f"(default: ${kubernetes.ENV_MASTER}; in a pod of an Indexed Job or JobSet, pod 0's name "
                            f"behind the headless Service, port ${kubernetes.ENV_MASTER_PORT} or "
                            f"{kubernetes.DEFAULT_MASTER_PORT})")
    group.add_argument("--token", default=None,
                       help="a secret every node shares, so no one else can join; prefer the variable: a --token "
                            f"shows in ps (default: ${nodes.ENV_TOKEN})")
    group.add_argument("--host-address", default=None, metavar="ADDR",
                       help="the address of this node the others reach its workers at (default: the one it "
                            "reaches the master from)")
    group.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                       help="place the workers with Ray: on the cluster at ADDRESS, else Ray's default (RAY_ADDRESS, "
                            "a cluster started on this machine, or a new local one) (default: off)")
    group.add_argument("--cpus-per-worker", type=float, default=None, metavar="C",
                       help="with --ray: CPUs Ray reserves per worker (default: 1)")
    group.add_argument("--gpus-per-worker", type=float, default=None, metavar="G",
                       help="with --ray: GPUs Ray reserves per worker (default: 0)")


def _add_hosts(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "several hosts from one command",
        _wrapped("Start every host's workers from this machine, over ssh (as horovodrun does); hosts that are this "
                 "machine run without ssh. Hosts are filled in order up to their slots."))
    group.add_argument("-H", "--hosts", default=None, metavar="HOST:N,...",
                       help="hosts and their slots, e.g. a:2,b:2 (default: none, this machine only)")
    group.add_argument("--hostfile", default=None, metavar="FILE",
                       help="an mpirun/Horovod hostfile: one 'HOST slots=N' (or 'HOST:N') per line (default: none)")
    group.add_argument("--ssh-port", type=int, default=None, metavar="PORT",
                       help="ssh port of every host (default: ssh's own)")
    group.add_argument("--ssh-identity-file", default=None, metavar="FILE",
                       help="private key ssh logs in with (default: ssh's own)")
    group.add_argument("--ssh-config-file", default=None, metavar="FILE",
                       help="an ssh config file to use instead of ~/.ssh/config, as ssh -F (default: ~/.ssh/config)")
    group.add_argument("-x", "--env", action="append", default=[], metavar="NAME[=VALUE]",
                       help="also give this variable to every host's workers, as mpirun -x; repeatable (default: none; "
                            f"these go when set: {', '.join(ssh.FORWARDED)})")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``tfdist run`` and ``python -m tfdist.run``; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _from_environment(args, os.environ)
        command = _check_args(args)
        hosts = _hosts(args)
        exported = _exported(args.env)
    except (LaunchError, hostlist.HostListError) as err:
        parser.error(str(err))
    out = output.Sink(sys.stdout.buffer)
    try:
        return _launch(args, command, hosts, exported, out)
    finally:
        out.close()


def _launch(args: argparse.Namespace, command: list[str], hosts, exported: dict[str, str], out) -> int:
    """Runs the job ``args`` describe, its output going to ``out``; returns the exit code."""
    if hosts is not None:
        return ssh.launch(command, hosts, node_args=_node_args(args), max_restarts=args.max_restarts, out=out,
                          grace_period=args.grace_period, start_timeout=args.start_timeout,
                          fixed_ports=args.port is not None,
                          ssh=ssh.SshOptions(args.ssh_port, args.ssh_identity_file, args.ssh_config_file),
                          env=exported)
    settings = supervisor.WorkerSettings(cpu_devices=args.cpu_devices, fixes=not args.no_fixes,
                                    hide_tf_logs=not args.tf_logs and "TF_CPP_MIN_LOG_LEVEL" not in os.environ,
                                    horovod=args.horovod, hang_timeout=args.hang_timeout,
                                    timeline=os.path.abspath(args.timeline) if args.timeline else None)
    common = dict(num_workers=args.num_workers, settings=settings, base_port=args.port, timeout=args.timeout,
                  max_restarts=args.max_restarts, grace_period=args.grace_period, start_timeout=args.start_timeout)
    if args.max_nodes > 1 or args.join_only:
        return nodes.launch(command, nnodes=(args.min_nodes, args.max_nodes) if ":" in args.nnodes else args.max_nodes,
                            node_rank=args.node_rank,
                            rdzv_wait=nodes.DEFAULT_RDZV_WAIT if args.rdzv_wait is None else args.rdzv_wait,
                            master=_parse_master(args.master),
                            token=nodes.token_from(args.token), host_address=args.host_address,
                            serve_master=not args.join_only, out=out, **common)
    if args.ray is not None:
        from tfdist.launch import ray as ray_hosts  # imports Ray only now

        return ray_hosts.launch(command, address=args.ray or None, cpus_per_worker=args.cpus_per_worker,
                                gpus_per_worker=args.gpus_per_worker, out=out, **common)
    return local.launch(command, out=out, **common)


def _from_environment(args: argparse.Namespace, env) -> None:
    """Fills --nnodes, --node-rank, --master (and -n 1) from the environment where they were not given."""
    given = kubernetes.defaults(env)
    if args.nnodes is None and given.nnodes and not (args.hosts or args.hostfile or args.ray is not None):
        args.nnodes = given.nnodes
        args.node_rank = given.node_rank if args.node_rank is None else args.node_rank
        args.master = args.master or given.master
        if args.num_workers is None and given.node_rank is not None:
            args.num_workers = 1  # one worker per pod unless -n says otherwise
    args.master = args.master or (given.master if args.nnodes else None)
    args.nnodes = args.nnodes or "1"


def _check_args(args: argparse.Namespace) -> list[str]:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if command and command[0].endswith(".py") and os.path.isfile(command[0]) and not os.access(command[0], os.X_OK):
        command = [sys.executable, *command]  # tfdist run train.py: the script with this Python
    if args.num_workers is None and not (args.hosts or args.hostfile):
        raise LaunchError("-n N is required: the number of workers to start, e.g. tfdist run -n 2 -- python train.py")
    _check_numbers(args)
    if not args.no_fixes and local.missing_site_hook():
        raise LaunchError(local.missing_site_hook())
    problem = cluster.timeline_path_problem(args.timeline) if args.timeline else None
    if problem and not (args.hosts or args.hostfile or args.ray is not None) and args.nnodes in (None, "1"):  # this host
        raise LaunchError(f"--timeline: {problem}.")
    if args.horovod and args.no_fixes:
        raise LaunchError("--horovod works through tfdist's start-up hook, which --no-fixes turns off; "
                          "drop one of them.")
    if args.max_restarts < 0:
        raise LaunchError(f"--max-restarts must be 0 or more: received {args.max_restarts}.")
    if args.port is not None and not 1024 <= args.port <= 65535 - (args.num_workers or 1):
        raise LaunchError(f"--port must leave room for {args.num_workers} ports in 1024..65535: received {args.port}.")
    _check_several_machines(args)
    if not command:
        raise LaunchError("no command to run: put it after --, e.g. tfdist run -n 2 -- python train.py")
    path = shutil.which(command[0])
    if path is None:
        raise LaunchError(
            f"command {command[0]!r} was not found (not on PATH, or not executable); "
            "check the spelling, or give its full path."
        )
    why = _unrunnable(path)
    if why:
        where = f" ({path})" if path != command[0] else ""
        raise LaunchError(f"command {command[0]!r}{where} cannot be run: {why}.")
    return command


def _check_numbers(args: argparse.Namespace) -> None:
    """Every number is finite and in its range; -n within what this launcher can open."""
    if args.num_workers is not None and args.num_workers < 1:
        raise LaunchError(f"-n must be at least 1: received -n {args.num_workers}.")
    if args.num_workers is not None:
        limit, needed = resource.getrlimit(resource.RLIMIT_NOFILE)[0], _FILES_PER_WORKER * args.num_workers + 64
        if limit != resource.RLIM_INFINITY and needed > limit:
            raise LaunchError(f"-n {args.num_workers} needs about {needed} open files in this launcher, more than its "
                              f"limit of {limit} (ulimit -n): raise it (ulimit -n {needed}) or start fewer workers.")
    if args.cpu_devices is not None and args.cpu_devices < 1:
        raise LaunchError(f"--cpu-devices must be at least 1: received {args.cpu_devices}.")
    for flag, value, low in (("--timeout", args.timeout, 0), ("--start-timeout", args.start_timeout, 0)):
        if value is not None and not (math.isfinite(value) and low < value <= _MAX_SECONDS):
            raise LaunchError(f"{flag} must be positive seconds: received {value} (give a number up to {_MAX_SECONDS:g}).")
    if not (math.isfinite(args.grace_period) and 0 <= args.grace_period <= _MAX_GRACE_SECONDS):
        raise LaunchError(f"--grace-period must be 0..{_MAX_GRACE_SECONDS:g} seconds (between SIGTERM and SIGKILL): "
                          f"received {args.grace_period}.")
    if args.hang_timeout is not None and not (math.isfinite(args.hang_timeout) and 0 <= args.hang_timeout <= _MAX_SECONDS):
        raise LaunchError(f"--hang-timeout must be 0 (off) or positive seconds up to {_MAX_SECONDS:g}: "
                          f"received {args.hang_timeout}.")
    for name in ("cpus_per_worker", "gpus_per_worker"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise LaunchError(f"--{name.replace('_', '-')} must be 0 or more: received {value}.")


def _unrunnable(path: str) -> str | None:
    """Why the program at ``path`` cannot be executed (a script without a '#!' line, a missing interpreter), else None."""
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError:
        return None  # executable but unreadable: let exec decide
    if head.startswith(b"\x7fELF"):
        return None
    if not head.startswith(b"#!"):
        return ("it is neither a program nor a script with a '#!' line (Exec format error): make its first line "
                "'#!/usr/bin/env python3' (or its interpreter), or run it with one: tfdist run -n 2 -- python SCRIPT")
    words = os.fsdecode(head[2:].split(b"\n", 1)[0]).split()
    if not words:
        return "its '#!' line names no interpreter"
    if not os.access(words[0], os.X_OK):
        return f"its interpreter {words[0]} (its '#!' line) does not exist or is not executable"
    program = next((w for w in words[1:] if not w.startswith("-")), None)
    if os.path.basename(words[0]) == "env" and program and "=" not in program and shutil.which(program) is None:
        return f"its '#!' line runs {program!r}, which is not on PATH"
    return None


def parse_nnodes(value: str) -> tuple[int, int]:
    """'2' -> (2, 2); '2:4' -> (2, 4): the fewest and the most nodes of the job."""
    low, sep, high = value.partition(":")
    fix = "give N (a fixed node count) or MIN:MAX (an elastic job), e.g. --nnodes 2 or --nnodes 2:4"
    if not (low.strip().isdigit() and (not sep or high.strip().isdigit())):
        raise LaunchError(f"--nnodes must be N or MIN:MAX with whole numbers: received {value!r}; {fix}.")
    least, most = int(low), int(high) if sep else int(low)
    if least < 1:
        raise LaunchError(f"--nnodes must be at least 1: received {least}." if not sep else
                          f"--nnodes MIN must be at least 1: received {value!r}; {fix}.")
    if least > most:
        raise LaunchError(f"--nnodes MIN:MAX needs MIN <= MAX: received {value!r}; e.g. --nnodes {most}:{least}.")
    return least, most


def _check_several_machines(args: argparse.Namespace) -> None:
    args.min_nodes, args.max_nodes = parse_nnodes(args.nnodes)
    elastic = args.min_nodes < args.max_nodes or ":" in args.nnodes
    if args.node_rank is not None and not 0 <= args.node_rank < args.max_nodes:
        raise LaunchError(f"--node-rank must be in 0..{args.max_nodes - 1} for --nnodes {args.nnodes}: "
                          f"received {args.node_rank}.")
    if args.rdzv_wait is not None and not elastic:
        raise LaunchError(f"--rdzv-wait applies to an elastic job: give --nnodes MIN:MAX (received --nnodes "
                          f"{args.nnodes}).")
    if args.rdzv_wait is not None and not (math.isfinite(args.rdzv_wait) and 0 <= args.rdzv_wait <= _MAX_SECONDS):
        raise LaunchError(f"--rdzv-wait must be 0 or more seconds: received {args.rdzv_wait}.")
    if args.ray is not None and args.max_nodes > 1:
        raise LaunchError("--ray and --nnodes are two ways to use several machines: give one (with --ray, Ray "
                          "places the workers; with --nnodes, you start tfdist run on every node).")
    if args.ray is None and (args.cpus_per_worker is not None or args.gpus_per_worker is not None):
        raise LaunchError("--cpus-per-worker and --gpus-per-worker are Ray resources: add --ray.")
    if args.max_nodes == 1 and not args.join_only:
        given = [f"--{n.replace('_', '-')}" for n in ("master", "token", "host_address") if getattr(args, n)]
        if given:
            raise LaunchError(f"{', '.join(given)} only apply to a job on several nodes: add --nnodes M.")
        return
    if args.master is None:
        raise LaunchError(f"--nnodes {args.nnodes} needs --master ADDR:PORT: node 0's address and a free port there "
                          "(node 0 listens on it; the other nodes connect), e.g. --master 10.0.0.1:29400.")
    _parse_master(args.master)
    if nodes.token_from(args.token) is None:
        raise LaunchError(
            f"--nnodes {args.nnodes} needs a token that every node shares, so that no one else can join the job: "
            f"run export {nodes.ENV_TOKEN}=$(python3 -c 'import secrets; print(secrets.token_hex(16))') and set the "
            "same value on every node (or give --token).")


def _hosts(args: argparse.Namespace) -> list[tuple[str, int]] | None:
    """(host, workers) of each host of a -H/--hostfile job, in rank order; None for other jobs."""
    if not (args.hosts or args.hostfile):
        if args.ssh_port is not None or args.ssh_identity_file or args.ssh_config_file or args.env:
            raise LaunchError("--ssh-port, --ssh-identity-file, --ssh-config-file and -x apply to hosts started over "
                              "ssh: add -H HOST:N,... or --hostfile FILE.")
        return None
    if args.hosts and args.hostfile:
        raise LaunchError("-H and --hostfile both list the hosts: give one of them.")
    if args.max_nodes > 1 or args.ray is not None:
        raise LaunchError("-H/--hostfile starts every host from here; --nnodes (one tfdist run per node) and --ray "
                          "are other ways: give one of them.")
    if args.ssh_port is not None and not 1 <= args.ssh_port <= 65535:
        raise LaunchError(f"--ssh-port must be in 1..65535: received {args.ssh_port}.")
    for name in ("ssh_identity_file", "ssh_config_file"):
        path = getattr(args, name)
        if path and not os.path.isfile(path):
            raise LaunchError(f"--{name.replace('_', '-')} {path}: no such file.")
    listed = hostlist.parse_hosts(args.hosts) if args.hosts else hostlist.parse_hostfile(args.hostfile)
    return hostlist.assign(listed, args.num_workers)


def _exported(names: Sequence[str]) -> dict[str, str]:
    """-x NAME (its value here) and -x NAME=VALUE, as a dict."""
    exported = {}
    for item in names:
        name, sep, value = item.partition("=")
        if not name.isidentifier():
            raise LaunchError(f"-x takes NAME or NAME=VALUE: received {item!r}.")
        if sep or name in os.environ:
            exported[name] = value if sep else os.environ[name]
    return exported


def _node_args(args: argparse.Namespace) -> list[str]:
    """The options every host's launcher of a -H job gets from this one."""
    given = [("--cpu-devices", args.cpu_devices), ("--port", args.port), ("--timeout", args.timeout),
             ("--hang-timeout", args.hang_timeout), ("--timeline", args.timeline)]
    node_args = [str(part) for flag, value in given if value is not None for part in (flag, value)]
    node_args += ["--grace-period", str(args.grace_period), "--start-timeout", str(args.start_timeout)]
    return node_args + [flag for flag, on in (("--no-fixes", args.no_fixes), ("--horovod", args.horovod),
                                              ("--tf-logs", args.tf_logs)) if on]


def _parse_master(value: str) -> tuple[str, int]:
    """'10.0.0.1:29400', 'node01:29400' or '[fd00::1]:29400' -> (host, port)."""
    host, _, port = value.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise LaunchError(f"--master must be ADDR:PORT with a port in 1..65535, e.g. 10.0.0.1:29400: received {value!r}.")
    if host in ("0.0.0.0", "::"):
        raise LaunchError(f"--master must be the address the other nodes reach node 0 at (node 0 listens there and "
                          f"nowhere else), not the wildcard {host}: received {value!r}.")
    return host, int(port)


if __name__ == "__main__":
    sys.exit(main())

"""``tfdist doctor``: what a user needs to see when distribution misbehaves.

Prints where tfdist is installed (and whether the workers' start-up hook is there),
versions (Keras and TensorFlow inside the tested range, every Keras fix applied), the
optional extras, devices, the cluster as tfdist reads it, whether each peer's port
answers, NCCL, and the precision "auto" would pick. Exits 1 when it finds a problem,
saying what to fix; works with no GPU and no cluster (it says so). Warns, without
failing, when a one-machine job's worker ports also answer on this machine's other
addresses (TensorFlow's worker gRPC listens on every interface, with no authentication).
"""

from __future__ import annotations

import argparse
import array
import dataclasses
import fcntl
import importlib.machinery
import importlib.metadata
import importlib.util
import ipaddress
import os
import socket
import struct
import sys
from typing import Mapping, Sequence

from tfdist import cluster as cluster_lib, extras


@dataclasses.dataclass
class Report:
    """Lines to print, and the problems among them."""

    lines: list[str] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)

    def info(self, label: str, value: str) -> None:
        self.lines.append(f"{label:<12} {value}")

    def problem(self, label: str, message: str) -> None:
        self.lines.append(f"{label:<12} PROBLEM: {message}")
        self.problems.append(message)

    def warning(self, label: str, message: str) -> None:
        self.lines.append(f"{label:<12} WARNING: {message}")
        self.warnings.append(message)


def check_cluster(report: Report, env: Mapping[str, str], port_timeout: float) -> None:
    """Reads the cluster from ``env`` and checks that every peer's port answers."""
    try:
        info = cluster_lib.cluster_from_env(env)
    except cluster_lib.ClusterConfigError as err:
        report.problem("cluster", str(err))
        return
    if not info.is_multi_worker:
        report.info("cluster", f"single worker (no TF_CONFIG or SLURM job found; source: {info.source})")
        return
    report.info("cluster", f"{info.num_workers} workers from {info.source}; this is worker "
                f"{info.worker_index} (local rank {info.local_rank} of {info.local_size}), "
                f"{'chief' if info.is_chief else 'not chief'}")
    for rank, address in enumerate(info.worker_addresses):
        if rank != info.worker_index:
            check_peer(report, rank, address, port_timeout)
    check_exposure(report, info.worker_addresses, port_timeout)


def check_exposure(report: Report, worker_addresses, timeout: float, addresses: list[str] | None = None) -> None:
    """In a one-machine job (only loopback addresses), warns for each worker port that answers elsewhere.

    TensorFlow's worker gRPC server listens on every interface, with no authentication, so a
    job meant for this machine alone can be reached by anyone who reaches the machine.
    ``addresses``: this machine's other addresses to try (default: ``local_addresses()``).
    """
    hosts = {address.rpartition(":")[0].strip("[]") for address in worker_addresses}
    if not hosts or not all(_is_loopback(host) for host in hosts):
        return
    exposed = [f"{port} on {ip}" for ip in (local_addresses() if addresses is None else addresses)
               for port in sorted({int(a.rpartition(":")[2]) for a in worker_addresses})
               if _answers(ip, port, timeout)]
    if exposed:
        report.warning("exposure", (
            f"worker port(s) {', '.join(exposed)} answer on a non-loopback address, in a one-machine job: TensorFlow's "
            "worker gRPC listens on every interface, with no authentication, so anyone who can reach this machine "
            "can connect to the job. Block those ports in the firewall, or keep the machine on a network you trust "
            "(README: Running on several machines)."))


def local_addresses() -> list[str]:
    """This machine's IPv4 addresses other than loopback (Linux: every interface; elsewhere: the host name's)."""
    found = []
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            for _, name in socket.if_nameindex():
                request = array.array("B", struct.pack("256s", name.encode()[:15]))
                try:
                    fcntl.ioctl(sock.fileno(), 0x8915, request)  # SIOCGIFADDR
                except OSError:
                    continue  # no IPv4 address, or down
                found.append(socket.inet_ntoa(request.tobytes()[20:24]))
    except (OSError, AttributeError):
        found = socket.gethostbyname_ex(socket.gethostname())[2]
    return [ip for ip in dict.fromkeys(found) if not ipaddress.ip_address(ip).is_loopback]


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host if host != "localhost" else "127.0.0.1").is_loopback
    except ValueError:
        return False  # a host name: assume it names a machine


def _answers(ip: str, port: int, timeout: float) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=timeout):
            return True
    except OSError:
        return False


def check_peer(report: Report, rank: int, address: str, timeout: float) -> None:
    """A refused port is only a note (the job may not run yet); an unreachable host is a problem."""
    host, _, port = address.rpartition(":")
    label = f"worker {rank}"
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            report.info(label, f"{address} answers")
    except ConnectionRefusedError:
        report.info(label, f"{address}: host reachable, nothing listening yet (normal before the job starts)")
    except (socket.gaierror, ValueError):
        report.problem(label, f"cannot resolve {address!r}: check the host name in TF_CONFIG/the node list")
    except OSError as err:  # timeouts, no route
        report.problem(label, f"{address} did not answer within {timeout:g}s ({err}); "
                       "check the firewall and that every worker can reach this port")


def check_tensorflow(report: Report) -> None:
    """Versions, devices, NCCL."""
    import keras
    import tensorflow as tf

    from tfdist import precision

    report.info("tensorflow", f"{tf.__version__} (keras {keras.__version__}, python {sys.version.split()[0]})")
    build = tf.sysconfig.get_build_info()
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        cuda = "a CUDA build" if build.get("is_cuda_build") else "a CPU-only build"
        report.info("devices", f"no GPU found ({cuda}); training runs on the CPU: "
                    "split it with --cpu-devices K to test several replicas")
    capabilities = []
    for index, gpu in enumerate(gpus):
        details = tf.config.experimental.get_device_details(gpu)
        capabilities.append(details.get("compute_capability", (0, 0)))
        capability = ".".join(map(str, details.get("compute_capability", ("?",))))
        report.info(f"GPU:{index}", f"{details.get('device_name', 'unknown')}, compute capability {capability}")
    auto = precision.auto_policy(capabilities)
    report.info("precision", f'"auto" picks {auto}: {precision.AUTO_REASONS[auto]}')
    if gpus and build.get("is_cuda_build"):
        report.info("nccl", f"available (CUDA {build.get('cuda_version')}): all-reduce across GPUs uses NCCL")
    else:
        report.info("nccl", "not used: NCCL needs NVIDIA GPUs; collectives use gRPC ring all-reduce")


def check_install(report: Report) -> None:
    """Where tfdist is installed, the workers' start-up hook, and the optional extras."""
    import tfdist
    from tfdist.launch import local

    where = os.path.dirname(os.path.abspath(tfdist.__file__))
    report.info("tfdist", f"{_installed_version(where)} at {where}")
    problem = local.missing_site_hook()
    if problem:
        report.problem("install", problem)
    elif importlib.machinery.PathFinder.find_spec("sitecustomize", [local.SITE_DIR]) is None:
        report.problem("install", f"{local.SITE_HOOK} cannot be imported: reinstall tfdist "
                       "(pip install --force-reinstall tfdist).")
    for module, (package, extra) in extras.EXTRAS.items():
        if extra is None:
            try:
                importlib.import_module(module)
            except ImportError as err:
                report.problem("install", extras.missing_message(module, "tfdist bench and convert", err))
        else:
            found = importlib.util.find_spec(module) is not None
            report.info(f"[{extra}]", f"{package} installed" if found else
                        f'{package} not installed (optional: pip install "tfdist[{extra}]")')


def check_versions(report: Report) -> None:
    """Keras and TensorFlow inside the tested range; every Keras fix applied."""
    import keras
    import tensorflow as tf

    from tfdist import keras_fixes, patching

    for library, version in (("keras", keras.__version__), ("tensorflow", tf.__version__)):
        if not patching.is_tested(library, version):
            report.warning(library, f"{version} is outside the releases tfdist was tested with "
                           f"({patching.tested_range(library)}); if training misbehaves, install one of those.")
    keras_fixes.apply_all()
    for patch in keras_fixes.PATCHES:
        if not patch.applied:
            report.problem("keras fix", f"tfdist's fix {patch.name} ({patch.issue}) is off: {patch.problem}. "
                           f"Install Keras {patching.TESTED_KERAS}: pip install \"keras>={patching.TESTED_KERAS.split()[0]},"
                           f"<={patching.TESTED_KERAS.split()[-1]}.99\"")


def _installed_version(where: str) -> str:
    try:
        distribution = importlib.metadata.distribution("tfdist")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed: imported from a source tree)"
    installed = os.path.abspath(str(distribution.locate_file("tfdist")))
    return distribution.version + ("" if installed == where else " (editable install, or a source tree first on sys.path)")


def diagnose(env: Mapping[str, str], port_timeout: float = 2.0, with_tensorflow: bool = True) -> Report:
    """Runs every check and returns the report."""
    report = Report()
    check_install(report)
    if with_tensorflow:
        check_tensorflow(report)
        check_versions(report)
    check_cluster(report, env, port_timeout)
    return report


def build_parser() -> argparse.ArgumentParser:
    """The ``tfdist doctor`` argument parser."""
    parser = argparse.ArgumentParser(prog="tfdist doctor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port-timeout", type=float, default=2.0, metavar="S",
                        help="seconds to wait for each peer's port (default: %(default)g)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``tfdist doctor``; returns 1 when a problem was found."""
    args = build_parser().parse_args(argv)
    report = diagnose(os.environ, args.port_timeout)
    print("\n".join(report.lines))
    if report.problems:
        print(f"\n{len(report.problems)} problem(s) found; fix the lines marked PROBLEM.")
        return 1
    print("\nNo problems found" + (f" ({len(report.warnings)} warning(s))." if report.warnings else "."))
    return 0

"""``tfdist doctor``: what a user needs to see when distribution misbehaves.

Prints versions, devices, the cluster as tfdist reads it, whether each peer's port
answers, NCCL, and the precision "auto" would pick. Exits 1 when it finds a problem,
saying what to fix; works with no GPU and no cluster (it says so).
"""

from __future__ import annotations

import argparse
import os
import dataclasses
import socket
import sys
from typing import Mapping, Sequence

from tfdist import cluster as cluster_lib


@dataclasses.dataclass
class Report:
    """Lines to print, and the problems among them."""

    lines: list[str] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)

    def info(self, label: str, value: str) -> None:
        self.lines.append(f"{label:<12} {value}")

    def problem(self, label: str, message: str) -> None:
        self.lines.append(f"{label:<12} PROBLEM: {message}")
        self.problems.append(message)


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


def diagnose(env: Mapping[str, str], port_timeout: float = 2.0, with_tensorflow: bool = True) -> Report:
    """Runs every check and returns the report."""
    report = Report()
    if with_tensorflow:
        check_tensorflow(report)
    check_cluster(report, env, port_timeout)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``tfdist doctor``; returns 1 when a problem was found."""
    parser = argparse.ArgumentParser(prog="tfdist doctor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port-timeout", type=float, default=2.0, help="seconds to wait for each peer's port")
    args = parser.parse_args(argv)
    report = diagnose(os.environ, args.port_timeout)
    print("\n".join(report.lines))
    if report.problems:
        print(f"\n{len(report.problems)} problem(s) found; fix the lines marked PROBLEM.")
        return 1
    print("\nNo problems found.")
    return 0

"""Defaults for ``tfdist run`` from the environment: ``TFDIST_NNODES``, ``TFDIST_MASTER``, and a Kubernetes pod's.

    TFDIST_NNODES=2 tfdist run train.py      # in each pod of a 2-pod Indexed Job or JobSet: no flags

``TFDIST_NNODES`` (N or MIN:MAX) and ``TFDIST_MASTER`` (ADDR:PORT) stand for ``--nnodes`` and
``--master`` wherever they are set. In a pod of an Indexed Job, or of a JobSet (whose child
Jobs are Indexed), Kubernetes sets ``JOB_COMPLETION_INDEX`` (this node's rank) and the pod's
host name, ``<job>-<index>`` (JobSet: ``<jobset>-<replicated job>-<job index>-<index>``); with the
pod template's ``subdomain`` naming a headless Service, the pod's fully qualified name is
``<hostname>.<service>.<namespace>.svc.<cluster domain>``. The master is index 0's pod, the
same name ending in ``-0``, at port ``TFDIST_MASTER_PORT`` (default 29400). Pure functions of
the mapping given (habit 2). Standard library only.
"""

from __future__ import annotations

import dataclasses
import re
import socket
from typing import Callable, Mapping

from tfdist.errors import LaunchError

ENV_NNODES = "TFDIST_NNODES"
ENV_MASTER = "TFDIST_MASTER"
ENV_MASTER_PORT = "TFDIST_MASTER_PORT"
ENV_INDEX = "JOB_COMPLETION_INDEX"  # set by Kubernetes in every pod of an Indexed Job
DEFAULT_MASTER_PORT = 29400


@dataclasses.dataclass(frozen=True)
class Defaults:
    """What the environment says; None where it says nothing."""

    nnodes: str | None = None
    node_rank: int | None = None
    master: str | None = None


def defaults(env: Mapping[str, str], fqdn: Callable[[str], str] = socket.getfqdn) -> Defaults:
    """``--nnodes``, ``--node-rank`` and ``--master`` as the environment gives them.

    ``fqdn(hostname)``: the pod's fully qualified name (``socket.getfqdn`` reads the /etc/hosts
    line the kubelet writes).

    Raises:
        LaunchError: a pod of a multi-node job whose master cannot be named (no subdomain).
    """
    nnodes, master = env.get(ENV_NNODES) or None, env.get(ENV_MASTER) or None
    index = env.get(ENV_INDEX)
    if nnodes is None or index is None:
        return Defaults(nnodes, None, master)
    if not index.isdigit():
        raise LaunchError(f"{ENV_INDEX} must be a pod's completion index (0, 1, ...): received {index!r}.")
    return Defaults(nnodes, int(index), master or _master_pod(env, int(index), fqdn))


def _master_pod(env: Mapping[str, str], index: int, fqdn: Callable[[str], str]) -> str:
    """``<name>-0.<service>...:<port>``: the pod of index 0 behind this pod's headless Service."""
    hostname = env.get("HOSTNAME", "")
    port = env.get(ENV_MASTER_PORT) or str(DEFAULT_MASTER_PORT)
    if not port.isdigit():
        raise LaunchError(f"{ENV_MASTER_PORT} must be a port number: received {port!r}.")
    stem = re.fullmatch(rf"(.+)-{index}", hostname)
    if stem is None:
        raise LaunchError(f"this pod's host name {hostname!r} does not end in -{index} ({ENV_INDEX}): tfdist names "
                          f"the master after an Indexed Job's or a JobSet's pods; set {ENV_MASTER}=ADDR:PORT.")
    full = fqdn(hostname)
    if not full.startswith(hostname + "."):
        raise LaunchError(f"this pod ({hostname}) has no DNS subdomain, so the other pods cannot reach it by name: "
                          "set the pod template's subdomain to a headless Service that selects the job's pods "
                          f"(docs/kubernetes/), or set {ENV_MASTER}=ADDR:PORT.")
    return f"{stem.group(1)}-0{full[len(hostname):]}:{port}"

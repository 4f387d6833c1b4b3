"""Device specs: which of this machine's devices a strategy uses, and its logical CPU devices.

``resolve_devices`` turns what users write (``None``, ``2``, ``"GPU:*"``, ``"GPU:[0-3]"``,
``["GPU:0", "/gpu:1"]``) into TensorFlow's device names; ``pin_gpus`` gives each local
worker its share of the GPUs (Horovod's pin-by-local-rank); ``configure_cpu_devices``
splits the CPU for ``tfdist run --cpu-devices``; ``configure_inter_op_threads`` and
``configure_cpu_allocator`` set the runtime up for a multi-worker process. All of it must
happen before TensorFlow's runtime starts, which ``runtime_initialized`` tells.
"""

from __future__ import annotations

import os
import re
from typing import Sequence, Union

import tensorflow as tf

from tfdist import cluster as cluster_lib
from tfdist.errors import StrategyError

DeviceSpec = Union[None, int, str, Sequence[str]]
_PATTERN = re.compile(r"^(CPU|GPU):(\*|\d+|\[(\d+)-(\d+)\])$", re.IGNORECASE)


def pin_gpus(cluster: cluster_lib.ClusterInfo, devices: DeviceSpec) -> None:
    """Gives each local worker its own GPUs (Horovod's pin-by-local-rank), before the runtime starts.

    A script that already narrowed its visible GPUs itself (a Horovod script's
    ``set_visible_devices(gpus[hvd.local_rank()], "GPU")``) keeps its choice.
    """
    gpus = tf.config.list_physical_devices("GPU")
    if devices is None and len(tf.config.get_visible_devices("GPU")) < len(gpus):
        return
    if devices is not None:
        chosen = [gpus[i] for i in _select_indices(devices, [f"GPU:{i}" for i in range(len(gpus))])]
    elif cluster.local_size > 1 and len(gpus) >= cluster.local_size:
        per_worker = len(gpus) // cluster.local_size
        chosen = gpus[cluster.local_rank * per_worker:(cluster.local_rank + 1) * per_worker]
    else:
        return
    tf.config.set_visible_devices(chosen, "GPU")


def resolve_devices(devices: DeviceSpec = None) -> list[str]:
    """Turns a device spec into full logical device names.

    Raises:
        StrategyError: the spec is malformed or matches no visible device (the message
            lists the visible ones).
    """
    gpus = [d.name for d in tf.config.list_logical_devices("GPU")]
    cpus = [d.name for d in tf.config.list_logical_devices("CPU")]
    visible = gpus + cpus
    if devices is None:
        return gpus or cpus
    if isinstance(devices, int) and not isinstance(devices, bool):
        pool = gpus or cpus
        if not 1 <= devices <= len(pool):
            raise StrategyError(f"devices={devices} asks for {devices} device(s), but {len(pool)} are "
                                f"visible: {_short(pool)}. Pass 1..{len(pool)}.")
        return pool[:devices]
    return [visible[i] for i in _select_indices(devices, visible)]


def _select_indices(devices: DeviceSpec, visible: Sequence[str]) -> list[int]:
    """Indices into ``visible`` (full or short names) that a name list or pattern selects."""
    short = [_short_name(name) for name in visible]
    if isinstance(devices, str):
        match = _PATTERN.match(devices.strip())
        if not match:
            raise StrategyError(
                f"Cannot read devices={devices!r}: use a pattern like 'GPU:*', 'GPU:[0-3]', 'CPU:*' "
                "or 'GPU:1', a list of names, or an int.")
        kind, index, first, last = match.groups()
        kind = kind.upper()
        if index == "*":
            wanted = {s for s in short if s.startswith(kind + ":")}
        elif first is not None:
            wanted = {f"{kind}:{i}" for i in range(int(first), int(last) + 1)}
        else:
            wanted = {f"{kind}:{index}"}
        chosen = [i for i, s in enumerate(short) if s in wanted]
    elif isinstance(devices, (list, tuple)) and devices and all(isinstance(d, str) for d in devices):
        chosen = []
        for name in devices:
            key = _short_name(name)
            if key not in short:
                raise StrategyError(f"Device {name!r} in devices={list(devices)!r} is not visible; "
                                    f"visible devices: {_short(visible)}.")
            chosen.append(short.index(key))
    else:
        raise StrategyError(f"Cannot read devices={devices!r}: pass None, an int, a list of names "
                            "like ['GPU:0', 'GPU:1'], or a pattern like 'GPU:*'.")
    if not chosen:
        raise StrategyError(f"devices={devices!r} matches no visible device; visible devices: "
                            f"{_short(visible)}.")
    return chosen


def _short_name(name: str) -> str:
    """'/job:localhost/replica:0/task:0/device:GPU:1' or '/gpu:1' -> 'GPU:1'."""
    kind, _, index = name.rsplit("/", 1)[-1].replace("device:", "").replace("physical_device:", "").rpartition(":")
    return f"{kind.upper()}:{index}"


def _short(names: Sequence[str]) -> list[str]:
    return [_short_name(n) for n in names]


def runtime_initialized() -> bool:
    """Whether TensorFlow's eager runtime has started (after which devices and collectives are fixed)."""
    from tensorflow.python.eager import context  # private: TF has no public query for this
    return context.context()._context_handle is not None


def configure_cpu_devices(count: int | None) -> None:
    """Splits the CPU into ``count`` logical devices (``tfdist run --cpu-devices``)."""
    if count is None:
        return
    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu)
    if current is not None and len(current) == count:
        return
    if runtime_initialized():
        raise StrategyError(
            f"{cluster_lib.ENV_CPU_DEVICES}={count} asks for {count} logical CPU devices, but TensorFlow "
            "already started with another number. Build the strategy before any other TensorFlow code.")
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * count)


MIN_INTER_OP_THREADS = 2


def configure_inter_op_threads() -> None:
    """Gives TensorFlow at least 2 inter-op threads when it would have 1 (a worker bound to one core).

    With one thread, TensorFlow's executor runs a ready backward-pass op inline and queues
    the others behind it, so a bucket's gradient (and its all-reduce) waits for the whole
    chain of earlier layers: nothing overlaps. A second thread takes the queued ops while
    the chain runs. Leaves a choice the script made (``set_inter_op_parallelism_threads``)
    and a started runtime alone.
    """
    if runtime_initialized() or tf.config.threading.get_inter_op_parallelism_threads() != 0:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if cores < MIN_INTER_OP_THREADS:
        tf.config.threading.set_inter_op_parallelism_threads(MIN_INTER_OP_THREADS)


CPU_ALLOCATOR_ENV = "TF_CPU_ALLOCATOR_USE_BFC"


def configure_cpu_allocator() -> None:
    """Makes TensorFlow keep freed CPU tensor memory for reuse (its BFC allocator) in a multi-worker process.

    With TensorFlow's default CPU allocator, a MultiWorkerMirroredStrategy worker gets fresh
    pages from the kernel for its large tensors every step (page faults, zeroing: measured
    here, 30-40 ms of system time in a 50 ms step of a small CNN; a process without the
    strategy reuses its memory). ``TF_CPU_ALLOCATOR_USE_BFC=true`` is TensorFlow's own switch,
    read when its runtime starts; a value the user set is kept.
    """
    if not runtime_initialized():
        os.environ.setdefault(CPU_ALLOCATOR_ENV, "true")

"""The one place that builds tf.distribute strategies.

``scope()`` reads the cluster from the environment, builds the strategy once per
process (TensorFlow allows one MultiWorkerMirroredStrategy per process, created
before its runtime starts), applies the Keras 3 multi-worker fixes, and enters it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sys
from typing import Any, Iterator, Sequence, Union

import tensorflow as tf

from tfdist import cluster as cluster_lib
from tfdist import keras_fixes
from tfdist import precision as precision_lib
from tfdist import startup

STRATEGY_NAMES = ("auto", "default", "one_device", "mirrored", "multi_worker")
CROSS_DEVICE_OPS = {
    "nccl": tf.distribute.NcclAllReduce,
    "hierarchical_copy": tf.distribute.HierarchicalCopyAllReduce,
    "reduction_to_one": tf.distribute.ReductionToOneDevice,
}
COMMUNICATIONS = {
    "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
    "ring": tf.distribute.experimental.CommunicationImplementation.RING,
    "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
}
DEFAULT_COLLECTIVE_TIMEOUT = 600.0
# Options scope() accepts besides strategy and devices, with their defaults.
DEFAULT_OPTIONS = {
    "cross_device_ops": None,     # mirrored: one of CROSS_DEVICE_OPS; None lets TF choose
    "communication": "auto",      # multi_worker: one of COMMUNICATIONS
    # multi_worker: seconds before a collective that a stuck or dead peer never joins fails,
    # instead of hanging (tensorflow#35878); None waits forever.
    "collective_timeout": DEFAULT_COLLECTIVE_TIMEOUT,
}

DeviceSpec = Union[None, int, str, Sequence[str]]
_PATTERN = re.compile(r"^(CPU|GPU):(\*|\d+|\[(\d+)-(\d+)\])$", re.IGNORECASE)



@dataclasses.dataclass(frozen=True)
class _Built:
    key: tuple           # the request, as _request_key makes it
    strategy: tf.distribute.Strategy
    origin: str          # where it was built, for messages: "built by tfdist at train.py:12"
    adopted: bool = False  # built by the script itself, not by tfdist


_built: _Built | None = None


class StrategyError(ValueError):
    """A strategy, device spec or option that tfdist cannot build; the message says the fix."""


@contextlib.contextmanager
def scope(strategy: str = "auto", devices: DeviceSpec = None, precision: str | None = None,
          **options: Any) -> Iterator[tf.distribute.Strategy]:
    """Builds (once per process) and enters a distribution strategy; yields it.

    Args:
        strategy: "auto", "default", "one_device", "mirrored" or "multi_worker".
            "auto" is multi_worker when the environment describes more than one
            worker, mirrored when more than one device is selected, else default.
        devices: None (all GPUs, else all CPU devices), an int N (the first N), a list
            of names ("GPU:0", "/gpu:1"), or a pattern ("GPU:*", "GPU:[0-3]", "CPU:*").
        precision: None (leave Keras' dtype policy alone), "float32", "mixed_float16",
            "mixed_bfloat16" or "auto" (see tfdist.precision). Set for the block and
            restored after it; not part of the once-per-process strategy, so each
            scope may choose its own.
        **options: ``cross_device_ops`` (mirrored), ``communication`` and
            ``collective_timeout`` (multi_worker).

    Yields:
        The tf.distribute.Strategy, entered.

    Raises:
        StrategyError: unknown name or option, devices that match nothing, a different
            strategy requested after one was built, or multi_worker asked for after
            TensorFlow initialised its runtime.
        tfdist.precision.PrecisionError: unknown precision.
    """
    if precision is not None:
        precision_lib.check_name(precision)  # a bad name fails before anything is built
    built = get_strategy(strategy, devices, **options)
    with precision_lib.policy_scope(precision), built.scope():
        yield built


def get_strategy(strategy: str = "auto", devices: DeviceSpec = None, **options: Any) -> tf.distribute.Strategy:
    """Returns the process's strategy, building it on the first call; does not enter it."""
    return _get_or_build(_request_key(strategy, devices, options), None)


def _get_or_build(key: tuple, origin: str | None) -> tf.distribute.Strategy:
    global _built
    if _built is not None:
        if key in (_built.key, _AUTO_KEY):
            return _built.strategy
        raise StrategyError(
            f"tfdist already built a strategy for {_describe(_built.key)} in this process ({_built.origin}); "
            f"received {_describe(key)}. A process builds one strategy: pass the same arguments everywhere, "
            "call tfdist.get_strategy() with none to reuse it, or make this call come first."
        )
    name, devices, options = key
    built = make_strategy(name, list(devices) if isinstance(devices, tuple) else devices, **dict(options))
    _built = _Built(key, built, origin or f"built by tfdist at {startup.user_frame(sys._getframe(1))}")
    return built


def build_at_runtime_start(origin: str) -> tf.distribute.Strategy:
    """Builds the default strategy just before TensorFlow's runtime starts (``tfdist.runtime_hooks``)."""
    return _get_or_build(_request_key("auto", None, {}), origin)


def adopt(strategy: tf.distribute.Strategy, origin: str) -> None:
    """Makes a multi-worker strategy the script built itself the process's strategy, if it has none."""
    global _built
    if _built is None:
        _built = _Built(_request_key("multi_worker", None, {}), strategy, origin, adopted=True)


def current_strategy() -> tf.distribute.Strategy | None:
    """The strategy tfdist built (or adopted) in this process, or None."""
    return None if _built is None else _built.strategy


def built_by_tfdist() -> tf.distribute.Strategy | None:
    """The process's strategy if tfdist built it (not adopted from the script), else None."""
    return None if _built is None or _built.adopted else _built.strategy


def current_multi_worker() -> tf.distribute.Strategy | None:
    """The process's multi-worker strategy, or None."""
    built = current_strategy()
    if isinstance(built, tf.distribute.MultiWorkerMirroredStrategy) and built.extended._num_workers > 1:
        return built
    return None


def origin_of_current() -> str:
    """Where the process's strategy came from, for messages."""
    return "no strategy yet" if _built is None else _built.origin


def init(strategy: str = "auto", devices: DeviceSpec = None, precision: str | None = None,
         **options: Any) -> tf.distribute.Strategy:
    """Horovod-style start: builds the strategy and makes it the process-wide default.

    After ``init()``, code that never enters a scope (``keras.Sequential(...)``,
    ``model.compile``, ``model.fit``) runs distributed. ``precision`` (see ``scope``)
    sets Keras' dtype policy for the rest of the process. Returns the strategy.
    """
    if precision is not None:
        precision_lib.check_name(precision)
    built = get_strategy(strategy, devices, **options)
    if precision is not None:
        precision_lib.set_policy(precision)
    if tf.distribute.get_strategy() is not built:
        tf.distribute.experimental_set_strategy(built)
    return built


def make_strategy(strategy: str = "auto", devices: DeviceSpec = None, *,
                  cluster: cluster_lib.ClusterInfo | None = None, **options: Any) -> tf.distribute.Strategy:
    """The factory: builds a new strategy by name, with no caching.

    Most code wants ``scope()`` or ``get_strategy()``, which build once per process.
    """
    opts = _check_options(options)
    keras_fixes.apply_all()
    if strategy not in STRATEGY_NAMES:
        raise StrategyError(f"Unknown strategy {strategy!r}; choose one of {list(STRATEGY_NAMES)}.")
    cluster = cluster_lib.cluster_from_env() if cluster is None else cluster
    configure_cpu_devices(cluster_lib.cpu_devices_from_env())
    if strategy == "auto":
        strategy = _auto_name(cluster, devices)
    if strategy == "multi_worker":
        return _multi_worker(cluster, devices, opts)
    if strategy == "default":
        if devices is not None:
            raise StrategyError(f"strategy='default' uses TensorFlow's placement; received devices={devices!r}. "
                                "Drop devices, or use strategy='one_device' or 'mirrored'.")
        return tf.distribute.get_strategy()
    names = resolve_devices(devices)
    if strategy == "one_device":
        if len(names) != 1:
            raise StrategyError(f"strategy='one_device' needs exactly one device; devices={devices!r} "
                                f"selected {names}. Pass one, e.g. devices=['GPU:0'].")
        return tf.distribute.OneDeviceStrategy(names[0])
    cross_device_ops = opts["cross_device_ops"]
    return tf.distribute.MirroredStrategy(
        names, cross_device_ops=CROSS_DEVICE_OPS[cross_device_ops]() if cross_device_ops else None)


def _auto_name(cluster: cluster_lib.ClusterInfo, devices: DeviceSpec) -> str:
    if cluster.is_multi_worker:
        return "multi_worker"
    names = resolve_devices(devices)
    if len(names) > 1:
        return "mirrored"
    return "default" if devices is None else "one_device"


def _multi_worker(cluster: cluster_lib.ClusterInfo, devices: DeviceSpec, opts: dict) -> tf.distribute.Strategy:
    existing = current_multi_worker()
    if existing is not None:
        return existing  # TensorFlow allows one per process
    if not cluster.is_multi_worker:
        raise StrategyError(
            f"strategy='multi_worker' needs a cluster of several workers, but the environment "
            f"describes {cluster.num_workers} (source: {cluster.source}). Start the script with "
            "'tfdist run -n N -- python script.py', set TF_CONFIG, or run it under srun."
        )
    if runtime_initialized():
        raise StrategyError(_too_late_message())
    _pin_gpus(cluster, devices)
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=COMMUNICATIONS[opts["communication"]],
        timeout_seconds=opts["collective_timeout"],
    )
    return tf.distribute.MultiWorkerMirroredStrategy(
        cluster_resolver=_cluster_resolver(cluster), communication_options=options)


def _too_late_message() -> str:
    from tfdist import runtime_hooks

    started = runtime_hooks.runtime_started_at
    if started is None:
        return ("strategy='multi_worker' must be built before TensorFlow's runtime starts, and it started before "
                f"tfdist was imported (`import tfdist` ran at {startup.imported_at}). Move `import tfdist` above "
                "the first TensorFlow code of your script (tfdist then builds the strategy just before TensorFlow "
                "starts), or start the job with `tfdist run`, which does that for you.")
    return (f"strategy='multi_worker' must be built before TensorFlow's runtime starts, and it started at {started}, "
            "when this process did not see a multi-worker cluster (TF_CONFIG or SLURM variables were not set yet, "
            "or this is a child process). Set the cluster variables before that line, or build the strategy "
            "in the worker's main process.")


def _cluster_resolver(cluster: cluster_lib.ClusterInfo):
    if cluster.source in ("tf_config", "tfdist"):
        return tf.distribute.cluster_resolver.TFConfigClusterResolver()
    addresses = cluster.worker_addresses
    if cluster.source == "mpi":
        from tfdist.launch import mpi  # mpi4py only now, in the worker

        addresses = mpi.exchange_addresses(cluster)
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": list(addresses)}),
        task_type="worker", task_id=cluster.worker_index, rpc_layer="grpc")


def _pin_gpus(cluster: cluster_lib.ClusterInfo, devices: DeviceSpec) -> None:
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


def _check_options(options: dict) -> dict:
    unknown = sorted(set(options) - set(DEFAULT_OPTIONS))
    if unknown:
        raise StrategyError(f"Unknown option(s) {unknown}; tfdist.scope() accepts {sorted(DEFAULT_OPTIONS)}.")
    opts = {**DEFAULT_OPTIONS, **options}
    if opts["cross_device_ops"] not in (None, *CROSS_DEVICE_OPS):
        raise StrategyError(f"Unknown cross_device_ops={opts['cross_device_ops']!r}; choose one of "
                            f"{list(CROSS_DEVICE_OPS)} or None.")
    if opts["communication"] not in COMMUNICATIONS:
        raise StrategyError(f"Unknown communication={opts['communication']!r}; choose one of {list(COMMUNICATIONS)}.")
    timeout = opts["collective_timeout"]
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise StrategyError(f"collective_timeout must be positive seconds or None: received {timeout!r}.")
    return opts


def _request_key(strategy: str, devices: DeviceSpec, options: dict) -> tuple:
    """(name, devices, options) of a request; "auto" in a multi-worker cluster is "multi_worker"."""
    if strategy == "auto" and _env_is_multi_worker():
        strategy = "multi_worker"
    devices_key = tuple(devices) if isinstance(devices, (list, tuple)) else devices
    return strategy, devices_key, tuple(sorted(options.items()))


def _env_is_multi_worker() -> bool:
    try:
        return cluster_lib.cluster_from_env().is_multi_worker
    except cluster_lib.ClusterConfigError:
        return False  # make_strategy reports the bad variables


_AUTO_KEY = ("auto", None, ())


def _describe(key: tuple) -> str:
    strategy, devices, options = key
    extra = "".join(f", {k}={v!r}" for k, v in options)
    return f"strategy={strategy!r}, devices={devices!r}{extra}"


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

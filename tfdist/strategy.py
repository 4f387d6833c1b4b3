"""The one place that builds tf.distribute strategies.

``scope()`` reads the cluster from the environment, builds the strategy once per
process (TensorFlow allows one MultiWorkerMirroredStrategy per process, created
before its runtime starts), records it in ``tfdist.state``, and enters it. (tfdist's
Keras fixes are applied when Keras is imported: see ``tfdist.startup``.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from typing import Any, Iterator

import tensorflow as tf

from tfdist import cluster as cluster_lib
from tfdist import devices as devices_lib
from tfdist import precision as precision_lib
from tfdist import preemption, process_group, sharding, startup, state, stragglers, timeline, watchdog
from tfdist.errors import StrategyError
from tfdist.state import built_by_tfdist, current_strategy, origin_of_current  # noqa: F401  (this module's API)

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
# None: TensorFlow 2.21 gives every collective that has a timeout a thread of its own, which sleeps out
# the timeout (tsl's Env::SchedClosureAfter): 600 s at tens of collectives a second is thousands of
# live threads per worker (this machine's pid_max is 32768). Dead peers are noticed without it
# (heartbeats, tfdist run's supervisor); a stuck but alive peer needs collective_timeout=N.
DEFAULT_COLLECTIVE_TIMEOUT = None
# Options scope() accepts besides strategy and devices, with their defaults.
DEFAULT_OPTIONS = {
    "cross_device_ops": None,     # mirrored: one of CROSS_DEVICE_OPS; None lets TF choose
    "communication": "auto",      # multi_worker: one of COMMUNICATIONS
    # multi_worker: seconds before a collective that a stuck peer never joins fails, instead of
    # hanging (tensorflow#35878); None (the default) waits: a dead peer is still noticed.
    "collective_timeout": DEFAULT_COLLECTIVE_TIMEOUT,
}



@contextlib.contextmanager
def scope(strategy: str = "auto", devices: devices_lib.DeviceSpec = None, precision: str | None = None,
          shard_optimizer_state: bool | None = None, **options: Any) -> Iterator[tf.distribute.Strategy]:
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
        shard_optimizer_state: True: an optimizer created in the block keeps 1/N of its
            state on each of the N replicas (ZeRO-1, ``tfdist.keras_fixes.sharded_state``);
            None: as ``TFDIST_SHARD_OPTIMIZER_STATE`` says (off when unset).
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
    if shard_optimizer_state is not None:
        sharding.check(shard_optimizer_state)
    built = get_strategy(strategy, devices, **options)
    with precision_lib.policy_scope(precision), sharding.scoped(shard_optimizer_state), built.scope():
        yield built


def get_strategy(strategy: str = "auto", devices: devices_lib.DeviceSpec = None, **options: Any) -> tf.distribute.Strategy:
    """Returns the process's strategy, building it on the first call; does not enter it."""
    return _get_or_build(_request_key(strategy, devices, options), None)


def _get_or_build(key: tuple, origin: str | None) -> tf.distribute.Strategy:
    built = state.built
    if built is not None:
        if key in (built.key, _AUTO_KEY):
            return built.strategy
        raise StrategyError(
            f"tfdist already built a strategy for {_describe(built.key)} in this process ({built.origin}); "
            f"received {_describe(key)}. A process builds one strategy: pass the same arguments everywhere, "
            "call tfdist.get_strategy() with none to reuse it, or make this call come first."
        )
    name, devices, options = key
    strategy = make_strategy(name, list(devices) if isinstance(devices, tuple) else devices, **dict(options))
    state.record(state.Built(key, strategy, origin or f"built by tfdist at {startup.user_frame(sys._getframe(1))}"))
    _start_watchdog(strategy)
    return strategy


def build_at_runtime_start(origin: str) -> tf.distribute.Strategy:
    """Builds the default strategy just before TensorFlow's runtime starts (``tfdist.runtime_hooks``)."""
    return _get_or_build(_request_key("auto", None, {}), origin)


def adopt(strategy: tf.distribute.Strategy, origin: str) -> None:
    """Makes a multi-worker strategy the script built itself the process's strategy, if it has none."""
    if state.built is None:
        state.record(state.Built(_request_key("multi_worker", None, {}), strategy, origin, adopted=True))
        _start_watchdog(strategy)


def _start_watchdog(strategy: tf.distribute.Strategy) -> None:
    """Starts the hang watchdog (``TFDIST_HANG_TIMEOUT``), the timeline thread and the periodic straggler report
    in a multi-worker process, and the agreed stop (``tfdist.preemption``) in every process."""
    rank, size = process_group.worker_rank(strategy), process_group.num_workers(strategy)
    preemption.start(rank, size)
    if process_group.is_multi_worker(strategy):
        watchdog.start(rank, size)
        timeline.start(rank, size)
        stragglers.start(rank, size)


def current_multi_worker() -> tf.distribute.Strategy | None:
    """The process's multi-worker strategy, or None."""
    built = state.current_strategy()
    return built if process_group.is_multi_worker(built) else None




def init(strategy: str = "auto", devices: devices_lib.DeviceSpec = None, precision: str | None = None,
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


def make_strategy(strategy: str = "auto", devices: devices_lib.DeviceSpec = None, *,
                  cluster: cluster_lib.ClusterInfo | None = None, **options: Any) -> tf.distribute.Strategy:
    """The factory: builds a new strategy by name, with no caching.

    Most code wants ``scope()`` or ``get_strategy()``, which build once per process.
    """
    opts = _check_options(options)
    if strategy not in STRATEGY_NAMES:
        raise StrategyError(f"Unknown strategy {strategy!r}; choose one of {list(STRATEGY_NAMES)}.")
    cluster = cluster_lib.cluster_from_env() if cluster is None else cluster
    devices_lib.configure_cpu_devices(cluster_lib.cpu_devices_from_env())
    if strategy == "auto":
        strategy = _auto_name(cluster, devices)
    if strategy == "multi_worker":
        return _multi_worker(cluster, devices, opts)
    if strategy == "default":
        if devices is not None:
            raise StrategyError(f"strategy='default' uses TensorFlow's placement; received devices={devices!r}. "
                                "Drop devices, or use strategy='one_device' or 'mirrored'.")
        return tf.distribute.get_strategy()
    names = devices_lib.resolve_devices(devices)
    if strategy == "one_device":
        if len(names) != 1:
            raise StrategyError(f"strategy='one_device' needs exactly one device; devices={devices!r} "
                                f"selected {names}. Pass one, e.g. devices=['GPU:0'].")
        return tf.distribute.OneDeviceStrategy(names[0])
    cross_device_ops = opts["cross_device_ops"]
    if len(names) > 1:
        devices_lib.configure_inter_op_threads()
    return tf.distribute.MirroredStrategy(
        names, cross_device_ops=CROSS_DEVICE_OPS[cross_device_ops]() if cross_device_ops else None)


def _auto_name(cluster: cluster_lib.ClusterInfo, devices: devices_lib.DeviceSpec) -> str:
    if cluster.is_multi_worker:
        return "multi_worker"
    names = devices_lib.resolve_devices(devices)
    if len(names) > 1:
        return "mirrored"
    return "default" if devices is None else "one_device"


def _multi_worker(cluster: cluster_lib.ClusterInfo, devices: devices_lib.DeviceSpec, opts: dict) -> tf.distribute.Strategy:
    existing = current_multi_worker()
    if existing is not None:
        return existing  # TensorFlow allows one per process
    if not cluster.is_multi_worker:
        raise StrategyError(
            f"strategy='multi_worker' needs a cluster of several workers, but the environment "
            f"describes {cluster.num_workers} (source: {cluster.source}). Start the script with "
            "'tfdist run -n N -- python script.py', set TF_CONFIG, or run it under srun."
        )
    if devices_lib.runtime_initialized():
        raise StrategyError(_too_late_message())
    devices_lib.pin_gpus(cluster, devices)
    devices_lib.configure_inter_op_threads()
    devices_lib.configure_cpu_allocator()
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=COMMUNICATIONS[opts["communication"]],
        timeout_seconds=opts["collective_timeout"],
    )
    return tf.distribute.MultiWorkerMirroredStrategy(
        cluster_resolver=_cluster_resolver(cluster), communication_options=options)


def _too_late_message() -> str:
    started = state.runtime_started_at
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


def _request_key(strategy: str, devices: devices_lib.DeviceSpec, options: dict) -> tuple:
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


def __getattr__(name: str):
    """``resolve_devices``, ``runtime_initialized``, ``configure_cpu_devices``, ``DeviceSpec``: tfdist.devices' own.

    Looked up when used, not at import: a script that imports ``tfdist.devices`` first imports
    TensorFlow from it, whose Keras import applies tfdist's fixes, which import this module while
    ``tfdist.devices`` is still half-imported.
    """
    if name in ("resolve_devices", "runtime_initialized", "configure_cpu_devices", "DeviceSpec"):
        return getattr(devices_lib, name)
    raise AttributeError(f"module 'tfdist.strategy' has no attribute {name!r}")

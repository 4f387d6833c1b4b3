"""One multi-worker strategy per process, whoever asks for it first.

TensorFlow lets a process configure collective ops once, before its runtime starts, so
``MultiWorkerMirroredStrategy`` must be built before the first op; most Keras scripts
build their tf.data pipeline first. Two patches, installed when TensorFlow is imported
(``tfdist.startup``), make the order not matter:

* ``Context.ensure_initialized``: just before the runtime starts, when the environment
  describes a multi-worker cluster (TF_CONFIG, SLURM, ``tfdist run``), tfdist builds its
  strategy, and splits the CPU for ``tfdist run --cpu-devices``. A later
  ``tfdist.scope()`` returns that strategy. Never in a multiprocessing child.
* ``tf.distribute.MultiWorkerMirroredStrategy(...)``: when the process already has one
  for the same cluster, the constructor returns it (no second collective context); the
  first one a script builds itself becomes tfdist's. Building one marks the worker
  "joining"/"joined" for the launcher's start-up watchdog, or "port-clash" when TensorFlow's
  server cannot listen on the worker's port (the launcher then retries on fresh ports).

Each is a ``tfdist.patching.Patch`` whose guard checks the internal it replaces.

And ``tf.distribute.MirroredStrategy()`` in a multi-worker job warns that it trains each
worker's own copy, and takes collective keys of this worker's own (task 0 resolves every group).
``install`` also applies ``tfdist.tf_fixes`` (tf.distribute's input).

When the hang watchdog starts (``tfdist.watchdog``), every ``tf.function`` call and every eager
collective of MultiWorkerMirroredStrategy marks its thread "in a call" until it returns
(``step_marks``), so a step that waits in a collective is seen.
"""

from __future__ import annotations

import multiprocessing
import sys
import warnings

import tensorflow as tf

from tensorflow.python.distribute import collective_all_reduce_strategy, cross_device_ops, multi_worker_util
from tensorflow.python.eager import context
from tensorflow.python.eager.polymorphic_function import polymorphic_function

from tfdist import cluster as cluster_lib
from tfdist import devices, startup, state, tf_fixes, watchdog
from tfdist.errors import ClusterWarning
from tfdist.patching import Patch

_Strategy = collective_all_reduce_strategy.CollectiveAllReduceStrategy
_building = False
# What TensorFlow 2.21 raises (UnknownError, from the constructor's context.ensure_initialized) when its gRPC server
# cannot bind the port in TF_CONFIG, with or without SO_REUSEPORT on the holder's socket; its log says "Failed to add
# port to server: No address added ...". tests/test_faults.py checks it still does.
_SERVER_NOT_STARTED = "Could not start gRPC server"
# Callers of __new__ that copy a strategy rather than ask for one.
_COPYING = ("__deepcopy__", "__copy__", "__newobj__", "__newobj_ex__", "_reconstruct")

runtime_start = Patch(
    "strategy before the runtime starts", "tensorflow: collectives are configured once, at start-up",
    without="a multi-worker job whose script runs TensorFlow code before tfdist.scope() fails with \"Collective "
            "ops must be configured at program startup\".", library="tensorflow")
one_multi_worker = Patch(
    "one MultiWorkerMirroredStrategy per process", "tensorflow: one collective context per process",
    without="a script's own tf.distribute.MultiWorkerMirroredStrategy() is a second strategy beside tfdist's, and "
            "the launcher's start-up watchdog does not see it join.", library="tensorflow")
mirrored_warning = Patch(
    "MirroredStrategy in a multi-worker job", "tfdist: a warning",
    without="tf.distribute.MirroredStrategy() in a multi-worker job trains each worker's own copy, silently.",
    library="tensorflow")

step_marks = Patch(
    "tf.function calls seen by the hang watchdog", "tfdist: the hang watchdog's marks",
    without="the hang watchdog sees only tfdist's eager collectives: a train step (or an eager strategy.reduce) "
            "that waits forever in a collective is not reported.", library="tensorflow")


def install() -> None:
    """Installs the patches (idempotent); the runtime-start one only if the runtime has not started."""
    tf_fixes.patch.apply()
    tf_fixes.input_clock.apply()
    tf_fixes.multi_device_input.apply()
    one_multi_worker.apply()
    mirrored_warning.apply()
    watchdog.on_start(step_marks.apply)
    if context.context()._context_handle is None:
        runtime_start.apply()


@step_marks.replaces(polymorphic_function.Function, "__call__", ("self", "args", "kwds"))
def _call_function(original, self, *args, **kwds):
    return _marked(original, self, None, args, kwds)


_Collectives = cross_device_ops.CollectiveAllReduce


@step_marks.replaces(_Collectives, "reduce_implementation", ("self", "reduce_op", "per_replica_value", "destinations",
                                                             "options"))
def _reduce(original, self, *args, **kwargs):
    return _marked(original, self, "MultiWorkerMirroredStrategy reduce", args, kwargs)


@step_marks.replaces(_Collectives, "batch_reduce_implementation", ("self", "reduce_op", "value_destination_pairs",
                                                                   "options"))
def _batch_reduce(original, self, *args, **kwargs):
    return _marked(original, self, "MultiWorkerMirroredStrategy batch_reduce", args, kwargs)


@step_marks.replaces(_Collectives, "_gather_implementation", ("self", "per_replica_value", "destinations", "axis",
                                                              "options"))
def _gather(original, self, *args, **kwargs):
    return _marked(original, self, "MultiWorkerMirroredStrategy gather", args, kwargs)


def _marked(original, self, label: str | None, args: tuple, kwargs: dict):
    """``original(self, ...)`` marked as a call (eager; while tracing, the tf.function's call is marked)."""
    watchdog.enter(self, label)
    try:
        return original(self, *args, **kwargs)
    finally:
        watchdog.leave()


@runtime_start.replaces(context.Context, "ensure_initialized", ("self",))
def _ensure_initialized(original, self):
    global _building
    if not self._initialized and not _building:
        _building = True
        try:
            state.runtime_started_at = startup.user_frame(sys._getframe(2))
            _before_runtime_start()
        finally:
            _building = False
    original(self)
    if self._initialized:
        runtime_start.restore()  # off the hot path from now on


def _before_runtime_start() -> None:
    from tfdist import strategy as strategy_lib

    if multiprocessing.parent_process() is not None:
        return  # a multiprocessing child must not join the cluster its parent belongs to
    try:
        cluster = cluster_lib.cluster_from_env()
        cpu_devices = cluster_lib.cpu_devices_from_env()
    except cluster_lib.TFConfigChangedError:
        raise  # under tfdist run: every worker must stop, saying why
    except cluster_lib.ClusterConfigError:
        return  # not a cluster tfdist reads (a parameter-server job, say): leave it to the script
    if cluster.is_multi_worker and state.current_strategy() is None:
        strategy_lib.build_at_runtime_start(f"before TensorFlow's first op ({state.runtime_started_at})")
    elif cpu_devices is not None:
        devices.configure_cpu_devices(cpu_devices)


@one_multi_worker.replaces(_Strategy, "__new__", ("args", "kwargs"))  # object.__new__: the class defines none
def _new_strategy(original, cls, *args, **kwargs):
    from tfdist import strategy as strategy_lib

    existing = strategy_lib.current_multi_worker()
    if existing is None or sys._getframe(2).f_code.co_name in _COPYING:
        return original(cls)
    resolver = kwargs.get("cluster_resolver") or next(
        (a for a in args if hasattr(a, "cluster_spec") and hasattr(a, "task_type")), None)
    if resolver is not None and _cluster_of(resolver) != _cluster_of(existing.extended):
        raise strategy_lib.StrategyError(
            f"This process already has a MultiWorkerMirroredStrategy for {_cluster_of(existing.extended)} "
            f"({state.origin_of_current()}); received a cluster resolver for {_cluster_of(resolver)}. "
            "TensorFlow allows one multi-worker strategy per process: build it once, for one cluster.")
    return existing


@one_multi_worker.replaces(_Strategy, "__init__", ("self", "cluster_resolver", "communication_options"))
def _init_strategy(original, self, *args, **kwargs):
    if getattr(self, "_tfdist_ready", False):
        return  # the process's existing strategy, returned by _new_strategy
    global _building
    cluster_lib.check_tf_config_unchanged()  # a script's own TF_CONFIG under tfdist run: stop, saying why
    _mark_if_multi_worker("joining")  # the constructor waits for every peer
    building, _building = _building, True  # this strategy is the one; the runtime hook builds none
    try:
        original(self, *args, **kwargs)
    except tf.errors.UnknownError as err:
        if _SERVER_NOT_STARTED in str(err):
            _mark_if_multi_worker("port-clash")  # for the launcher: a retry on fresh ports, not a failed script
        raise
    finally:
        _building = building
    self._tfdist_ready = True
    if self.extended._num_workers > 1:
        _mark_if_multi_worker("joined")
        from tfdist import strategy as strategy_lib

        strategy_lib.adopt(self, f"tf.distribute.MultiWorkerMirroredStrategy() at {startup.user_frame(sys._getframe(2))}")


# A worker's own MirroredStrategy takes its collective group keys past this many per worker index: the job's strategy
# (built before TensorFlow's first op) makes the cluster's task 0 resolve every collective group, local ones too, so
# two workers' local groups on one key met as one ("joining a group that is already full (group_key=1)").
_WORKER_KEY_SPAN = 1_000_000


@mirrored_warning.replaces(tf.distribute.MirroredStrategy, "__init__", ("self", "devices", "cross_device_ops"))
def _init_mirrored(original, self, devices=None, cross_device_ops=None):
    try:
        cluster = cluster_lib.cluster_from_env()
    except cluster_lib.ClusterConfigError:
        cluster = cluster_lib.ClusterInfo()
    if cluster.is_multi_worker:
        warnings.warn(
            f"This process is worker {cluster.worker_index} of {cluster.num_workers} ({cluster.source}), but "
            "MirroredStrategy spans this worker's own devices only: each worker trains its own copy of the "
            "model, and worker 0 resolves every copy's collectives, so it must be the last to exit. To train one "
            "model on every worker, use tfdist.scope() / tfdist.get_strategy() (or "
            "tf.distribute.MultiWorkerMirroredStrategy()).", ClusterWarning, stacklevel=3)
        # TensorFlow's MirroredExtended reads the strategy's _collective_key_base (its tests bump it per strategy)
        self._collective_key_base = type(self)._collective_key_base + (cluster.worker_index + 1) * _WORKER_KEY_SPAN
    original(self, devices, cross_device_ops)


def _mark_if_multi_worker(stage: str) -> None:
    """Tells ``tfdist run``'s watchdog about a cluster it started (not about a local strategy)."""
    try:
        if cluster_lib.cluster_from_env().is_multi_worker:
            cluster_lib.mark_stage(stage)
    except cluster_lib.ClusterConfigError:
        pass


def _cluster_of(source) -> tuple:
    """(cluster as a sorted tuple, task type, task id) of a cluster resolver or a strategy's ``extended``."""
    if callable(getattr(source, "cluster_spec", None)):
        spec, task_type, task_id = source.cluster_spec(), source.task_type, source.task_id
    else:
        spec, task_type, task_id = source._cluster_spec, source._task_type, source._task_id
    jobs = multi_worker_util.normalize_cluster_spec(spec).as_dict() if spec else {}
    return tuple(sorted((job, tuple(tasks)) for job, tasks in jobs.items())), task_type, task_id

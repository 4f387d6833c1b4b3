"""Each training step's times, taken inside the step itself and kept in a ring per process.

A multi-worker step waits for its slowest worker, so its wall time says nothing about who was
slow. Here the step's graph reads the clock (``tf.timestamp``, wall time in seconds) where a
worker's own work ends and its waiting begins, and writes one row per step into a ring of
``RING_STEPS`` rows kept in a variable of this process (not the strategy's: it is never
synchronised). Columns (``COLUMNS``), each a time in seconds or NaN where the step did not
pass that point:

* ``input_start``, ``input_end``: this worker asking its own input pipeline for the step's
  batch, and getting it (``tfdist.tf_fixes``: around tf.distribute's per-worker ``get_next``;
  a worker whose pipeline is slow waits here);
* ``data``: the batch of every worker ready (tf.distribute agrees on "has data" across workers
  first: a worker waits there for a slower one's input) and the replica's step starting;
* ``first_ready``: the first gradient bucket ready (the backward pass has begun);
* ``grads``: every gradient ready (forward and backward done);
* ``reduced``: every bucket all-reduced;
* per bucket ``b``, in steps traced while a timeline is asked for (``per_bucket``): ``ready_b`` and
  ``reduced_b``;
* ``step``: the step's number in this process (from 0);
* ``plan``: which bucket plan the step ran, an index into ``plans()`` (each bucket's bytes, in
  launch order); NaN without per-bucket times.

A step that ``tfdist.keras_fixes.gradient_buckets`` all-reduces (Keras' ``fit``, a custom loop
that calls ``apply_gradients``) writes its row in one write; in ``fit``, the input times of its
batch's ``get_next`` reach it through a variable (the step may be traced in another graph). Under several local replicas only the
first one's times are kept. The cost is a few clock reads and one small write per step
(``benchmarks/timeline.py``).
"""

from __future__ import annotations

import threading

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import ops
from tensorflow.python.ops import control_flow_util
from tensorflow.python.ops import resource_variable_ops  # private: a variable no strategy scope intercepts

RING_STEPS = 256
MAX_BUCKETS = 16  # buckets past it are folded into the last one's columns
COLUMNS = ("step", "plan", "input_start", "input_end", "data", "first_ready", "grads", "reduced") + tuple(
    f"{kind}_{b}" for b in range(MAX_BUCKETS) for kind in ("ready", "reduced"))
INDEX = {name: i for i, name in enumerate(COLUMNS)}

_lock = threading.Lock()
_ring: tf.Variable | None = None      # [RING_STEPS, len(COLUMNS)] float64
_counter: tf.Variable | None = None   # steps written so far (int64)
_anchor: tf.Variable | None = None    # read by every clock read (see ``_now_after``)
_latest_input: tf.Variable | None = None  # [start, end] of the latest batch's get_next
_plans: list[list[int]] = []          # each traced step's bucket bytes in launch order; a row's "plan" indexes it
per_bucket = False                    # read the clock around each bucket too (a timeline: ``tfdist.timeline`` sets it)
_local = threading.local()            # the step being traced in this thread (a replica's)


def _variables() -> tuple[tf.Variable, tf.Variable, tf.Variable, tf.Variable]:
    """The ring, its counter, the clock's anchor (0.0, never written) and the latest batch's input times, made once,
    eagerly, outside any strategy."""
    global _ring, _counter, _anchor, _latest_input
    with _lock:
        if _ring is None:
            with tf.init_scope():
                _ring = resource_variable_ops.ResourceVariable(
                    tf.fill([RING_STEPS, len(COLUMNS)], tf.constant(np.nan, tf.float64)), trainable=False,
                    name="tfdist_step_clock")
                _counter = resource_variable_ops.ResourceVariable(
                    tf.constant(0, tf.int64), trainable=False, name="tfdist_step_clock_counter")
                _anchor = resource_variable_ops.ResourceVariable(
                    tf.constant(0.0, tf.float64), trainable=False, name="tfdist_step_clock_anchor")
                _latest_input = resource_variable_ops.ResourceVariable(
                    tf.constant([np.nan, np.nan], tf.float64), trainable=False, name="tfdist_step_clock_input")
        return _ring, _counter, _anchor, _latest_input


def _now_after(tensor=None) -> tf.Tensor:
    """The clock, read once ``tensor`` (a number or bool tensor, or None: now) exists.

    A control dependency is not enough: Grappler drops those of a ``Timestamp``, and TensorFlow runs
    every stateful op that uses no resource (a ``Timestamp`` among them) in program order, so one
    clock read would wait for another. Here the clock is read in a ``tf.cond`` whose predicate reads
    one element of ``tensor`` (the read waits for it), and whose branch reads a variable
    (``_anchor``: an op that uses a resource is ordered only with that resource's writes, and it
    has none). Callers pass the tensor that comes last of those they wait for: one element read.
    """
    anchor = _variables()[2]
    predicate = tf.constant(False) if tensor is None else \
        tf.math.is_nan(tf.reduce_sum(tf.cast(tf.reshape(tensor, [-1])[:1], tf.float64)))

    def read() -> tf.Tensor:
        return tf.timestamp() + anchor.read_value()

    return tf.cond(predicate, read, read)


@tf.autograph.experimental.do_not_convert  # tfdist's own graph code: AutoGraph cannot convert it
def input_times(get_next):
    """``get_next()``'s result, the clock read around it (in a traced step only); the next row written takes them."""
    if not _traced_here():
        return get_next()
    start = _now_after()
    with tf.control_dependencies([start]):
        result = get_next()
    first = tf.nest.flatten(result)[0]
    end = _now_after(first.has_value() if hasattr(first, "has_value") else _number(result))
    # Through a variable, not a tensor: Keras' step may be another function, or a cond's branch, which cannot read
    # this graph's tensors. Both uses of the variable run in program order: this batch's, then its step's.
    _variables()[3].assign(tf.stack([start, end]))
    return result


class _Step:
    """The times of the step a replica traces, collected until its row is written."""

    def __init__(self, data: tf.Tensor | None):
        self.times: dict[str, tf.Tensor] = {} if data is None else {"data": data}


@tf.autograph.experimental.do_not_convert  # tfdist's own graph code: AutoGraph cannot convert it
def step_starts(data) -> None:
    """Notes, while tracing a replica's step, that its batch ``data`` is ready (the step's start)."""
    if _traced_here() and _first_local_replica():
        _local.step = _Step(_now_after(_number(data)))


def step_ends() -> None:
    """Drops what ``step_starts`` noted, when the step traced wrote no row (a test or predict step)."""
    _local.step = None


@tf.autograph.experimental.do_not_convert  # tfdist's own graph code: AutoGraph cannot convert it
def buckets_timed(gradients: list, reduce_buckets) -> list:
    """Runs ``reduce_buckets(on_ready, on_reduced)`` and writes the step's row (in a traced step of the first local
    replica only; else just runs it). ``on_ready(b, tensors)`` / ``on_reduced(b, tensors)`` return ``tensors``
    once the clock was read after them; the bytes of bucket ``b`` come with ``on_ready``'s ``nbytes``."""
    if not _traced_here() or not _first_local_replica():
        return reduce_buckets(lambda b, tensors, nbytes=0: tensors, lambda b, tensors: tensors)
    step = getattr(_local, "step", None) or _Step(None)
    _local.step = None
    sizes: list[int] = []

    def on_ready(b: int, tensors: list, nbytes: int = 0) -> list:
        b = min(b, MAX_BUCKETS - 1)
        if b == len(sizes):
            sizes.append(0)
        sizes[b] += nbytes
        now = _now_after(_number(tensors))  # a bucket's first gradient: its first variable's, the last computed
        step.times.setdefault("first_ready", now)
        step.times.setdefault(f"ready_{b}", now)
        return tensors

    def on_reduced(b: int, tensors: list) -> list:
        step.times[f"reduced_{min(b, MAX_BUCKETS - 1)}"] = _now_after(_number(tensors))
        return tensors

    if not per_bucket:  # the straggler report's reads only: all gradients ready, all reduced
        reduced = reduce_buckets(lambda b, tensors, nbytes=0: tensors, lambda b, tensors: tensors)
        # The first variable's gradient comes last in the backward pass; the last bucket's all-reduce ends last.
        step.times["grads"], step.times["reduced"] = _now_after(_number(gradients)), _now_after(_number(reduced[::-1]))
        _write(step)
        return reduced
    reduced = reduce_buckets(on_ready, on_reduced)
    for first, name in (("ready_", "grads"), ("reduced_", "reduced")):  # every bucket's latest: no more clock reads
        times = [t for key, t in step.times.items() if key.startswith(first)]
        if times:
            step.times[name] = tf.reduce_max(tf.stack(times))
    if sizes not in _plans:
        _plans.append(sizes)
    step.times["plan"] = tf.constant(float(_plans.index(sizes)), tf.float64)
    _write(step)
    return reduced


def _number(tensors) -> tf.Tensor | None:
    """The first number or bool tensor of ``tensors`` (a structure), or None."""
    return next((t for t in tf.nest.flatten(tensors) if isinstance(t, tf.Tensor) and (
        t.dtype.is_floating or t.dtype.is_integer or t.dtype.is_bool)), None)


def _write(step: _Step) -> None:
    """One row, one write: the step's number and every time it took (NaN where it has none)."""
    ring, counter, _, latest_input = _variables()
    if "data" in step.times:  # a step of a fit: its batch was read by input_times (a custom loop's is its own)
        step.times["input_start"], step.times["input_end"] = tf.unstack(latest_input.read_value())
    number = counter.assign_add(1) - 1
    nan = tf.constant(np.nan, tf.float64)
    values = [tf.cast(number, tf.float64) if name == "step" else step.times.get(name, nan) for name in COLUMNS]
    ring.scatter_nd_update(tf.stack([[tf.math.floormod(number, RING_STEPS), i] for i in range(len(COLUMNS))]),
                           tf.stack(values))


def _traced_here() -> bool:
    """Whether a graph is being traced that can read the clock (XLA compiles no ``Timestamp``: a ``jit_compile`` step
    goes untimed)."""
    return not tf.executing_eagerly() and not control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph())


def _first_local_replica() -> bool:
    """Whether the replica being traced is this process's first (or the only one)."""
    context = tf.distribute.get_replica_context()
    if context is None:
        return True
    try:
        devices = context.strategy.extended.worker_devices
    except (AttributeError, RuntimeError):  # the default strategy has none: one replica
        return True
    return len(devices) <= 1 or tf.nest.flatten(context.devices)[0] == devices[0]


def count() -> int:
    """Steps written so far in this process."""
    return 0 if _counter is None else int(_counter.numpy())


def rows(since: int = 0) -> np.ndarray:
    """This process's rows of steps numbered ``since`` and later that the ring still holds, oldest first."""
    if _ring is None:
        return np.zeros((0, len(COLUMNS)))
    written = count()
    table = _ring.numpy()
    if written > RING_STEPS:
        start = written % RING_STEPS
        table = np.concatenate([table[start:], table[:start]])
    else:
        table = table[:written]
    return table[table[:, INDEX["step"]] >= since]


def plans() -> list[list[int]]:
    """Every bucket plan a step was traced with (each bucket's bytes, in launch order): a row's ``plan`` indexes it."""
    return [list(plan) for plan in _plans]

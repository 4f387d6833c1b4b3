"""Keras' gradient all-reduce, one bucket at a time, so it overlaps the backward pass (``tfdist.buckets``).

Keras 3 all-reduces every gradient in one pack (``TFOptimizer._all_reduce_sum_gradients``
-> ``ReplicaContext.all_reduce``); the pack needs every gradient, so communication waits
for the whole backward pass. Here the same call is made once per bucket of
``tfdist.buckets.plan``, last layers first: each bucket's collective depends only on its
own gradients and runs while the backward pass goes on (TensorFlow orders the collectives
among themselves, identically on every worker). Any Keras optimizer under any strategy
with more than one replica, in ``fit`` and in custom loops that call ``apply_gradients``.

What read every gradient before the all-reduce moves after it, so the buckets can start
early: a ``LossScaleOptimizer``'s finite check (``_reduce_before_the_finite_check``) and
clipping (``_clip_after_the_all_reduce``, which also makes clipping act on the summed
gradient, as on one device).

A bucket holds one dtype (an all-reduce concatenates its tensors); sparse gradients travel
dense (``_dense``). Gradients reduced before a check or clipping are marked on every
optimizer that applies them (``_reduced``: a ``MultiOptimizer``'s inner ones too), so none
is summed twice.
"""

from __future__ import annotations

import contextlib

import tensorflow as tf
from keras.src.backend.tensorflow.optimizer import TFOptimizer
from keras.src.optimizers.base_optimizer import BaseOptimizer
from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer
from keras.src.optimizers.multi_optimizer import MultiOptimizer

from tfdist import buckets, patching, process_group, step_clock
from tfdist import compression as compression_lib
from tfdist.keras_fixes import batch_shares
from tfdist.patching import Patch

patch = Patch(
    "gradient_buckets", "tfdist UPSTREAM.md: gradient all-reduce never overlaps the backward pass",
    without="gradients are all-reduced in one pack after the whole backward pass (no overlap).")


@patch.replaces(TFOptimizer, "_all_reduce_sum_gradients", ("self", "grads_and_vars"))
def _all_reduce_in_buckets(original, self, grads_and_vars):
    """The summed gradients, all-reduced bucket by bucket (one dtype per bucket); Keras' own path with one replica."""
    context = tf.distribute.get_replica_context()
    grads_and_vars = list(grads_and_vars)
    if already_reduced(self):
        return grads_and_vars
    present = [i for i, (g, _) in enumerate(grads_and_vars) if g is not None]
    if context is None or context.num_replicas_in_sync <= 1 or not present:
        return original(self, grads_and_vars)
    strategy = tf.distribute.get_strategy()
    if process_group.is_multi_worker(strategy):
        buckets.check_agreement(process_group.for_strategy(strategy))
    gradients = [_dense(grads_and_vars[i][0]) for i in present]
    result = list(grads_and_vars)
    plan = buckets.plan_tensors(gradients)
    count = batch_shares.count_to_reduce()  # this replica's examples, when the sums weigh by them (batch_shares)
    carrier = next((b for b, bucket in enumerate(plan) if gradients[bucket[0]].dtype in (tf.float32, tf.float64)),
                   None) if count is not None else None
    total = []

    def reduce_buckets(on_ready, on_reduced):
        summed = []
        for b, bucket in enumerate(plan):
            tensors = on_ready(b, [gradients[i] for i in bucket], sum(buckets.nbytes(gradients[i]) for i in bucket))
            extra = [tf.cast(count, tensors[0].dtype)] if b == carrier else []  # one float more, no collective more
            reduced = context.all_reduce(tf.distribute.ReduceOp.SUM, tensors + extra)
            total.extend(reduced[len(tensors):])
            reduced = on_reduced(b, reduced[:len(tensors)])
            for i, gradient in zip(bucket, reduced):
                result[present[i]] = (gradient, grads_and_vars[present[i]][1])
            summed += reduced
        return summed

    step_clock.buckets_timed(gradients, reduce_buckets)  # the step's times (tfdist.step_clock)
    if count is not None:
        if not total:  # no float32 or float64 bucket to ride in
            total.append(context.all_reduce(tf.distribute.ReduceOp.SUM, tf.cast(count, tf.float32)))
        for i in present:
            gradient, variable = result[i]
            result[i] = (tf.math.divide_no_nan(gradient, tf.cast(total[0], gradient.dtype)), variable)
    return result


def _dense(gradient):
    """A sparse gradient (``tf.IndexedSlices``, an ``Embedding``'s) as a dense tensor of its variable's shape.

    TensorFlow all-reduces IndexedSlices by all-gathering their rows, a collective whose shape
    is the step's row count. Inside one function call that runs several steps
    (``steps_per_execution``, a ``tf.range`` loop) a step with fewer rows (the last, partial
    batch) meets the shape the first step recorded for that collective and fails ("Shape
    mismatch in the collective instance"). Dense, the shape is the variable's on every step,
    and the gradient joins a bucket like any other (Horovod's ``sparse_as_dense``). The sum
    is the one device's (rows not in the batch add zeros); Keras 3's Adam on one device squares
    a batch's repeated rows one by one, so there it can differ slightly (docs/performance.md).
    """
    return tf.convert_to_tensor(gradient) if isinstance(gradient, tf.IndexedSlices) else gradient


@patch.replaces(LossScaleOptimizer, "_tf_apply", ("self", "grads", "trainable_variables"))
def _reduce_before_the_finite_check(original, self, grads, trainable_variables=None):
    """LossScaleOptimizer: all-reduce the scaled gradients (in buckets) first, then check and apply the sums.

    Keras checks every local gradient for inf/nan before the inner optimizer all-reduces, so
    the all-reduce would wait for the whole backward pass. Reduced first, the check reads the
    sums, identical on every replica (an overflow anywhere makes the sum inf or nan, so every
    replica skips the step together), and the inner optimizer applies them without reducing
    again. Dividing a sum by the loss scale (a power of 2) equals summing the divided
    gradients. Keras' order stays for accumulation (each micro-batch is checked on its own),
    under ``tfdist.horovod`` (its optimizer reduces in its own place) and with bucketing off.
    """
    inner = self.inner_optimizer
    context = tf.distribute.get_replica_context()
    if (context is None or context.num_replicas_in_sync <= 1
            or any(o.gradient_accumulation_steps for o in _applying(inner))
            or getattr(inner, "_tfdist_reduction", None) is not None or buckets.bucket_sizes()[0] == 0):
        return original(self, grads, trainable_variables)
    variables = trainable_variables or self._trainable_variables
    # A lossy wire (fp16) carries the gradients unscaled, as after Keras' own unscaling: scaled ones
    # overflow float16 (65504) where one device's float32 would not, and skip steps it would not.
    lossy = getattr(inner, "compression", None) not in (None, compression_lib.Compression.none)
    scale = self.dynamic_scale if lossy else None
    grads = [g if g is None or scale is None else g / tf.cast(scale, g.dtype) for g in grads]
    reduced = [g for g, _ in inner._all_reduce_sum_gradients(list(zip(grads, variables)))]
    reduced = [g if g is None or scale is None else g * tf.cast(scale, g.dtype) for g in reduced]
    with _reduced(inner):
        return original(self, reduced, trainable_variables)


@patch.replaces(BaseOptimizer, "_clip_gradients", ("self", "grads"))
def _clip_after_the_all_reduce(original, self, grads):
    """Under several replicas, Keras' clipping before the all-reduce waits for after it (``_reduce_then_clip``).

    Keras 3 clips each replica's share of the gradient and then sums the shares: a norm or
    value clipped per replica is not the clipped gradient one device computes, and
    ``global_clipnorm`` reads every gradient before any all-reduce can start. tf.keras 2
    clipped the summed gradient; so does tfdist.
    """
    return list(grads) if _defers_clipping(self) else original(self, grads)


@patch.replaces(TFOptimizer, "_backend_update_step", ("self", "grads", "trainable_variables", "learning_rate"))
def _reduce_then_clip(original, self, grads, trainable_variables, learning_rate):
    """With clipping deferred: all-reduce (in buckets), clip the sums, then Keras' update without reducing again."""
    if not _defers_clipping(self):
        return original(self, grads, trainable_variables, learning_rate)
    reduced = [g for g, _ in self._all_reduce_sum_gradients(list(zip(grads, trainable_variables)))]
    clipped = patching.original_of(BaseOptimizer._clip_gradients)(self, reduced)
    with _reduced(self):
        return original(self, clipped, trainable_variables, learning_rate)


def _defers_clipping(optimizer) -> bool:
    """Clipping is configured and the call is in a replica context of several replicas."""
    context = tf.distribute.get_replica_context()
    clips = any(value and value > 0 for value in (optimizer.clipnorm, optimizer.global_clipnorm, optimizer.clipvalue))
    return clips and context is not None and context.num_replicas_in_sync > 1


def already_reduced(optimizer) -> bool:
    """Whether the gradients reaching ``optimizer`` now, in this replica, are sums already (reduced before a check or
    clipping). Outside any replica context (a merge_call's function): whether any replica's are."""
    marks = getattr(optimizer, "_tfdist_reduced_marks", None)
    if not marks:
        return False
    replica = _replica_key()
    # a mark made where the replica was not known (None) holds for every replica, as before
    return any(marks.values()) if replica is None else marks.get(replica, 0) > 0 or marks.get(None, 0) > 0


@contextlib.contextmanager
def _reduced(optimizer):
    """Marks the gradients ``optimizer`` is about to apply in this replica as all-reduced (calls may nest: a count).

    The mark goes on every optimizer the gradients reach: a ``MultiOptimizer`` hands them to
    its inner optimizers, whose own all-reduce would otherwise sum the sums again. It is this
    replica's (by its index in the group): the replicas of a MirroredStrategy trace in turn in
    threads of their own and share the optimizer, and Keras' update holds replica 0 in a
    merge_call, its mark on, while replica 1 traces its step. Where the gradients travelled
    without a merge_call (PowerSGD's collectives), replica 1 had not yet reduced its own; a mark
    shared by all replicas told it they were sums: it launched no collective and replica 0's
    waited for it forever. A LossScaleOptimizer's update runs each replica again in new
    threads (``call_for_each_replica``): the same index reads the same mark.
    """
    marked = _applying(optimizer)
    replica = _replica_key()
    for each in marked:
        marks = getattr(each, "_tfdist_reduced_marks", None)
        if marks is None:  # past Keras' attribute tracking: a plain dict, read and written in place
            marks = {}
            object.__setattr__(each, "_tfdist_reduced_marks", marks)
        marks[replica] = marks.get(replica, 0) + 1
    try:
        yield
    finally:
        for each in marked:
            marks = each._tfdist_reduced_marks
            marks[replica] -= 1
            if not marks[replica]:
                del marks[replica]


def _replica_key() -> int | None:
    """This replica's index in its group, or None outside a replica context (or where tracing does not know it)."""
    if tf.distribute.in_cross_replica_context():
        return None
    context = tf.distribute.get_replica_context()
    if context is None:
        return None
    replica = tf.get_static_value(getattr(context, "_replica_id_in_sync_group", None))
    if replica is None:
        replica = tf.get_static_value(context.replica_id_in_sync_group)
    return None if replica is None else int(replica)


def _applying(optimizer) -> list:
    """``optimizer`` and the optimizers it hands its gradients to (a ``MultiOptimizer``'s inner ones)."""
    return [optimizer, *optimizer.optimizers] if isinstance(optimizer, MultiOptimizer) else [optimizer]

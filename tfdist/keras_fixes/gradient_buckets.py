"""Keras' gradient all-reduce, one bucket at a time, so it overlaps the backward pass (``tfdist.buckets``).

Keras 3 all-reduces every gradient in one pack (``TFOptimizer._all_reduce_sum_gradients``
-> ``ReplicaContext.all_reduce``); the pack needs every gradient, so communication waits
for the whole backward pass. Here the same call is made once per bucket of
``tfdist.buckets.plan``, last layers first: each bucket's collective depends only on its
own gradients and runs while the backward pass goes on (TensorFlow orders the collectives
among themselves, identically on every worker). Any Keras optimizer under any strategy
with more than one replica, in ``fit`` and in custom loops that call ``apply_gradients``.
"""

from __future__ import annotations

import tensorflow as tf
from keras.src.backend.tensorflow.optimizer import TFOptimizer

from tfdist import buckets, process_group
from tfdist.patching import Patch

patch = Patch(
    "gradient_buckets", "tfdist UPSTREAM.md: gradient all-reduce never overlaps the backward pass",
    without="gradients are all-reduced in one pack after the whole backward pass (no overlap).")


@patch.replaces(TFOptimizer, "_all_reduce_sum_gradients", ("self", "grads_and_vars"))
def _all_reduce_in_buckets(original, self, grads_and_vars):
    """The summed gradients, all-reduced bucket by bucket; Keras' own path with one replica or one bucket."""
    context = tf.distribute.get_replica_context()
    grads_and_vars = list(grads_and_vars)
    present = [i for i, (g, _) in enumerate(grads_and_vars) if g is not None]
    if context is None or context.num_replicas_in_sync <= 1 or not present:
        return original(self, grads_and_vars)
    strategy = tf.distribute.get_strategy()
    if process_group.is_multi_worker(strategy):
        buckets.check_agreement(process_group.for_strategy(strategy))
    plan = buckets.plan([buckets.nbytes(grads_and_vars[i][0]) for i in present])
    if len(plan) <= 1:
        return original(self, grads_and_vars)
    result = list(grads_and_vars)
    for bucket in plan:
        indices = [present[i] for i in bucket]
        reduced = context.all_reduce(tf.distribute.ReduceOp.SUM, [grads_and_vars[i][0] for i in indices])
        for i, gradient in zip(indices, reduced):
            result[i] = (gradient, grads_and_vars[i][1])
    return result

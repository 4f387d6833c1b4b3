"""Keras' synchronized BatchNormalization under MultiWorkerMirroredStrategy: its all-reduces in a lane of their own.

Keras 3.15 (``keras/src/backend/tensorflow/nn.py``, ``_compute_moments_sync``; its TODO
b/163099951) all-reduces a batch's sum, sum of squares and count with three
``ReplicaContext.all_reduce`` calls. Under MultiWorkerMirroredStrategy they share one
ordering token with the gradient all-reduces (TensorFlow's ``CollectiveReplicaLauncher``),
which then run in program order: the gradient buckets, created after the backward pass,
all wait for the layer's backward all-reduce, so the last layers' gradients no longer
overlap the backward pass. With one replica per worker, tfdist sends the three as one
all-reduce in a ``ProcessGroup`` lane (a group key and ordering token of its own), with
the same gradient (the upstream gradient all-reduced). Several replicas per worker, or
one process, keep Keras' path.
"""

from __future__ import annotations

import tensorflow as tf
from keras.src.backend.tensorflow import nn as keras_nn

from tfdist import process_group
from tfdist.patching import Patch

patch = Patch(
    "sync_batch_norm", "Keras' synchronized BatchNormalization shares the gradients' collective order (b/163099951)",
    without="BatchNormalization(synchronized=True) under several workers makes every gradient all-reduce wait for "
            "its backward all-reduce (no overlap).")


@patch.replaces(keras_nn, "_compute_moments_sync", ("x", "axes", "keepdims"))
def _moments_in_a_lane(original, x, axes, keepdims):
    """Keras' statistics over every replica, from one all-reduce in the synchronized-BatchNormalization lane."""
    strategy = tf.distribute.get_strategy()
    if (tf.distribute.get_replica_context() is None or not process_group.is_multi_worker(strategy)
            or strategy.num_replicas_in_sync != process_group.num_workers(strategy)):
        return original(x, axes, keepdims)
    group = process_group.for_strategy(strategy).lane(process_group.SYNC_BATCH_NORM_LANE)
    local = tf.stack([tf.reduce_sum(x, axis=axes, keepdims=True),
                      tf.reduce_sum(tf.square(x), axis=axes, keepdims=True),
                      tf.reduce_sum(tf.ones_like(x), axis=axes, keepdims=True)])
    y_sum, y_squared_sum, count_sum = tf.unstack(group.differentiable_sum(local))
    mean = tf.math.divide_no_nan(y_sum, count_sum)  # from here on, Keras' own arithmetic
    variance = tf.maximum(tf.math.divide_no_nan(y_squared_sum, count_sum) - tf.square(mean), 0.0)
    if not keepdims:
        mean, variance = tf.squeeze(mean, axes), tf.squeeze(variance, axes)
    return mean, variance

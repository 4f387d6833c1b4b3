"""Layers' non-trainable state (BatchNormalization's moving statistics) under a strategy: the mean over replicas.

Keras 3 creates every layer weight with ``aggregation="none"``, the moving statistics
included (``keras/src/layers/normalization/batch_normalization.py``): under MirroredStrategy
or MultiWorkerMirroredStrategy each replica updates its own copy from its own shard, and the
chief saves statistics of its shard alone. tf.keras 2 made them sync-on-read MEAN variables.

Here, at the end of every ``fit`` epoch, before any callback sees it, each floating-point
non-trainable weight of the model is set to its mean over every replica of every worker
(one fused all-reduce per epoch); between epochs each replica keeps updating its own copy,
with no collective per step. A moving average is linear, so the mean of the copies is the
moving average of the replicas' mean batch statistics, as tf.keras read it. The variables
stay plain mirrored ones: reading them needs no collective, so a chief-only
``model.save`` still works. Custom training loops call ``average_replica_state(model)``.
A mid-epoch save (``ModelCheckpoint(save_freq=N)``) holds the last epoch's mean plus the
saving worker's own updates since. Frozen layers' weights are averaged too (a no-op: equal
everywhere), at one all-reduce per epoch.
"""

from __future__ import annotations

import weakref

import keras
import tensorflow as tf
from keras.src.callbacks.callback_list import CallbackList

from tfdist.patching import Patch

patch = Patch(
    "replica_state", "tfdist UPSTREAM.md: BatchNormalization statistics are per worker in Keras 3",
    without="BatchNormalization's moving statistics differ per replica and worker, and the chief saves the "
            "statistics of its own shard only.")


def replica_state(model: keras.Model) -> list:
    """The model's weights that each replica updates on its own: non-trainable, floating point, aggregation "none"."""
    return [v for v in model.non_trainable_weights
            if v.aggregation == "none" and keras.backend.standardize_dtype(v.dtype).startswith("float")]


def average_replica_state(model: keras.Model) -> int:
    """Sets every replica's copy of ``replica_state(model)`` to the mean over all replicas and workers.

    Every worker must call it (under MultiWorkerMirroredStrategy it is one collective).
    Returns the number of variables averaged (0 with one replica).
    """
    strategy = model.distribute_strategy
    variables = replica_state(model)
    if strategy.num_replicas_in_sync <= 1 or not variables:
        return 0
    key = tuple(id(v) for v in variables)
    cached = _mean_functions.get(model)
    if cached is None or cached[0] != key:
        cached = _mean_functions[model] = (key, _mean_function(strategy, [v.value for v in variables]))
    with strategy.scope():
        mean = cached[1]()
        offset = 0
        for variable in variables:
            size = int(variable.shape.num_elements())
            variable.assign(tf.cast(tf.reshape(mean[offset:offset + size], variable.shape), variable.dtype))
            offset += size
    return len(variables)


_mean_functions: "weakref.WeakKeyDictionary[keras.Model, tuple]" = weakref.WeakKeyDictionary()


def _mean_function(strategy: tf.distribute.Strategy, variables: list) -> tf.types.experimental.PolymorphicFunction:
    """A tf.function: every variable's replica copies, flattened into one float32 vector, mean-reduced once."""
    def local_copies():
        return tf.concat([tf.reshape(tf.cast(tf.convert_to_tensor(v), tf.float32), [-1]) for v in variables], 0)

    # autograph=False: TensorFlow ops only, nothing for AutoGraph to convert (transpiling both took CPU at every model).
    return tf.function(lambda: strategy.reduce(tf.distribute.ReduceOp.MEAN, strategy.run(local_copies), axis=None),
                       autograph=False)


@patch.replaces(CallbackList, "on_epoch_end", ("self", "epoch", "logs"))
def _average_before_callbacks(original, self, epoch, logs=None):
    """At each ``fit`` epoch's end, before the callbacks (a ModelCheckpoint saves the averaged values)."""
    model = getattr(self, "model", None)
    if isinstance(model, keras.Model):
        average_replica_state(model)
    return original(self, epoch, logs)

"""Each replica's loss weighs by its share of the global batch, as one device weighs every example.

Keras 3 (as tf.keras 2, plain MirroredStrategy and Horovod) divides each replica's mean loss
by the number of replicas (``losses.loss.scale_loss_for_distribution``), so when a global
batch does not split evenly (the last batch of 49 examples in batches of 4 on 2 replicas is
split 1/0; a batch of 5 is split 3/2) the examples of the smaller share weigh more than on
one device. Here, in ``fit``'s train step under several replicas, each replica all-reduces
its example count (one scalar, issued before the forward pass, which it overlaps) and its
mean losses are multiplied by count / global count instead of 1 / replicas. The losses'
display (Keras' trackers divide the same factor out again and weigh by the batch size) and
regularization losses (identical on every replica: their shares add up to 1) keep their
one-device values; with an even split the factor is exactly Keras'.

The count is the batch size of the first input, what Keras' loss tracker weighs by; a mean
over several elements per example (a sequence loss) is exact when every example has as
many. Masked losses divide by their unmasked elements, which this count does not see: they
stay as exact as in Keras. ``TFDIST_BATCH_WEIGHTING=keras`` (read when a step is traced)
gives Keras' 1 / replicas weighting back, for comparing with old runs.

Custom loops: ``compute_average_loss`` is ``tf.nn.compute_average_loss`` without the global
batch size (the replicas add their counts up).
"""

from __future__ import annotations

import os
import threading

import tensorflow as tf
from keras.src import tree
from keras.src.backend.tensorflow import trainer as keras_tf_trainer
from keras.src.losses import loss as loss_module

from tfdist.patching import Patch

ENV = "TFDIST_BATCH_WEIGHTING"
_CHOICES = ("exact", "keras")
_share = threading.local()  # .value: this replica's count / the global count, while its train step is traced

patch = Patch(
    "batch_shares", "Keras (as tf.distribute and Horovod) weighs each replica's mean loss by 1 / replicas",
    without="a global batch that does not split evenly over the replicas weighs the examples of the smaller "
            "share more than one device does (weights drift from one device's with every partial batch).")


def weighting() -> str:
    """``TFDIST_BATCH_WEIGHTING``: "exact" (the default) or "keras".

    Raises:
        ValueError: another value.
    """
    value = os.environ.get(ENV, "exact").strip().lower() or "exact"
    if value not in _CHOICES:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: use 'exact' (each replica's loss weighs by its share of the "
                         "global batch, as one device) or 'keras' (Keras' 1 / replicas per replica).")
    return value


def global_count(local_count) -> tf.Tensor:
    """The replicas' counts added up (float32), from a replica context."""
    context = tf.distribute.get_replica_context()
    return context.all_reduce(tf.distribute.ReduceOp.SUM, tf.cast(local_count, tf.float32))


@patch.replaces(keras_tf_trainer.TensorFlowTrainer, "train_step", ("self", "data"))
def _train_step_weighed_by_shares(original, self, data):
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync <= 1 or weighting() != "exact":
        return original(self, data)
    count = tf.shape(next(t for t in tree.flatten(data[0] if isinstance(data, tuple) else data)
                          if t is not None))[0]
    _share.value = tf.cast(count, tf.float32) / global_count(count)
    try:
        return original(self, data)
    finally:
        _share.value = None


@patch.replaces(loss_module, "scale_loss_for_distribution", ("value",))
def _scale_by_share(original, value):
    share = getattr(_share, "value", None)
    if share is None:
        return original(value)
    return value * tf.cast(share, value.dtype)


@patch.replaces(loss_module, "unscale_loss_for_distribution", ("value",))
def _unscale_by_share(original, value):
    share = getattr(_share, "value", None)
    if share is None:
        return original(value)
    return tf.math.divide_no_nan(value, tf.cast(share, value.dtype))


def compute_average_loss(per_example_loss, sample_weight=None) -> tf.Tensor:
    """This replica's part of the global batch's mean loss: the weighted sum over its examples divided by the
    global batch's example count (its replicas' counts all-reduced), so every example weighs as on one device
    however the batch split. ``tf.nn.compute_average_loss`` without ``global_batch_size``; call it in
    ``strategy.run`` and add ``tf.nn.scale_regularization_loss(...)`` for regularization.

    Raises:
        ValueError: a scalar ``per_example_loss`` (it needs one value per example).
    """
    per_example_loss = tf.convert_to_tensor(per_example_loss)
    if per_example_loss.shape.rank == 0:
        raise ValueError("compute_average_loss takes one loss per example (a tensor of shape [batch, ...]); received "
                         "a scalar: compute the loss with reduction='none'.")
    if sample_weight is not None:
        per_example_loss = per_example_loss * tf.cast(sample_weight, per_example_loss.dtype)
    count = tf.shape(per_example_loss)[0]
    context = tf.distribute.get_replica_context()
    total = tf.cast(count, tf.float32) if context is None else global_count(count)
    return tf.math.divide_no_nan(tf.reduce_sum(per_example_loss), tf.cast(total, per_example_loss.dtype))

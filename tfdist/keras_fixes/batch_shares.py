"""Each replica's loss weighs by its share of the global batch, as one device weighs every example.

Keras 3 (as tf.keras 2, plain MirroredStrategy and Horovod) divides each replica's mean loss
by the number of replicas (``losses.loss.scale_loss_for_distribution``), so when a global
batch does not split evenly (the last batch of 49 examples in batches of 4 on 2 replicas is
split 1/0; a batch of 5 is split 3/2) the examples of the smaller share weigh more than on
one device. Here, in ``fit``'s train step under several replicas, each replica's mean
losses weigh count / global count instead of 1 / replicas, where count is its examples:

* by default the loss is multiplied by the count, and the count rides in the first float32
  gradient bucket's all-reduce (``gradient_buckets``), whose sums are then divided by the
  global count: one float more in a collective sent anyway;
* where a loss multiplied by the count could overflow (float16 compute or a loss scale, the
  float16 wire) or gradients are all-reduced once for several steps (gradient accumulation),
  the replicas all-reduce their counts first (one scalar collective a step, issued before the
  forward pass) and the loss is multiplied by count / global count.

Only the loss the gradients come from (the step's ``compute_loss``) weighs so: a Loss used as a
metric, or called for ``add_loss`` in the forward pass, keeps Keras' scaling. The losses' display
(Keras' trackers divide the same factor out again and weigh by the batch
size) and regularization losses (identical on every replica: their shares add up to 1) keep
their one-device values; with an even split the weights are Keras'.

The count is the batch size of the first input, what Keras' loss tracker weighs by; a mean
over several elements per example (a sequence loss) is exact when every example has as
many. Masked losses divide by their unmasked elements, which this count does not see: they
stay as exact as in Keras. ``TFDIST_BATCH_WEIGHTING=keras`` (read when a step is traced)
gives Keras' 1 / replicas weighting back, for comparing with old runs.

A ``train_step`` of the user's own that does not call ``super().train_step`` keeps Keras'
weighting (it computes its loss its own way): ``compute_average_loss`` gives it the exact one.

Custom loops: ``compute_average_loss`` is ``tf.nn.compute_average_loss`` without the global
batch size (the replicas add their counts up).

Outside any strategy (tfdist.horovod) the train step and ``compute_average_loss`` note the
process's examples (``note_examples``), which the step's Horovod gradient reduction weighs
each process's mean gradients by (``examples_to_weigh``).
"""

from __future__ import annotations

import os
import threading

import tensorflow as tf
from keras.src import tree
from keras.src.backend.tensorflow import trainer as keras_tf_trainer
from keras.src.losses import loss as loss_module
from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer
from keras.src.trainers import trainer as trainer_module
from tensorflow.python.eager import record

from tfdist import compression as compression_lib  # the module: it may be importing still (it imports Keras)
from tfdist.patching import Patch

ENV = "TFDIST_BATCH_WEIGHTING"
_CHOICES = ("exact", "keras")
_share = threading.local()  # .value: a _Share, while a train step is traced in this replica's thread
_examples = threading.local()  # .value: (graph, count) noted outside any strategy, for a tfdist.horovod reduction

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


class _Share:
    """One replica's weighing in a traced train step: ``factor`` multiplies Keras' per-replica loss scale away
    (count, or count / global count); ``count`` is set while the gradient all-reduce still has to divide the sums
    by the global count."""

    def __init__(self, factor: tf.Tensor, count: tf.Tensor | None):
        self.factor, self.count, self.reduced = factor, count, False
        self.in_loss = False  # inside the step's compute_loss: only the losses it sums weigh by the share


def note_examples(count, in_a_train_step: bool = False) -> None:
    """Outside any strategy (tfdist.horovod): this process's examples in the step being built, which the step's
    gradient reduction weighs its gradients by (``examples_to_weigh``).

    Noted in Keras' train step, or while a gradient tape records: a loss computed for validation or
    logging, outside a tape, weighs no later step (a rank-dependent note would make the ranks'
    collectives differ).
    """
    if tf.distribute.has_strategy() or not (in_a_train_step or record.could_possibly_record()):
        return
    graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
    _examples.value = (graph, tf.cast(count, tf.float32))


def examples_to_weigh() -> tf.Tensor | None:
    """The examples noted in the step being built (then forgotten), or None (none noted, or Keras' weighting):
    a tfdist.horovod reduction multiplies each process's mean gradients by them and divides the sums by the total."""
    noted = getattr(_examples, "value", None)
    _examples.value = None
    if noted is None or not _inside(noted[0]) or weighting() != "exact":
        return None
    return noted[1]


def _inside(graph) -> bool:
    """Whether the step being built is where ``graph`` was noted: eagerly for an eager note (None); else that
    graph or a function inside it (a ``cond`` branch: a loss scale's). An eager note never counts in a trace."""
    if graph is None:
        return tf.executing_eagerly()
    if tf.executing_eagerly():
        return False
    current = tf.compat.v1.get_default_graph()
    while current is not None and current is not graph:
        current = getattr(current, "outer_graph", None)
    return current is graph


@patch.replaces(keras_tf_trainer.TensorFlowTrainer, "train_step", ("self", "data"))
def _train_step_weighed_by_shares(original, self, data):
    context, exact = tf.distribute.get_replica_context(), weighting() == "exact"
    if context is None or context.num_replicas_in_sync <= 1 or not exact:
        if exact and _reduces_across_processes(self.optimizer):
            note_examples(_count_of(data), in_a_train_step=True)  # hvd.DistributedOptimizer weighs by them
        try:
            return original(self, data)
        finally:
            _examples.value = None
    count = _count_of(data)
    if _count_rides_in_a_bucket(self):
        share = _Share(count, count)
    else:
        share = _Share(count / global_count(count), None)
    _share.value = share
    try:
        outputs = original(self, data)
    finally:
        _share.value = None
    if share.count is not None and self.trainable_weights and not share.reduced:
        raise RuntimeError(
            f"tfdist weighs each replica's loss by its examples and divides the all-reduced gradients by the global "
            f"count, but no gradient of this train step was all-reduced through Keras' optimizer "
            f"({type(self.optimizer).__name__}): its gradients would be as many times too large. Set "
            f"{ENV}=keras for Keras' weighting, and report this to tfdist.")
    return outputs


def _reduces_across_processes(optimizer) -> bool:
    """Whether ``optimizer`` (or a LossScaleOptimizer's inner one) is a tfdist.horovod DistributedOptimizer."""
    inner = getattr(optimizer, "inner_optimizer", None)
    return any(getattr(o, "_tfdist_reduction", None) is not None for o in (optimizer, inner))


def _count_of(data) -> tf.Tensor:
    """The step's examples: the batch size of its first input (what Keras' loss tracker weighs by)."""
    return tf.cast(tf.shape(next(t for t in tree.flatten(data[0] if isinstance(data, tuple) else data)
                                 if t is not None))[0], tf.float32)


def _count_rides_in_a_bucket(model) -> bool:
    """Whether the loss may be multiplied by the count and the gradient sums divided after: not under float16
    compute or a loss scale (scaled further, float16 gradients overflow where one device's would not), nor with
    the float16 wire or accumulation (the sums of several steps are all-reduced at once)."""
    optimizer = model.optimizer
    if optimizer is None or isinstance(optimizer, LossScaleOptimizer) or \
            getattr(model.dtype_policy, "compute_dtype", "float32") == "float16":
        return False
    applying = [optimizer, *getattr(optimizer, "optimizers", [])]
    none = compression_lib.Compression.none
    return not any(o.gradient_accumulation_steps or getattr(o, "compression", none) is not none for o in applying)


@patch.replaces(trainer_module.Trainer, "_compute_loss", ("self", "x", "y", "y_pred", "sample_weight", "training"))
def _loss_weighed_by_share(original, self, *args, **kwargs):
    """The training loss (what the gradients come from): a Loss called elsewhere in the step (as a metric, in
    ``add_loss`` during the forward pass) keeps Keras' scaling, as its value is not divided back."""
    share = getattr(_share, "value", None)
    if share is None:
        return original(self, *args, **kwargs)
    share.in_loss = True
    try:
        return original(self, *args, **kwargs)
    finally:
        share.in_loss = False


def count_to_reduce() -> tf.Tensor | None:
    """The count to all-reduce with the gradients (then divide their sums by the global count), or None."""
    share = getattr(_share, "value", None)
    if share is None or share.count is None:
        return None
    share.reduced = True
    return share.count


@patch.replaces(loss_module, "scale_loss_for_distribution", ("value",))
def _scale_by_share(original, value):
    share = getattr(_share, "value", None)
    if share is None or not share.in_loss:
        return original(value)
    return value * tf.cast(share.factor, value.dtype)


@patch.replaces(loss_module, "unscale_loss_for_distribution", ("value",))
def _unscale_by_share(original, value):
    share = getattr(_share, "value", None)
    if share is None:
        return original(value)
    return tf.math.divide_no_nan(value, tf.cast(share.factor, value.dtype))


def compute_average_loss(per_example_loss, sample_weight=None) -> tf.Tensor:
    """This replica's part of the global batch's mean loss: the weighted sum over its examples divided by the
    global batch's example count (its replicas' counts all-reduced), so every example weighs as on one device
    however the batch split. ``tf.nn.compute_average_loss`` without ``global_batch_size``; call it in
    ``strategy.run`` and add ``tf.nn.scale_regularization_loss(...)`` for regularization. Under tfdist.horovod
    (no strategy) it is this process's mean, and, called inside the ``tf.GradientTape`` whose gradients a
    ``DistributedGradientTape`` reduces, it makes that reduction weigh each process by its examples.

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
    note_examples(count)  # a tfdist.horovod tape weighs this process's gradients by it
    context = tf.distribute.get_replica_context()
    total = tf.cast(count, tf.float32) if context is None else global_count(count)
    return tf.math.divide_no_nan(tf.reduce_sum(per_example_loss), tf.cast(total, per_example_loss.dtype))

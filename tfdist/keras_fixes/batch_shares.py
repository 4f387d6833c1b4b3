"""Every loss term weighs by its share of the global batch's divisor, as one device weighs every example.

Keras 3 (as tf.keras 2, plain MirroredStrategy and Horovod) divides each replica's mean loss by
the number of replicas (``losses.loss.scale_loss_for_distribution``), so when a global batch
does not split evenly (the last batch of 49 examples in batches of 4 on 2 replicas is split
1/0; a batch of 5 is split 3/2) the examples of the smaller share weigh more than on one
device. Here, in ``fit``'s train and test steps under several replicas, every term of the
step's loss (what its ``compute_loss`` sums) weighs by exactly what one device gives it:

* a mean (``sum_over_batch_size``, ``mean``, ``mean_with_sample_weight``) by the replica's
  divisor over the global batch's (Keras divides by the loss values, the sample weights'
  sum or the unmasked values: ``losses.loss.reduce_values``);
* a ``sum`` (or ``None``, which Keras sums through the gradient) by 1: summed over the
  replicas it is the global batch's sum; so is a loss function that returns one value for
  the batch (a mean or a sum, which cannot be told apart: as Keras, with a warning);
* an additional loss (``add_loss``, regularization) by the replica's examples over the
  global batch's (as a mean over the examples).

Where the divisor is the examples (a mean with no sample weights and no mask; a mean whose
examples hold another number of values on another replica weighs by examples too), the
replica knows its share from its own count: by default
every term is then multiplied by the global count too, the count rides in the first float32
gradient bucket's all-reduce (``gradient_buckets``; under PowerSGD in its P all-reduce,
``tfdist.optimizer``), and the sums are divided by the global count after: one float more in a
collective sent anyway. The loss tracker then needs no global count (each replica's loss over its
own count, weighed by its examples): the weighting adds no collective to such a step. Any other divisor (and the global
count, for a sum) is all-reduced where the term is computed: one small collective more for
such a term. Under float16 compute or a loss scale (a loss multiplied by the count could
overflow), the float16 wire or gradient accumulation (the sums of several steps are
all-reduced at once), and for a ``compute_loss`` of the model's own or a compiled Loss with a
``__call__`` of its own (terms that may not pass through Keras' reductions), nothing is divided
after: each term is multiplied by its share alone, and what passes no reduction weighs as in
Keras. Every choice comes from what every worker has alike (reductions, the loss's structure,
never a worker's static shapes), and the collectives are launched in the replica's own thread
(``sum_over_replicas``), so no other replica's forward pass runs in the middle of the loss.

A ``compute_loss`` of the model's own weighs what it computes through Keras' losses
(``super().compute_loss``, a Loss it calls) exactly; a tensor of its own is summed over the
replicas as Keras does (divide it by the global batch, e.g. with ``compute_average_loss``).
A Loss called in the forward pass (for ``add_loss``) keeps one device's value of the replica's
examples, then weighs as an additional loss; a Loss used as a metric logs one device's figure.
The logged loss is one device's: Keras' tracker divides each replica's figure by its count's
share again.
``TFDIST_BATCH_WEIGHTING=keras`` (read when a step is traced) gives Keras' 1 / replicas
weighting back, for comparing with old runs.

A ``train_step`` of the user's own that does not call ``super().train_step`` keeps Keras' weighting
(it computes its loss its own way): ``compute_average_loss`` gives it the exact one.

Custom loops: ``compute_average_loss`` is ``tf.nn.compute_average_loss`` without the global
batch size (the replicas add their counts up).

Outside any strategy (tfdist.horovod) the train step and ``compute_average_loss`` note the
process's examples (``note_examples``), which the step's Horovod gradient reduction weighs
each process's mean gradients by (``examples_to_weigh``); a step with a term that is no mean
over the examples (a sum, sample weights, a mask) keeps Horovod's average instead.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings

import tensorflow as tf
from keras.src import tree
from keras.src.backend.tensorflow import trainer as keras_tf_trainer
from keras.src.layers.layer import Layer
from keras.src.losses import loss as loss_module
from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer
from keras.src.trainers import trainer as trainer_module
from tensorflow.python.distribute import cross_device_ops as cross_device_ops_lib
from tensorflow.python.eager import record
from tensorflow.python.ops.losses import util as tf_losses_util

from tfdist import replica_collectives
from tfdist import compression as compression_lib  # the module: it may be importing still (it imports Keras)
from tfdist.patching import Patch

ENV = "TFDIST_BATCH_WEIGHTING"
_CHOICES = ("exact", "keras")
_MEANS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")  # the reductions Keras divides
_share = threading.local()  # .value: a _Share, while a step is traced in this replica's thread
_examples = threading.local()  # .value: (graph, count) noted outside any strategy, for a tfdist.horovod reduction

patch = Patch(
    "batch_shares", "Keras (as tf.distribute and Horovod) weighs each replica's mean loss by 1 / replicas",
    without="a global batch that does not split evenly over the replicas weighs the examples of the smaller "
            "share more than one device does (weights drift from one device's with every partial batch); a loss "
            "of another reduction weighs as Keras weighs it.")
# What sum_over_replicas launches itself (TensorFlow's own path without a merge_call).
patch.overrides(cross_device_ops_lib.CollectiveAllReduce, "_all_reduce",
                ("self", "reduce_op", "value", "replica_id", "options"))


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
    return sum_over_replicas(tf.cast(local_count, tf.float32))


def sum_over_replicas(value: tf.Tensor) -> tf.Tensor:
    """``value`` summed over the replicas, launched in this replica's own thread.

    ``ReplicaContext.all_reduce`` is a merge_call on CPUs: this replica's thread waits while the next one traces
    its part of the step, and Keras keeps each forward pass's ``add_loss`` losses (and layers keep what they
    stash) on the layers every replica shares, so a replica would read the other's afterwards. Launched here,
    as tf.distribute itself launches collectives for XLA on GPUs (``_replica_ctx_all_reduce``), no other thread
    runs. Eagerly (replicas run one after another) and without TensorFlow's collectives: ``all_reduce``.
    """
    context = tf.distribute.get_replica_context()
    launch = replica_collectives.launcher(value)
    if launch is None:
        return context.all_reduce(tf.distribute.ReduceOp.SUM, value)
    ops, options = launch
    return ops._all_reduce(tf.distribute.ReduceOp.SUM, value, context._replica_id, options)


class _Share:
    """One replica's weighing of the losses of a traced step.

    In the step's compute_loss (``stage`` "loss") each term is multiplied by its share (its divisor here over
    the global batch's, or 1 for a sum) times ``F``: the global example count when ``divided_after`` (the
    gradient all-reduce divides the sums by it; the test step's logged loss is divided by it too), else 1. A
    Keras Loss reduced in the forward pass ("forward") keeps one device's value of the replica's examples (an
    ``add_loss`` of it then weighs as one); one reduced after compute_loss ("metrics": a Loss used as a metric,
    which averages every replica's update alike) weighs by its share times the replicas. ``observe``
    (tfdist.horovod, no strategy): the terms keep Keras' values, and a term that is no mean over the examples
    turns the weighing off.
    """

    def __init__(self, count: tf.Tensor, divided_after: bool, observe: bool = False):
        self.count, self.divided_after, self.observe = count, divided_after, observe
        self.stage = "forward"  # then "loss" inside the step's compute_loss, then "metrics"
        self.additional = None  # (model, its losses as this replica's forward pass left them), in compute_loss
        self.unweighed = False  # inside reduce_values: Keras' own 1 / replicas stays out, the loss weighs after
        self.mask = None  # the mask of the loss being reduced (reduce_weighted_values)
        self.reduced = False  # the count rode in a gradient all-reduce
        self.per_example_only = True  # every term was a mean over the examples (tfdist.horovod weighs only then)
        self._total = None  # the global example count, once all-reduced

    def total(self) -> tf.Tensor:
        if self._total is None:
            self._total = global_count(self.count)
        return self._total

    def per_example(self, times_total: bool) -> tf.Tensor:
        """A mean over this replica's examples: count / global count (times the global count)."""
        return self.count if times_total else self.count / self.total()

    def summed(self, times_total: bool) -> tf.Tensor:
        """A sum over this replica's examples: 1 (times the global count)."""
        return self.total() if times_total else tf.ones(())

    def divided_by(self, divisor, times_total: bool) -> tf.Tensor:
        """A sum divided by ``divisor`` here: divisor / the replicas' divisors added up (times the global count)."""
        both = sum_over_replicas(tf.stack([tf.cast(divisor, tf.float32), self.count]))
        if self._total is None:
            self._total = both[1]
        share = tf.math.divide_no_nan(tf.cast(divisor, tf.float32), both[0])
        return share * self._total if times_total else share

    def per_example_loss(self, values, sample_weight, reduction) -> bool:
        """Whether a loss Keras reduced from ``values`` is a mean over the examples (no sample weights' sum, no
        mask). Decided from what every worker has alike (the reduction, the loss's structure), never from a
        worker's own static shapes: each decision chooses collectives, which must be the same on every worker. A
        mean whose examples hold another number of values on another replica (padded apart) weighs by examples."""
        return values.shape.rank != 0 and reduction in _MEANS and self.mask is None and \
            (reduction != "mean_with_sample_weight" or sample_weight is None)

    def of_loss(self, values, sample_weight, reduction, times_total: bool) -> tf.Tensor:
        """The factor of a loss Keras reduced from ``values`` (``losses.loss.reduce_values``' arguments)."""
        if self.per_example_loss(values, sample_weight, reduction):
            return self.per_example(times_total)
        if values.shape.rank == 0:
            _warn_scalar_loss()
        if reduction not in _MEANS or values.shape.rank == 0:  # a sum (None: summed by the gradient), a scalar
            return self.summed(times_total)
        if self.mask is not None and reduction != "mean_with_sample_weight":  # Keras divides by unmasked values
            return self.divided_by(tf.reduce_sum(tf.cast(self.mask, tf.float32)), times_total)
        return self.divided_by(tf.reduce_sum(tf.cast(sample_weight, tf.float32)), times_total)


_warned_scalar = [False]


def _warn_scalar_loss() -> None:
    """A loss function that returns one value for the batch: a mean or a sum, which tfdist cannot tell."""
    if not _warned_scalar[0]:
        _warned_scalar[0] = True
        warnings.warn(
            "A loss returned one value for the whole batch under several replicas: tfdist cannot tell a mean from "
            "a sum, so it sums the replicas' values as Keras does (a mean then weighs replicas times its share). "
            "Return one loss per example (Keras reduces it) for one device's weighting.", UserWarning, stacklevel=2)


@contextlib.contextmanager
def _weighing(share: _Share):
    _share.value = share
    try:
        yield share
    finally:
        _share.value = None


def _current_share() -> _Share | None:
    return getattr(_share, "value", None)


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
    """The examples noted in the step being built (then forgotten), or None (none noted, Keras' weighting, or a
    loss term that is no mean over the examples): a tfdist.horovod reduction multiplies each process's mean
    gradients by them and divides the sums by the total."""
    noted = getattr(_examples, "value", None)
    _examples.value = None
    share = _current_share()
    if noted is None or not _inside(noted[0]) or weighting() != "exact" or \
            (share is not None and not share.per_example_only):
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


def _several_replicas() -> bool:
    context = tf.distribute.get_replica_context()
    return context is not None and context.num_replicas_in_sync > 1


@patch.replaces(keras_tf_trainer.TensorFlowTrainer, "train_step", ("self", "data"))
def _train_step_weighed_by_shares(original, self, data):
    if weighting() != "exact":
        return original(self, data)
    if not _several_replicas():
        if not _reduces_across_processes(self.optimizer):
            return original(self, data)
        note_examples(_count_of(data), in_a_train_step=True)  # hvd.DistributedOptimizer weighs by them
        try:
            with _weighing(_Share(_count_of(data), divided_after=False, observe=True)):
                return original(self, data)
        finally:
            _examples.value = None
    share = _Share(_count_of(data), divided_after=_count_rides_in_a_bucket(self) and _keras_computes_the_loss(self))
    with _weighing(share):
        outputs = original(self, data)
    if share.divided_after and self.trainable_weights and not share.reduced:
        raise RuntimeError(
            f"tfdist weighs each replica's loss by its examples and divides the all-reduced gradients by the global "
            f"count, but no gradient of this train step was all-reduced through Keras' optimizer "
            f"({type(self.optimizer).__name__}): its gradients would be as many times too large. Set "
            f"{ENV}=keras for Keras' weighting, and report this to tfdist.")
    return outputs


@patch.replaces(keras_tf_trainer.TensorFlowTrainer, "test_step", ("self", "data"))
def _test_step_weighed_by_shares(original, self, data):
    """The loss ``evaluate`` (and fit's validation) logs is one device's, whatever the reduction or split."""
    if weighting() != "exact" or not _several_replicas():
        return original(self, data)
    float16 = getattr(self.dtype_policy, "compute_dtype", "float32") == "float16"
    with _weighing(_Share(_count_of(data), divided_after=not float16 and _keras_computes_the_loss(self))):
        return original(self, data)


def _reduces_across_processes(optimizer) -> bool:
    """Whether ``optimizer`` (or a LossScaleOptimizer's inner one) is a tfdist.horovod DistributedOptimizer."""
    inner = getattr(optimizer, "inner_optimizer", None)
    return any(getattr(o, "_tfdist_reduction", None) is not None for o in (optimizer, inner))


def _keras_computes_the_loss(model) -> bool:
    """Whether every term of ``model``'s loss passes through Keras' reductions: its own ``compute_loss``, and no
    compiled Loss with a ``__call__`` of its own (its value would be divided after, never multiplied)."""
    own_call = [loss for loss in tree.flatten(model.loss) if isinstance(loss, loss_module.Loss)
                and type(loss).__call__ is not loss_module.Loss.__call__]
    return type(model).compute_loss is trainer_module.Trainer.compute_loss and not own_call


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
    # PowerSGD divides after too: the count rides in its P all-reduce (tfdist.optimizer._powersgd_all_reduce)
    return not any(o.gradient_accumulation_steps or getattr(o, "compression", none) is not none
                   and not compression_lib.is_powersgd(getattr(o, "compression", none)) for o in applying)


@patch.replaces(trainer_module.Trainer, "_compute_loss", ("self", "x", "y", "y_pred", "sample_weight", "training"))
def _loss_weighed_by_share(original, self, *args, **kwargs):
    """The step's loss (what the gradients come from): the losses Keras reduces in it are its terms."""
    share = _current_share()
    if share is None:
        return original(self, *args, **kwargs)
    share.stage, share.additional = "loss", (self, self.losses)
    try:
        return original(self, *args, **kwargs)
    finally:
        share.stage, share.additional = "metrics", None


@patch.replaces(Layer, "losses", ("self",))
def _this_replicas_losses(original, self):
    """In a step's compute_loss, the model's ``add_loss`` losses of this replica's forward pass.

    Keras keeps them on the layers, which every replica of a MirroredStrategy shares, and a replica's outermost
    call clears them: a share's collective in compute_loss (a merge_call: the next replica's thread traces its
    forward pass) would leave this replica reading another replica's losses.
    """
    share = _current_share()
    if share is not None and share.additional is not None and share.additional[0] is self:
        return list(share.additional[1])
    return original(self)


def count_to_reduce() -> tf.Tensor | None:
    """The count to all-reduce with the gradients (then divide their sums by the global count), or None."""
    share = _current_share()
    if share is None or not share.divided_after:
        return None
    share.reduced = True
    return share.count


@patch.replaces(loss_module, "reduce_weighted_values", ("values", "sample_weight", "mask", "reduction", "dtype"))
def _reduce_weighted_by_share(original, values, sample_weight=None, mask=None, reduction="sum_over_batch_size",
                              dtype=None):
    """Notes the loss's mask for ``reduce_values``: a masked mean's divisor is its unmasked values."""
    share = _current_share()
    if share is None or mask is None:
        return original(values, sample_weight, mask, reduction, dtype)
    share.mask = mask
    try:
        return original(values, sample_weight, mask, reduction, dtype)
    finally:
        share.mask = None


@patch.replaces(loss_module, "reduce_values", ("values", "sample_weight", "reduction"))
def _reduce_by_share(original, values, sample_weight=None, reduction="sum_over_batch_size"):
    """A Keras Loss reduced in a step: one device's value of this replica's examples, then weighed by the stage
    (``_Share``): a term of the step's loss by its share times F, a Loss used as a metric by its share times
    the replicas, a Loss in the forward pass not at all."""
    share = _current_share()
    if share is None or (share.observe and share.stage != "loss"):
        return original(values, sample_weight, reduction)
    share.unweighed = True
    try:
        value = original(values, sample_weight, reduction)
    finally:
        share.unweighed = False
    if share.stage == "forward":
        return value
    if share.observe:  # tfdist.horovod: Keras' value; only whether it is a mean over the examples counts
        share.per_example_only &= share.per_example_loss(values, sample_weight, reduction)
        return value
    if share.stage == "loss":
        factor = share.of_loss(values, sample_weight, reduction, share.divided_after)
    else:
        factor = share.of_loss(values, sample_weight, reduction, times_total=False) * _replicas()
    return value * tf.cast(factor, value.dtype)


def _replicas() -> int:
    return tf.distribute.get_replica_context().num_replicas_in_sync


@patch.replaces(loss_module, "scale_loss_for_distribution", ("value",))
def _scale_by_share(original, value):
    """Keras' 1 / replicas: left out of a loss ``reduce_values`` weighs; an additional loss of the step's loss
    (``add_loss``, regularization) weighs by the replica's examples."""
    share = _current_share()
    if share is None or share.observe:
        return original(value)
    if share.unweighed:
        return value
    if share.stage == "loss":
        return value * tf.cast(share.per_example(share.divided_after), value.dtype)
    return original(value)


@patch.replaces(loss_module, "unscale_loss_for_distribution", ("value",))
def _unscale_by_share(original, value):
    """A replica's loss as Keras' trackers take it, so that they log one device's figure.

    The loss tracker (after compute_loss) weighs each replica's loss by its count: divided by the count's share
    (times F) it adds up to one device's. The loss of each output (updated inside compute_loss) weighs every
    update alike: there a replica's share of the output's loss times the replicas. A loss of several values
    (reduction None) is averaged value by value, each weighed by the count: divided by F alone it is one
    device's with an even split (a partial one weighs its batches a little otherwise: one device weighs each by
    its examples squared).
    """
    share = _current_share()
    if share is None or share.observe:
        return original(value)
    if share.stage != "loss" and value.shape.rank == 0:  # the loss tracker: no global count, no collective
        return tf.math.divide_no_nan(value, tf.cast(share.per_example(share.divided_after), value.dtype))
    times = share.total() if share.divided_after else tf.ones(())
    if share.stage == "loss":
        return value * tf.cast(_replicas() / times, value.dtype)
    return value / tf.cast(times, value.dtype)


def compute_average_loss(per_example_loss, sample_weight=None) -> tf.Tensor:
    """This replica's part of the global batch's mean loss: the weighted sum over its examples divided by the
    global batch's example count (its replicas' counts all-reduced), so every example weighs as on one device
    however the batch split. ``tf.nn.compute_average_loss`` without ``global_batch_size`` (``sample_weight``
    broadcast and checked as there); call it in ``strategy.run`` and add ``tf.nn.scale_regularization_loss(...)``
    for regularization. Under tfdist.horovod (no strategy) it is this process's mean, and, called inside the
    ``tf.GradientTape`` whose gradients a ``DistributedGradientTape`` reduces, it makes that reduction weigh
    each process by its examples.

    Raises:
        ValueError: a scalar ``per_example_loss`` (it needs one value per example), or a ``sample_weight`` that
            does not broadcast to it.
    """
    per_example_loss = tf.convert_to_tensor(per_example_loss)
    if per_example_loss.shape.rank == 0:
        raise ValueError("compute_average_loss takes one loss per example (a tensor of shape [batch, ...]); received "
                         "a scalar: compute the loss with reduction='none'.")
    dtype = per_example_loss.dtype
    with tf_losses_util.check_per_example_loss_rank(per_example_loss):
        if sample_weight is not None:
            per_example_loss = _weighed(per_example_loss, tf.convert_to_tensor(sample_weight))
        per_example_loss = tf.cast(per_example_loss, dtype)
    count = tf.shape(per_example_loss)[0]
    note_examples(count)  # a tfdist.horovod tape weighs this process's gradients by it
    total = tf.cast(count, tf.float32) if not _several_replicas() else global_count(count)
    return tf.math.divide_no_nan(tf.reduce_sum(per_example_loss), tf.cast(total, dtype))


def _weighed(per_example_loss, sample_weight):
    """``per_example_loss`` times ``sample_weight`` as ``tf.nn.compute_average_loss`` multiplies them."""
    try:
        return tf_losses_util.scale_losses_by_sample_weight(per_example_loss, sample_weight)
    except (ValueError, tf.errors.InvalidArgumentError) as error:
        raise ValueError(
            f"compute_average_loss: sample_weight of shape {sample_weight.shape} does not broadcast to "
            f"per_example_loss of shape {per_example_loss.shape} (as tf.nn.compute_average_loss needs): give one "
            f"weight per example ([batch] or [batch, 1]) or one per loss value. ({error})") from error

"""Keras' ``gradient_accumulation_steps`` and ``use_ema``'s overwrite under any strategy (keras#20582).

Keras' ``_backend_apply_gradients`` decides in a ``tf.cond``, in replica context, whether
this call updates (every k-th micro-batch of ``gradient_accumulation_steps=k``) and whether
it overwrites the weights with their moving average (every ``ema_overwrite_frequency``-th
update of ``use_ema=True``). Both branches update distributed variables, which calls
``merge_call``, and every strategy then fails with "merge_call called while defining a new
graph". Here, under a strategy, the same decisions are made after one ``merge_call``, in
cross-replica context, where a ``cond`` may update variables (``strategy.extended.update``):

1. accumulation, in replica context: add this micro-batch's gradients to this replica's
   accumulator (local arithmetic, no collective); then, in cross-replica context, either
   store each replica's new sums, or, every k-th micro-batch, all-reduce the sums (in
   buckets: the only collectives of the k micro-batches), apply their mean (clipping,
   weight decay, the optimizer's own ``update_step``) and zero the accumulators;
2. the moving average is updated as Keras does (each replica's copy, from its identical
   weights); the overwrite ``cond`` runs in cross-replica context.

Keras' own counting stays: ``iterations`` counts updates, the moving average moves on every
call. Accumulating k micro-batches of global size b equals one device accumulating k
micro-batches of size b. An optimizer's ``compression`` attribute (``tfdist.DistributedOptimizer``'s)
sets what the accumulated sums travel as. Without a strategy Keras' own code runs.
"""

from __future__ import annotations

import tensorflow as tf
from keras.src.optimizers.base_optimizer import BaseOptimizer

from tfdist import buckets, process_group
from tfdist import compression as compression_lib  # a module: its import may be under way
from tfdist.patching import Patch

patch = Patch(
    "accumulation", "keras#20582",
    without="an optimizer with gradient_accumulation_steps, or with use_ema=True and ema_overwrite_frequency, "
            "fails under every tf.distribute strategy (\"merge_call called while defining a new graph\").")


@patch.replaces(BaseOptimizer, "_backend_apply_gradients", ("self", "grads", "trainable_variables"))
def _decide_across_replicas(original, self, grads, trainable_variables):
    """Keras' update, with its accumulation and EMA-overwrite ``cond``s taken in cross-replica context."""
    overwrite = self.use_ema and self.ema_overwrite_frequency
    if not (self.gradient_accumulation_steps or overwrite) or not _in_a_replica():
        return original(self, grads, trainable_variables)
    if self.gradient_accumulation_steps:
        _accumulate(self, grads, trainable_variables)
    else:  # Keras' own step without accumulation
        grads = self._clip_gradients(grads)
        self._apply_weight_decay(trainable_variables)
        self._backend_update_step(grads, trainable_variables, self.learning_rate)
    if self.use_ema:
        self._update_model_variables_moving_average(self._trainable_variables)
        if overwrite:
            tf.__internal__.distribute.interim.maybe_merge_call(
                _overwrite_when_due, self._distribution_strategy, self)


def _in_a_replica() -> bool:
    """Inside ``strategy.run`` of a tf.distribute strategy (Keras' ``cond`` would hold a ``merge_call``)."""
    return tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context()


def _overwrite_when_due(distribution, optimizer):
    """Cross-replica: every ``ema_overwrite_frequency``-th update, the weights become their moving average."""
    due = tf.equal((optimizer.iterations + 1) % optimizer.ema_overwrite_frequency, 0)

    def overwrite():
        optimizer._overwrite_model_variables_with_average_value(optimizer._trainable_variables)

    tf.cond(due, overwrite, lambda: None)


def _accumulate(optimizer, grads, trainable_variables):
    """Replica context: this micro-batch added to this replica's sums, then one ``merge_call``."""
    compression = getattr(optimizer, "compression", compression_lib.Compression.none)
    accumulators = [optimizer._accumulated_gradients[optimizer._get_variable_index(v)] for v in trainable_variables]
    sums = [acc.value + tf.cast(g, acc.dtype) for acc, g in zip(accumulators, grads)]
    packed = [compression.compress(total) for total in sums]
    tf.__internal__.distribute.interim.maybe_merge_call(
        _accumulate_or_update, optimizer._distribution_strategy, optimizer, compression,
        sums, [p for p, _ in packed], [c for _, c in packed], [v.value for v in trainable_variables],
        [a.value for a in accumulators], optimizer.learning_rate)


def _accumulate_or_update(distribution, optimizer, compression, sums, packed, contexts, variables, accumulators,
                          learning_rate):
    """Cross-replica: store each replica's sums, or all-reduce them, apply their mean and zero them."""
    extended = distribution.extended
    steps = optimizer.gradient_accumulation_steps
    is_update_step = tf.equal((optimizer._iterations + 1) % steps, 0)

    def update():
        reduced = [None] * len(packed)
        if process_group.is_multi_worker(distribution):
            buckets.check_agreement(process_group.for_strategy(distribution))
        for bucket in buckets.plan_tensors([distribution.experimental_local_results(p)[0] for p in packed]):
            pairs = [(packed[i], variables[i]) for i in bucket]
            for i, value in zip(bucket, extended.batch_reduce_to(tf.distribute.ReduceOp.SUM, pairs)):
                reduced[i] = value
        means = [compression.decompress(r, c) / steps for r, c in zip(reduced, contexts)]
        scale = _global_clip_scale(optimizer, [distribution.experimental_local_results(m)[0] for m in means])
        for mean, var, acc in zip(means, variables, accumulators):
            extended.update(var, _clip_decay_and_step, args=(optimizer, mean, learning_rate, scale), group=False)
            extended.update(acc, lambda a: a.assign(tf.zeros_like(a)), group=False)

    def accumulate():
        for total, acc in zip(sums, accumulators):
            extended.update(acc, lambda a, t: a.assign(t), args=(total,), group=False)

    tf.cond(is_update_step, update, accumulate)


def _global_clip_scale(optimizer, gradients) -> tf.Tensor:
    """The factor ``global_clipnorm`` applies to every gradient (1 without it)."""
    if not (optimizer.global_clipnorm and optimizer.global_clipnorm > 0):
        return tf.constant(1.0)
    norm = tf.linalg.global_norm(gradients)
    return tf.minimum(1.0, optimizer.global_clipnorm / tf.maximum(norm, 1e-12))


def _clip_decay_and_step(variable, optimizer, gradient, learning_rate, scale):
    """One variable on one device: Keras' clipping (``global_clipnorm`` as ``scale``), weight decay, the step."""
    gradient = gradient * tf.cast(scale, gradient.dtype)
    if not (optimizer.global_clipnorm and optimizer.global_clipnorm > 0):
        (gradient,) = optimizer._clip_gradients([gradient])
    if optimizer.weight_decay is not None and optimizer._use_weight_decay(variable):
        decay = tf.cast(optimizer.weight_decay, variable.dtype) * tf.cast(learning_rate, variable.dtype)
        variable.assign_sub(variable * decay)
    optimizer.update_step(gradient, variable, learning_rate)

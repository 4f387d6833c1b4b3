"""Keras 3.15 LossScaleOptimizer under a strategy: decide "all gradients finite" over every replica."""

from __future__ import annotations

import tensorflow as tf
from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer

from tfdist.keras_fixes import gradient_buckets
from tfdist.patching import Patch

patch = Patch(
    "loss_scale", "LossScaleOptimizer's replica-0 finite check (tfdist UPSTREAM.md)",
    without="under a strategy with mixed_float16, an overflow on any replica but the first reaches the "
            "weights as NaN.")


@patch.replaces(LossScaleOptimizer, "check_finite", ("self", "grads"))
def _finite_on_every_replica(original, self, grads):
    """All-reduces the "not finite" flag, so every replica skips the step and halves the scale together.

    ``LossScaleOptimizer._tf_apply`` takes the finite flag of replica 0 only (its comment
    assumes the gradients were all-reduced already; Keras 3 all-reduces them later, inside
    the inner optimizer). An overflow on another replica or worker is then summed into
    every replica's update: the weights become non-finite while the loss scale is not
    lowered (same code in keras-team/keras master,
    ``keras/src/optimizers/loss_scale_optimizer.py``). With one replica nothing changes.
    Under ``tfdist.horovod`` (each process its own model, gradients all-reduced inside the
    inner optimizer) the flag is all-reduced across processes the same way; otherwise a
    rank that skips would leave the others waiting in their gradient all-reduce.
    """
    finite = original(self, grads)
    reduction = getattr(self.inner_optimizer, "_tfdist_reduction", None)
    if reduction is not None:  # tfdist.horovod: every process skips the step, or none does
        finite = reduction.all_finite(finite)
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync <= 1 or gradient_buckets.already_reduced(self.inner_optimizer):
        return finite  # one replica, or gradients summed over every replica already
    not_finite = context.all_reduce(tf.distribute.ReduceOp.SUM, tf.cast(tf.logical_not(finite), tf.float32))
    return tf.equal(not_finite, 0.0)

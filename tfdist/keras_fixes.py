"""Small, named patches for Keras 3 bugs under tf.distribute.

Each patch changes behaviour only under the strategy it is for, is applied once by
the code that needs it (``tfdist.strategy`` for multi-worker; ``tfdist.strategy`` and
``tfdist.precision`` for loss scaling), and names the upstream issue. Remove a patch when the Keras version tfdist needs has the fix.
"""

from __future__ import annotations

import tensorflow as tf
from keras.src import tree
from keras.src.backend.tensorflow import trainer as keras_tf_trainer
from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer

_applied: set[str] = set()


def _is_multi_worker(strategy) -> bool:
    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and (
        strategy.extended._in_multi_worker_mode()
    )


def _first_local_value(value):
    if isinstance(value, tf.distribute.DistributedValues):
        return value.values[0]
    return value


def _symbolic_build_from_local_batch(self, iterator=None, data_batch=None):
    """keras#20585: build from the first local replica's batch, not a cross-worker reduce.

    Keras reduces the first PerReplica batch with ``strategy.reduce(..., axis=None)``
    eagerly, which under MultiWorkerMirroredStrategy fails with "Attempt to convert a
    value (PerReplica...) to a Tensor". Only shapes and dtypes matter to the build.
    """
    if not _is_multi_worker(self._distribute_strategy):
        return _original_symbolic_build(self, iterator=iterator, data_batch=data_batch)
    if iterator is not None:
        for _, _, batches in iterator:
            data_batch = tree.map_structure(_first_local_value, next(batches))
            break
    with self.distribute_strategy.scope():
        self._symbolic_build(data_batch=data_batch)


def _reduce_per_replica_scalar_safe(values, strategy, reduction):
    """tensorflow#72388: under multi-worker, mean-reduce scalars with ``axis=None``.

    Keras calls ``strategy.reduce("MEAN", v, axis=0)`` on every logged value, and
    scalars (the loss, metrics) fail with "Invalid reduction dimension 0".
    """
    if not (_is_multi_worker(strategy) and reduction in ("auto", "mean")):
        return _original_reduce_per_replica(values, strategy, reduction)

    def reduce_one(value):
        rank = _first_local_value(value).shape.rank
        return strategy.reduce("MEAN", value, axis=None if rank == 0 else 0)

    return tree.map_structure(reduce_one, values)


_original_symbolic_build = keras_tf_trainer.TensorFlowTrainer._maybe_symbolic_build
_original_reduce_per_replica = keras_tf_trainer.reduce_per_replica


def apply_multi_worker_fit_fixes() -> None:
    """Makes Keras 3 ``fit``/``evaluate``/``predict`` work under MultiWorkerMirroredStrategy.

    Idempotent; behaviour under every other strategy is unchanged.
    """
    if "multi_worker_fit" in _applied:
        return
    keras_tf_trainer.TensorFlowTrainer._maybe_symbolic_build = _symbolic_build_from_local_batch
    keras_tf_trainer.reduce_per_replica = _reduce_per_replica_scalar_safe
    _applied.add("multi_worker_fit")


def _finite_on_every_replica(self, grads):
    """Keras 3.15 LossScaleOptimizer: decide "all gradients finite" over every replica.

    ``LossScaleOptimizer._tf_apply`` takes the finite flag of replica 0 only (its
    comment assumes the gradients were all-reduced already; Keras 3 all-reduces them
    later, inside the inner optimizer). An overflow on another replica or worker is
    then summed into every replica's update: the weights become non-finite while the
    loss scale is not lowered (tfdist UPSTREAM.md; same code in keras-team/keras
    master, ``keras/src/optimizers/loss_scale_optimizer.py``). All-reducing the
    "not finite" count makes every replica skip the step and halve the scale together.
    """
    finite = _original_check_finite(self, grads)
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync <= 1:
        return finite
    not_finite = context.all_reduce(tf.distribute.ReduceOp.SUM, tf.cast(tf.logical_not(finite), tf.float32))
    return tf.equal(not_finite, 0.0)


_original_check_finite = LossScaleOptimizer.check_finite


def apply_loss_scale_fix() -> None:
    """Makes LossScaleOptimizer skip a step when any replica's gradients overflow.

    Idempotent; with one replica (no strategy, one device) behaviour is unchanged.
    """
    if "loss_scale" in _applied:
        return
    LossScaleOptimizer.check_finite = _finite_on_every_replica
    _applied.add("loss_scale")

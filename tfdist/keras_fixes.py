"""Small, named patches for Keras 3 bugs under tf.distribute.

Each patch changes behaviour only under the strategy it is for, is applied once by
the code that needs it (``tfdist.strategy`` for multi-worker), and names the
upstream issue. Remove a patch when the Keras version tfdist needs has the fix.
"""

from __future__ import annotations

import tensorflow as tf
from keras.src import tree
from keras.src.backend.tensorflow import trainer as keras_tf_trainer

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

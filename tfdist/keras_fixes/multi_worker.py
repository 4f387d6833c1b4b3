"""Keras 3 ``fit``/``evaluate``/``predict`` under MultiWorkerMirroredStrategy (keras#20585, tensorflow#72388).

The reduce of logged values changes behaviour only under a multi-worker strategy; the build from a local
batch under any strategy of several replicas (their shares of a global batch may differ in size).
"""

from __future__ import annotations

import tensorflow as tf
from keras.src import tree
from keras.src.backend.tensorflow import trainer as keras_tf_trainer

from tfdist import process_group
from tfdist.patching import Patch

patch = Patch(
    "multi_worker_fit", "keras#20585 and tensorflow#72388",
    without="Keras fit/evaluate/predict under MultiWorkerMirroredStrategy fail with \"Attempt to convert a "
            "value (PerReplica...)\" and \"Invalid reduction dimension 0\".")


def _first_local_value(value):
    if isinstance(value, tf.distribute.DistributedValues):
        return value.values[0]
    return value


def _one_row_if_empty(value):
    if isinstance(value, tf.Tensor) and value.shape.rank and value.shape[0] == 0:
        return tf.zeros((1, *value.shape[1:]), value.dtype)
    return value


@patch.replaces(keras_tf_trainer.TensorFlowTrainer, "_maybe_symbolic_build", ("self", "iterator", "data_batch"))
def _symbolic_build_from_local_batch(original, self, iterator=None, data_batch=None):
    """keras#20585: build from the first local replica's batch, not a cross-replica reduce.

    Keras reduces the first PerReplica batch with ``strategy.reduce(..., axis=None)``
    eagerly, which under MultiWorkerMirroredStrategy fails with "Attempt to convert a
    value (PerReplica...) to a Tensor", and under any strategy fails when the replicas'
    shares differ (a global batch of 5 on 2 replicas: "Inputs to operation AddN ... must
    have the same size and shape"). Only shapes and dtypes matter to the build.
    """
    if self._distribute_strategy is None or self._distribute_strategy.num_replicas_in_sync <= 1:
        return original(self, iterator=iterator, data_batch=data_batch)
    if iterator is not None:
        for *_, batches in iterator:  # (step, batches) before Keras 3.11, (begin, end, batches) since
            data_batch = tree.map_structure(_first_local_value, next(batches))
            break
    # A replica's share can be empty (a global batch of 4 over 3 workers splits 2/2/0); Keras' build computes
    # the loss and an empty one has another rank ("Shapes must be equal rank, but are 1 and 0").
    data_batch = tree.map_structure(_one_row_if_empty, data_batch)
    with self.distribute_strategy.scope():
        self._symbolic_build(data_batch=data_batch)


@patch.replaces(keras_tf_trainer, "reduce_per_replica", ("values", "strategy", "reduction"))
def _reduce_per_replica_in_one_collective(original, values, strategy, reduction):
    """tensorflow#72388: under multi-worker, mean-reduce the logged scalars with ``axis=None``,
    all of them in one collective.

    Keras calls ``strategy.reduce("MEAN", v, axis=0)`` on every logged value: scalars (the
    loss, metrics) fail with "Invalid reduction dimension 0", and each value would be its
    own cross-worker collective every step (about 1.7 ms each on loopback). Scalars of one
    dtype are stacked per replica and reduced together; other values keep ``axis=0``.
    """
    if not (process_group.is_multi_worker(strategy) and reduction in ("auto", "mean")):
        return original(values, strategy, reduction)
    leaves = tree.flatten(values)
    groups: dict[tf.DType, list[int]] = {}
    for index, leaf in enumerate(leaves):
        local = _first_local_value(leaf)
        if local.shape.rank == 0:
            groups.setdefault(local.dtype, []).append(index)
    reduced = [None if _first_local_value(leaf).shape.rank == 0 else strategy.reduce("MEAN", leaf, axis=0)
               for leaf in leaves]
    for indices in groups.values():
        stacked = strategy.run(lambda *scalars: tf.stack(scalars), args=[leaves[i] for i in indices])
        for i, value in zip(indices, tf.unstack(strategy.reduce("MEAN", stacked, axis=None))):
            reduced[i] = value
    return tree.pack_sequence_as(values, reduced)

"""Sparse gradients with a repeated row are summed per row before the optimizer reads them, as tf.keras 2 did.

An ``Embedding``'s gradient is a ``tf.IndexedSlices`` with one row per id looked up: an id
that a batch holds twice is two rows. Keras 3 applies element-wise ops to the rows as they
are (``keras.src.backend.tensorflow.sparse.elementwise_unary`` assumes unique indices): Adam's
second moment adds ``g1**2 + g2**2`` for such a row where the gradient's is ``(g1 + g2)**2``,
and ``global_clipnorm`` measures the same wrong norm. The result then depends on how the
rows happen to be split: one device differs from the same batch on N devices, where the
gradient reaches the optimizer summed (dense in tfdist's buckets). tf.keras 2 summed repeated
rows first (``_deduplicate_indexed_slices``); so does this fix, in ``BaseOptimizer.apply``,
on one device and on many. SGD (with or without momentum) is linear and unchanged.
"""

from __future__ import annotations

import tensorflow as tf
from keras.src.optimizers.base_optimizer import BaseOptimizer

from tfdist.patching import Patch

patch = Patch(
    "sparse_rows", "keras sparse.elementwise_unary on IndexedSlices with repeated indices (tf.keras 2 deduplicated; "
    "keras#19992 is the same code path)",
    without="Adam-like optimizers and global_clipnorm on an Embedding whose batch repeats an id square each "
            "repeat apart, so N devices (gradients summed) differ from one device.")


@patch.replaces(BaseOptimizer, "apply", ("self", "grads", "trainable_variables"))
def _sum_repeated_rows(original, self, grads, trainable_variables=None):
    return original(self, [summed_rows(g) if isinstance(g, tf.IndexedSlices) else g for g in grads],
                    trainable_variables)


def summed_rows(gradient: tf.IndexedSlices) -> tf.IndexedSlices:
    """``gradient`` with each index once, its rows summed (the same dense value)."""
    indices, positions = tf.unique(gradient.indices)
    values = tf.math.unsorted_segment_sum(gradient.values, positions, tf.shape(indices)[0])
    return tf.IndexedSlices(values, indices, gradient.dense_shape)

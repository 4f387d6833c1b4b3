"""``hvd.SyncBatchNormalization``: Keras' synchronized BatchNormalization, also across Horovod-style processes.

Under a tf.distribute strategy (``tfdist.scope()``) it is Keras' own
``BatchNormalization(synchronized=True)``: batch statistics over every replica. Under
``tfdist.horovod`` (each process its own model, no strategy) it all-reduces each process's
sum, sum of squares and count in training, so the statistics are the global batch's; the
all-reduce has a gradient (the upstream gradients, all-reduced), so training matches one
process on the global batch. Its collectives run in a lane of their own
(``ProcessGroup.lane``): in the process group's program order, the backward all-reduce
would come before every gradient bucket and hold back the buckets ready before it.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfdist import process_group

_LANE = process_group.SYNC_BATCH_NORM_LANE

@keras.saving.register_keras_serializable(package="tfdist.horovod")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Horovod's constructor: Keras BatchNormalization's arguments, plus ``fused`` (only False).

    Raises:
        ValueError: ``fused`` is True or None (Horovod's rule: a fused kernel cannot be synchronized).
    """

    def __init__(self, fused=False, **kwargs):
        if fused in (True, None):
            raise ValueError(f"SyncBatchNormalization does not support fused={fused!r}: pass fused=False (the "
                             "default); synchronized statistics need the unfused computation.")
        kwargs.setdefault("name", "sync_batch_normalization")
        kwargs.pop("synchronized", None)
        super().__init__(synchronized=True, **kwargs)
        self._keys = (process_group.KeyCache(), process_group.KeyCache())

    def _moments(self, inputs, mask):
        mean, variance = super()._moments(inputs, mask)
        group = _process_group()
        if group is None:
            return mean, variance
        count = tf.cast(tf.size(inputs), tf.float32) / tf.cast(tf.size(mean), tf.float32)
        mean32, variance32 = tf.cast(mean, tf.float32), tf.cast(variance, tf.float32)
        local = tf.concat([mean32 * count, (variance32 + tf.square(mean32)) * count, [count]], 0)
        total = group.differentiable_sum(local, self._keys)
        channels = tf.size(mean)
        group_mean = total[:channels] / total[-1]
        group_variance = tf.maximum(total[channels:2 * channels] / total[-1] - tf.square(group_mean), 0.0)
        return tf.cast(group_mean, mean.dtype), tf.cast(group_variance, variance.dtype)

    def get_config(self):
        config = super().get_config()
        config.pop("synchronized", None)
        return config


def _process_group():
    """The Horovod job's group when processes train their own models (no multi-replica strategy), else None."""
    from tfdist.horovod import basics

    if not basics.is_initialized() or basics.size() == 1:
        return None
    if tf.distribute.has_strategy() and tf.distribute.get_strategy().num_replicas_in_sync > 1:
        return None  # Keras' synchronized path already reduced over the strategy's replicas
    return basics.group_of(basics.global_process_set, "SyncBatchNormalization").lane(_LANE)


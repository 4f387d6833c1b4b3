"""Collectives a replica launches from its own thread, without ``merge_call``.

``ReplicaContext.all_reduce`` and ``all_gather`` go through ``merge_call`` on CPUs: the replica's thread waits
while the next one traces its part of the step. Under collective cross-device ops (workers; CPUs), tfdist
launches its collectives from the replica's own launcher instead, as TensorFlow launches its replica-context
all-reduce for XLA (``MirroredExtended._replica_ctx_all_reduce``).
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.python.distribute import collective_util
from tensorflow.python.distribute import cross_device_ops as cross_device_ops_lib


def launcher(value) -> tuple[cross_device_ops_lib.CollectiveAllReduce, collective_util.Options] | None:
    """The cross-device ops and options that launch ``value``'s collective from this replica, or None (eagerly,
    or under other cross-device ops: use the replica context's own collective)."""
    extended = tf.distribute.get_strategy().extended
    get_ops = getattr(extended, "_get_cross_device_ops", None)
    ops = get_ops(value) if get_ops is not None else None
    if tf.executing_eagerly() or not isinstance(ops, cross_device_ops_lib.CollectiveAllReduce):
        return None
    return ops, extended._communication_options.merge(collective_util.Options())

"""2 workers: a small CNN with BatchNormalization, plain and synchronized (the chief saves the plain one; which
all-reduces of a synchronized step wait for which), then a toy-size MobileNetV2.

argv: OUT_DIR. Writes each worker's weights, its own (not yet averaged) moving statistics at the
last batch, and, on the chief, ``bn.keras``.
"""

import hashlib
import os
import sys

import keras
import numpy as np

import tfdist
from tests.workers import common

out_dir = sys.argv[1]


class LocalStatistics(keras.callbacks.Callback):
    """This worker's own moving statistics after the last batch (before the epoch-end average)."""

    def on_train_batch_end(self, batch, logs=None):
        bn = self.model.layers[1]
        self.values = [bn.moving_mean.numpy().tolist(), bn.moving_variance.numpy().tolist()]


strategy = tfdist.get_strategy()
local = LocalStatistics()
plain, plain_loss = common.train_batchnorm_cnn(strategy, synchronized=False, callbacks=[local])
if tfdist.is_chief():
    plain.save(os.path.join(out_dir, "bn.keras"))  # chief only: reading the statistics needs no collective
synced, synced_loss = common.train_batchnorm_cnn(strategy, synchronized=True)


def sync_bn_lane(model) -> dict:
    """Traces one custom training step of ``model`` with small gradient buckets: which all-reduces wait for which.

    The first bucket (the last layer's gradients) must not wait for the synchronized layer's backward all-reduce.
    """
    import tensorflow as tf

    saved = tfdist.buckets.bucket_sizes()
    tfdist.set_bucket_bytes(64, 64)
    x, y = common.batchnorm_data()

    @tf.function
    def step(xb, yb):
        def replica_step(xr, yr):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(model.loss(yr, model(xr, training=True)))
            model.optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                                model.trainable_variables))
        strategy.run(replica_step, (xb, yb))

    waits = common.collectives_waited_for(step.get_concrete_function(x[:8], y[:8]).graph)
    tfdist.set_bucket_bytes(*saved)
    group_key = {op: int(tf.get_static_value(op.inputs[2])) for op in waits}
    last = list(waits)[-1]  # a gradient bucket's all-reduce
    buckets = [op for op in waits if group_key[op] == group_key[last]]
    lane = [op for op in waits if group_key[op] != group_key[last]]  # the layer's own: forward, then backward
    report = {"buckets": len(buckets), "layer_collectives": len(lane)}
    if len(lane) == 2:
        report.update(first_bucket_waits=lane[1] in waits[buckets[0]], last_bucket_waits=lane[1] in waits[buckets[-1]])
    return report


def weights_digest(weights) -> str:
    """One hash of every weight's bytes: equal on two workers only if every value is."""
    return hashlib.sha256(b"".join(np.ascontiguousarray(w).tobytes() for w in weights)).hexdigest()


# The TensorFlow guide's model: MobileNetV2 (at toy size), its 52 BatchNormalization layers included.
with strategy.scope():
    keras.utils.set_random_seed(5)
    mobilenet = keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, weights=None, classes=3)
    mobilenet.compile(keras.optimizers.SGD(0.01), keras.losses.SparseCategoricalCrossentropy())
statistics = [w for w in mobilenet.non_trainable_weights if "moving" in w.path]
initial_statistics = weights_digest([w.numpy() for w in statistics])
rng = np.random.default_rng(2)
images = (rng.random((32, 32, 32, 3)) + np.repeat(np.arange(4), 8)[:, None, None, None]).astype("float32")
mobilenet.fit(images, rng.integers(0, 3, 32), batch_size=8, epochs=1, shuffle=False, verbose=0)
common.write_result(out_dir, {
    "plain_weights": [w.tolist() for w in plain.get_weights()], "plain_loss": plain_loss, "local": local.values,
    "synced_weights": [w.tolist() for w in synced.get_weights()], "synced_loss": synced_loss,
    "sync_bn_lane": sync_bn_lane(synced),
    "replicas": strategy.num_replicas_in_sync,
    "mobilenet": {"weights": weights_digest(mobilenet.get_weights()), "statistics": len(statistics),
                  "statistics_moved": weights_digest([w.numpy() for w in statistics]) != initial_statistics}})

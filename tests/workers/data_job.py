"""A 2-worker job reading TFRecord shards through tfdist.data: what each worker reads, and training.

argv: out_dir, shard pattern, global batch, steps per epoch.
"""

import sys

import tfdist

out_dir, pattern, global_batch, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
with tfdist.scope() as strategy:
    pass
import keras  # noqa: E402  (after the strategy: TF must not start first)
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.workers import common  # noqa: E402
from tfdist import data  # noqa: E402


def to_xy(batch):
    return tf.cast(batch["image"], tf.float32) / 255.0, batch["label"]


def read_indices():
    """The record indices this worker's replica receives in one epoch, through the strategy."""
    dataset = data.distribute(strategy, lambda ctx: data.tfrecord_dataset(pattern, batch_size=global_batch,
                                                                          input_context=ctx))
    seen = []
    for batch in dataset:
        for local in strategy.experimental_local_results(batch["index"]):
            seen += local.numpy().tolist()
    return seen


def train():
    dataset = data.distribute(strategy, lambda ctx: data.tfrecord_dataset(
        pattern, batch_size=global_batch, input_context=ctx, repeat=True, seed=1, parse_fn=to_xy))
    with strategy.scope():
        model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Flatten(), keras.layers.Dense(2)])
        rng = np.random.default_rng(0)
        model.set_weights([rng.normal(scale=0.1, size=w.shape).astype("float32") for w in model.get_weights()])
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(dataset, epochs=3, steps_per_epoch=steps, verbose=0)
    return history.history["loss"], model.get_weights()


indices = read_indices()
losses, weights = train()
common.write_result(out_dir, {"indices": indices, "losses": losses, "weights": [w.tolist() for w in weights]})

"""2 workers under tfdist.scope() with per-worker data of different lengths (rank 1: 40% fewer batches).

argv: OUT_DIR. ``fit`` on ``distribute_datasets_from_function`` (each worker its own data),
then ``evaluate`` with a metric on rank-distinct data of the same uneven lengths.
"""

import sys

import keras
import tensorflow as tf

import tfdist
from tests.workers import common

out_dir = sys.argv[1]
r = tfdist.rank()
BATCHES = (10, 6)
payload = {}


def per_worker(x, y):
    return strategy.distribute_datasets_from_function(
        lambda context: tf.data.Dataset.from_tensor_slices((x, y)).batch(common.JOIN_BATCH))


with tfdist.scope() as strategy:
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.set_weights(common.join_start())
    model.compile(keras.optimizers.SGD(common.JOIN_LR), "mse", metrics=["mae"])
class Batches(keras.callbacks.Callback):
    """Counts batches (a batch-level callback also makes Keras run one step per call)."""

    def __init__(self):
        super().__init__()
        self.train = self.test = 0

    def on_train_batch_end(self, batch, logs=None):
        self.train += 1

    def on_test_batch_end(self, batch, logs=None):
        self.test += 1


batches = Batches()
history = model.fit(per_worker(*common.join_data(r, BATCHES[r])), epochs=1, verbose=0, callbacks=[batches])
payload["fit"] = {"weights": [w.tolist() for w in model.get_weights()], "loss": history.history["loss"],
                  "steps": int(model.optimizer.iterations.numpy())}
payload["evaluate"] = model.evaluate(per_worker(*common.join_data(10 + r, BATCHES[r])), verbose=0, return_dict=True,
                                     callbacks=[batches])
payload["batches"] = [batches.train, batches.test]
common.write_result(out_dir, payload)

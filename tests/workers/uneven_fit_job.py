"""2 workers under tfdist.scope() with per-worker data of different lengths (rank 1: 40% fewer batches).

argv: OUT_DIR. ``fit`` on ``distribute_datasets_from_function`` (each worker its own data),
then ``evaluate`` with a metric on rank-distinct data.
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
history = model.fit(per_worker(*common.join_data(r, BATCHES[r])), epochs=1, verbose=0)
payload["fit"] = {"weights": [w.tolist() for w in model.get_weights()], "loss": history.history["loss"],
                  "steps": int(model.optimizer.iterations.numpy())}
# evaluate: rank-distinct data of equal length (with uneven lengths each worker stops at its own cardinality).
payload["evaluate"] = model.evaluate(per_worker(*common.join_data(10 + r, 6)), verbose=0, return_dict=True)
common.write_result(out_dir, payload)

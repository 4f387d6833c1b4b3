"""Two workers whose input pipelines differ in static shape only: worker 0's sequences have 6 steps statically,
worker 1's are padded (None); the same values. ``horovod``: each rank its own model with hvd.DistributedOptimizer,
then hvd.join() (``dynamic``: both ranks padded). Writes worker<rank>.json with the weights after fit."""

import sys

import keras
import numpy as np
import tensorflow as tf

import tfdist
from tests.workers import common

mode = sys.argv[2] if len(sys.argv) > 2 else "fit"
rng = np.random.default_rng(0)
x, y = rng.normal(size=(12, 6, 3)).astype("float32"), rng.normal(size=(12, 6, 2)).astype("float32")


def model_of(optimizer):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((None, 3))
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Dense(4, activation="tanh")(inputs)))
    model.compile(optimizer, "mse")
    return model


def pipeline(padded: bool):
    if not padded:
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(3)
    spec = (tf.TensorSpec([None, 3], tf.float32), tf.TensorSpec([None, 2], tf.float32))
    return tf.data.Dataset.from_generator(lambda: zip(x, y), output_signature=spec).padded_batch(3)


if mode == "fit":
    with tfdist.scope() as strategy:
        model = model_of(keras.optimizers.SGD(0.05))
    data = tfdist.data.distribute(strategy, lambda context: pipeline(context.input_pipeline_id == 1).repeat())
    model.fit(data, epochs=1, steps_per_epoch=4, verbose=0)
else:
    import tfdist.horovod as hvd

    hvd.init()
    model = model_of(hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)))
    model.fit(pipeline(hvd.rank() == 1 or mode == "dynamic"), epochs=1, verbose=0)
    hvd.join()
common.write_result(sys.argv[1], {"weights": [w.tolist() for w in model.get_weights()]})

"""A 2-worker mixed_float16 job: an overflow on one worker only must be skipped by both."""

import sys

import numpy as np

import tfdist
from tests.workers import common

out_dir = sys.argv[1]
with tfdist.scope(precision="mixed_float16") as strategy:
    import keras
    import tensorflow as tf

    from tfdist import precision

    rank = tfdist.rank()
    variable = keras.Variable([1.0, 2.0], name="w")
    optimizer = precision.wrap_optimizer(keras.optimizers.SGD(0.5), initial_scale=8.0)
    optimizer.build([variable])
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(1, dtype="float32")])
    init = np.random.default_rng(1)
    model.set_weights([init.normal(scale=0.5, size=w.shape).astype("float32") for w in model.get_weights()])
    loop_optimizer = precision.wrap_optimizer(keras.optimizers.SGD(0.1))


@tf.function
def apply_step(bad_rank):
    """Gradient [1, 1] on every worker, [inf, 1] on worker ``bad_rank``."""
    def replica_fn():
        grad = tf.where(tf.equal(bad_rank, rank), tf.constant([np.inf, 1.0]), tf.constant([1.0, 1.0]))
        optimizer.apply([grad], [variable])
    strategy.run(replica_fn)


def snapshot():
    return {"w": variable.numpy().tolist(), "scale": precision.current_loss_scale(optimizer)}


payload = {"direct": [snapshot()]}
for bad_rank in (-1, 1, 0, -1):
    apply_step(tf.constant(bad_rank))
    payload["direct"].append(snapshot())


def dataset_fn(context, poison=False):
    rng = np.random.default_rng(10 + context.input_pipeline_id)  # each worker its own examples
    x = rng.normal(size=(80, 4)).astype("float32")
    y = (x.sum(axis=1, keepdims=True) * 0.3).astype("float32")
    if poison:
        x[:, 0] = np.inf if context.input_pipeline_id == 1 else x[:, 0]
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(8)


step = precision.make_train_step(model, keras.losses.MeanSquaredError(), loop_optimizer, strategy)
payload["losses"] = [float(step(batch)) for batch in strategy.distribute_datasets_from_function(dataset_fn)]
payload["scale_before"] = precision.current_loss_scale(loop_optimizer)
payload["weights_before"] = [w.tolist() for w in model.get_weights()]
poisoned = strategy.distribute_datasets_from_function(lambda context: dataset_fn(context, poison=True))
step(next(iter(poisoned)))
payload["scale_after"] = precision.current_loss_scale(loop_optimizer)
payload["weights_after"] = [w.tolist() for w in model.get_weights()]
payload["compute_dtype"] = model.layers[0].compute_dtype
common.write_result(out_dir, payload)

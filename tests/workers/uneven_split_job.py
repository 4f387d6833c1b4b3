"""Global batches that do not split evenly over the workers (``common.UNEVEN_CASES``: fit, evaluate, predict),
and a custom loop whose loss is ``tfdist.compute_average_loss`` over batches of 5 (on 2 workers 3/2, on 3
workers 2/2/1, the last batch of 1 example on one worker only). Writes worker<rank>.json."""

import sys

import tfdist
from tests.workers import common

out_dir = sys.argv[1]
with tfdist.scope() as strategy:
    pass
import keras  # noqa: E402  (after the strategy: TF must not start first)
import tensorflow as tf  # noqa: E402

payload = {"replicas": strategy.num_replicas_in_sync}
for examples, batch, optimizer in common.UNEVEN_CASES:
    with strategy.scope():
        model = common.uneven_model(optimizer)
    payload[f"{examples}/{batch}"] = common.uneven_run(model, examples, batch)

x, y = common.uneven_data(11)
with strategy.scope():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
    model.set_weights(common.uneven_loop_start())
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(model.trainable_variables)


@tf.function
def step(xb, yb):
    def replica(xr, yr):
        with tf.GradientTape() as tape:
            loss = tfdist.compute_average_loss(tf.square(model(xr) - yr)[:, 0])
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    strategy.run(replica, args=(xb, yb))


for xb, yb in strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(5)):
    step(xb, yb)
payload["loop"] = [w.tolist() for w in model.get_weights()]
common.write_result(out_dir, payload)

"""2 Horovod-style ranks with uneven data: ``hvd.join()`` after fit and after a tf.function loop; SyncBatchNormalization.

argv: OUT_DIR. Every rank starts from the same weights (``join_start``), so no broadcast is needed.
"""

import sys

import keras
import numpy as np
import tensorflow as tf

import tfdist.horovod as hvd
from tests.workers import common

hvd.init()
r = hvd.rank()
out_dir = sys.argv[1]
payload = {}
FIT_BATCHES = (10, 6)  # rank 1 has 40% fewer batches
LOOP_STEPS = (3, 5)


def linear_model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.set_weights(common.join_start())
    return model


# 1. model.fit with DistributedOptimizer, then join.
x, y = common.join_data(r, FIT_BATCHES[r])
model = linear_model()
model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(common.JOIN_LR)), "mse")
model.fit(x, y, batch_size=common.JOIN_BATCH, epochs=1, shuffle=False, verbose=0)
payload["fit_last"] = int(hvd.join().numpy())
payload["fit_weights"] = [w.tolist() for w in model.get_weights()]

# 2. A tf.function loop with DistributedGradientTape; rank 1 has more steps this time.
x, y = common.join_data(r + 2, LOOP_STEPS[r])
model = linear_model()
optimizer = keras.optimizers.SGD(common.JOIN_LR)


@tf.function
def step(xb, yb):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(xb) - yb))
    tape = hvd.DistributedGradientTape(tape)
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))


for i in range(LOOP_STEPS[r]):
    step(x[i * common.JOIN_BATCH:(i + 1) * common.JOIN_BATCH], y[i * common.JOIN_BATCH:(i + 1) * common.JOIN_BATCH])
payload["loop_last"] = last = int(hvd.join().numpy())
payload["loop_weights_at_join"] = [w.tolist() for w in model.get_weights()]
hvd.broadcast_variables(model.variables, root_rank=last)  # Horovod's way: the last rank to join has every update
payload["loop_weights"] = [w.tolist() for w in model.get_weights()]

# 3. SyncBatchNormalization: each rank half of every global batch.
x, y = common.sync_bn_data()
half = len(x) // 2
mine = np.concatenate([x[i:i + 16][r * 8:(r + 1) * 8] for i in range(0, len(x), 16)])
mine_y = np.concatenate([y[i:i + 16][r * 8:(r + 1) * 8] for i in range(0, len(y), 16)])
model = common.sync_bn_model(hvd.SyncBatchNormalization(momentum=0.5))
model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), "mse")
history = model.fit(mine, mine_y, batch_size=8, epochs=1, shuffle=False, verbose=0)
payload["sync_bn_weights"] = [w.tolist() for w in model.get_weights()]
common.write_result(out_dir, payload)

"""2 Horovod-style ranks with uneven data.

``hvd.join()`` after fit, after a tf.function loop and after an eager loop; SyncBatchNormalization;
tf.function steps that rank 0 alone retraces for its partial last batch (a DistributedGradientTape
made inside the function; an Embedding's sparse gradients); which all-reduces wait for SyncBatchNormalization's.

argv: OUT_DIR. Every rank starts from the same weights, so no broadcast is needed before training.
"""

import sys

import keras
import numpy as np
import tensorflow as tf

import tfdist
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


def tape_function_loop(model, optimizer, x, y):
    """A tf.function step whose DistributedGradientTape is made inside it, over x, y in batches of JOIN_BATCH."""
    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb) - yb))
        tape = hvd.DistributedGradientTape(tape)
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    for i in range(0, len(x), common.JOIN_BATCH):
        step(x[i:i + common.JOIN_BATCH], y[i:i + common.JOIN_BATCH])


# 1. model.fit with DistributedOptimizer, then join.
x, y = common.join_data(r, FIT_BATCHES[r])
model = linear_model()
model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(common.JOIN_LR)), "mse")
model.fit(x, y, batch_size=common.JOIN_BATCH, epochs=1, shuffle=False, verbose=0)
payload["fit_last"] = int(hvd.join().numpy())
payload["fit_weights"] = [w.tolist() for w in model.get_weights()]

# 1b. A DistributedOptimizer with backward_passes_per_step=2: rank 0 has 4 batches, rank 1 has 2 and joins (its
# stand-in all-reduces zeros but cannot apply, as it accumulates): join makes its weights rank 0's.
x, y = common.join_data(16, (4, 2)[r])
model = linear_model()
model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(common.JOIN_LR), backward_passes_per_step=2), "mse")
model.fit(x, y, batch_size=common.JOIN_BATCH, epochs=1, shuffle=False, verbose=0)
payload["accumulated_last"] = int(hvd.join().numpy())
payload["accumulated_weights"] = [w.tolist() for w in model.get_weights()]

# 2. A tf.function loop with DistributedGradientTape; rank 1 has more steps this time.
x, y = common.join_data(r + 2, LOOP_STEPS[r])
model = linear_model()
optimizer = keras.optimizers.SGD(common.JOIN_LR)
tape_function_loop(model, optimizer, x, y)  # LOOP_STEPS[r] steps
payload["loop_last"] = int(hvd.join().numpy())  # no broadcast: join made the tape's variables equal
payload["loop_weights"] = [w.tolist() for w in model.get_weights()]

# 3. An eager DistributedGradientTape loop; rank 1 has more batches, rank 0 joins first.
x, y = common.join_data(r + 8, (2, 4)[r])
model = linear_model()
optimizer = keras.optimizers.SGD(common.JOIN_LR)
for i in range((2, 4)[r]):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x[i * common.JOIN_BATCH:(i + 1) * common.JOIN_BATCH])
                                        - y[i * common.JOIN_BATCH:(i + 1) * common.JOIN_BATCH]))
    tape = hvd.DistributedGradientTape(tape)
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
payload["eager_last"] = int(hvd.join().numpy())
payload["eager_weights"] = [w.tolist() for w in model.get_weights()]

# 3b. Two models of one shape, each with its eager DistributedGradientTape (two towers, an ensemble): their tapes
# share a name; join makes both models equal (it broadcast only the latest tape's variables). Rank 1 has more steps.
towers = [linear_model(), linear_model()]
tower_optimizers = [keras.optimizers.SGD(common.JOIN_LR), keras.optimizers.SGD(common.JOIN_LR)]
x, y = common.join_data(r + 12, (2, 4)[r])
for i in range((2, 4)[r]):
    rows = slice(i * common.JOIN_BATCH, (i + 1) * common.JOIN_BATCH)
    for tower, tower_optimizer, power in zip(towers, tower_optimizers, (2, 4)):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.abs(tower(x[rows]) - y[rows]) ** power)
        tape = hvd.DistributedGradientTape(tape)
        tower_optimizer.apply_gradients(zip(tape.gradient(loss, tower.trainable_variables), tower.trainable_variables))
payload["towers_last"] = int(hvd.join().numpy())
payload["towers_weights"] = [[w.tolist() for w in tower.get_weights()] for tower in towers]

# 3c. Rank 0 alone computes tfdist.compute_average_loss outside any tape (it validates): no later step of its
# weighs by that count, so both ranks' tapes all-reduce alike (a stale note made their collectives differ).
model = linear_model()
optimizer = keras.optimizers.SGD(common.JOIN_LR)
x, y = common.join_data(r + 10, 2)
if r == 0:
    tfdist.compute_average_loss(tf.reduce_sum(tf.square(model(x) - y), axis=1))


tape_function_loop(model, optimizer, x, y)
payload["validated_weights"] = [w.tolist() for w in model.get_weights()]
hvd.join()

# 3d. A weighed eager tape loop (its loss from tfdist.compute_average_loss) on uneven data, then join: every
# example weighs as on one device (once rank 1 joined, a step is rank 0's batch alone), every rank equal.
model = linear_model()
optimizer = keras.optimizers.SGD(common.JOIN_LR)
x, y = common.join_data(r + 12, 3 if r == 0 else 2)
for i in range(0, len(x), common.JOIN_BATCH):
    with tf.GradientTape() as tape:
        loss = tfdist.compute_average_loss(tf.reduce_sum(tf.square(model(x[i:i + common.JOIN_BATCH])
                                                                   - y[i:i + common.JOIN_BATCH]), axis=1))
    tape = hvd.DistributedGradientTape(tape)
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
payload["weighed_last"] = int(hvd.join().numpy())
payload["weighed_weights"] = [w.tolist() for w in model.get_weights()]

# 4. SyncBatchNormalization: each rank half of every global batch.
x, y = common.sync_bn_data()
half = len(x) // 2
mine = np.concatenate([x[i:i + 16][r * 8:(r + 1) * 8] for i in range(0, len(x), 16)])
mine_y = np.concatenate([y[i:i + 16][r * 8:(r + 1) * 8] for i in range(0, len(y), 16)])
model = common.sync_bn_model(hvd.SyncBatchNormalization(momentum=0.5))
model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), "mse")
history = model.fit(mine, mine_y, batch_size=8, epochs=1, shuffle=False, verbose=0)
payload["sync_bn_weights"] = [w.tolist() for w in model.get_weights()]

# 5. A tf.function step with the DistributedGradientTape made inside it; rank 0's last batch is partial,
# so rank 0 alone traces the step again (its collectives must keep their keys).
x, y = common.join_data(r + 6, 3)
x, y = (x[:10], y[:10]) if r == 0 else (x, y)
model = linear_model()
optimizer = keras.optimizers.SGD(common.JOIN_LR)


tape_function_loop(model, optimizer, x, y)
payload["retrace_weights"] = [w.tolist() for w in model.get_weights()]

# 6. The same with an Embedding (sparse gradients, all-gathered) and a DistributedOptimizer.
x, y = common.embedding_data(r, 10 if r == 0 else 12)
model = common.embedding_model()
optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(common.JOIN_LR))


@tf.function
def sparse_step(xb, yb):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(xb) - yb))
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))


for i in range(0, len(x), common.JOIN_BATCH):
    sparse_step(x[i:i + common.JOIN_BATCH], y[i:i + common.JOIN_BATCH])
payload["sparse_weights"] = [w.tolist() for w in model.get_weights()]


# 7. SyncBatchNormalization between Dense layers, gradients in small buckets: the first bucket (the last
# layers' gradients) must not wait for the layer's backward all-reduce, which the backward pass reaches later.
tfdist.set_bucket_bytes(64, 64)
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(5), hvd.SyncBatchNormalization(momentum=0.5),
                          keras.layers.Dense(3), keras.layers.Dense(1)])
rng = np.random.default_rng(3)
model.set_weights([rng.normal(scale=0.5, size=w.shape).astype("float32") for w in model.get_weights()])
optimizer = keras.optimizers.SGD(0.1)


@tf.function
def bn_step(xb, yb):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
    tape = hvd.DistributedGradientTape(tape)
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))


x, y = common.sync_bn_data()
x, y = x[r * 8:(r + 1) * 8], y[r * 8:(r + 1) * 8]
waits = common.collectives_waited_for(bn_step.get_concrete_function(x, y).graph)
bn_step(x, y)
group_key = {op: int(tf.get_static_value(op.inputs[2])) for op in waits}
last = list(waits)[-1]  # a gradient bucket's all-reduce
buckets = [op for op in waits if group_key[op] == group_key[last]]
lane = [op for op in waits if group_key[op] != group_key[last]]  # the layer's own: forward, then backward
payload["sync_bn_lane"] = {"buckets": len(buckets), "layer_collectives": len(lane)}
if len(lane) == 2:
    payload["sync_bn_lane"].update(first_bucket_waits=lane[1] in waits[buckets[0]],
                                   last_bucket_waits=lane[1] in waits[buckets[-1]])
payload["sync_bn_lane_weights"] = [w.tolist() for w in model.get_weights()]

# 8. hvd.DistributedOptimizer(LossScaleOptimizer) with fp16 compression: scaled gradients (3 * 2**15) would
# overflow float16; the all-reduce carries the unscaled ones, so no step is skipped (as on one device).
variable = keras.Variable(np.array([1.0, 2.0], "float32"))
optimizer = hvd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(
    keras.optimizers.SGD(0.01), initial_scale=2.0**15), compression=hvd.Compression.fp16)
optimizer.build([variable])
for _ in range(2):
    optimizer.apply([tf.constant([3.0, 1.0]) * optimizer.dynamic_scale], [variable])
payload["fp16_loss_scale"] = {"steps": int(optimizer.inner_optimizer.iterations.numpy()),
                              "scale": float(optimizer.dynamic_scale.numpy()), "weights": variable.numpy().tolist()}

# 9. Uneven shards, fit with MetricAverageCallback: rank 0 trains on 8 examples and validates on 6,
# rank 1 on 5 and 3 (2 steps each: batches of 4 and 4, 4 and 1); the averaged figures weigh every example.
x, y = common.join_data(14, 2)
x, y = (x, y) if r == 0 else (x[:5], y[:5])
vx, vy = common.join_data(15, 2)
vx, vy = (vx[:6], vy[:6]) if r == 0 else (vx[:3], vy[:3])
model = linear_model()
model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(common.JOIN_LR)), "mse")
history = model.fit(x, y, batch_size=common.JOIN_BATCH, validation_data=(vx, vy), epochs=1, shuffle=False,
                    verbose=0, callbacks=[hvd.callbacks.MetricAverageCallback()])
payload["averaged_logs"] = {k: v[0] for k, v in history.history.items()}
payload["averaged_weights"] = [w.tolist() for w in model.get_weights()]

# 10. Rank 1 has no validation data (Keras logs no val_ keys there): both ranks log rank 0's val_loss.
model = linear_model()
model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(common.JOIN_LR)), "mse")
history = model.fit(x, y, batch_size=common.JOIN_BATCH, validation_data=(vx[:0], vy[:0]) if r else (vx, vy),
                    epochs=1, shuffle=False, verbose=0, callbacks=[hvd.callbacks.MetricAverageCallback()])
payload["one_validates"] = {k: v[0] for k, v in history.history.items()}
payload["one_validates_own"] = float(model.evaluate(vx, vy, verbose=0)) if r == 0 else None

common.write_result(out_dir, payload)

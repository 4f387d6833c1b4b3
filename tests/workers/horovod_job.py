"""A 2-worker tfdist.horovod job: every collective with rank-distinct inputs, the job's shape,
DistributedOptimizer / DistributedGradientTape against one process, loss scaling that agrees
across processes, and a mismatched all-reduce. tests/test_horovod_multi_worker.py checks it.
"""

import sys
import time

import numpy as np
import tensorflow as tf

import tfdist.horovod as hvd
from tests.workers import common

out_dir = sys.argv[1]
only_0, only_1 = hvd.ProcessSet([0]), hvd.ProcessSet([1])
hvd.init(process_sets=[only_0, only_1])
r = hvd.rank()
payload = {}


def plain(value):
    """JSON-friendly: tensors and arrays as lists, IndexedSlices as (values, indices)."""
    if isinstance(value, tf.IndexedSlices):
        return {"values": value.values.numpy().tolist(), "indices": value.indices.numpy().tolist()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return np.asarray(value).tolist()


# The job's shape and flags ---------------------------------------------------------------------
payload["shape"] = [hvd.size(), hvd.rank(), hvd.local_size(), hvd.local_rank(), hvd.cross_size(), hvd.cross_rank(),
                    hvd.is_homogeneous(), hvd.is_initialized()]
payload["ops"] = plain([hvd.size_op(), hvd.rank_op(), hvd.local_rank_op(), hvd.local_size_op(),
                        hvd.size_op(only_0.process_set_id), hvd.process_set_included_op(only_1.process_set_id)])
payload["flags"] = [hvd.mpi_threads_supported(), hvd.mpi_enabled(), hvd.mpi_built(), hvd.gloo_enabled(),
                    hvd.gloo_built(), hvd.ddl_built(), hvd.ccl_built()]
payload["sets"] = [[s.size(), s.rank(), s.included()] for s in (hvd.global_process_set, only_0, only_1)]

# Collectives, eager ----------------------------------------------------------------------------
x = tf.constant([r + 1.0, 10.0])
ints = tf.constant([r + 1, 5 - r])
payload["allreduce"] = plain([
    hvd.allreduce(x), hvd.allreduce(x, op=hvd.Sum), hvd.allreduce(x, average=False),
    hvd.allreduce(ints, op=hvd.Min), hvd.allreduce(ints, op=hvd.Max), hvd.allreduce(ints, op=hvd.Product),
    hvd.allreduce(tf.constant([2.0 * (r + 1)]), op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0),
])
fp16 = hvd.allreduce(tf.constant([1.0 / 3 + r]), op=hvd.Sum, compression=hvd.Compression.fp16)
payload["allreduce_fp16"] = [fp16.dtype.name, float(fp16.numpy()[0])]
payload["allreduce_sparse"] = plain(hvd.allreduce(tf.IndexedSlices(tf.constant([[r + 1.0]]), tf.constant([r]),
                                                                   tf.constant([2, 1]))))
payload["grouped_allreduce"] = plain(hvd.grouped_allreduce(
    [tf.fill([2, 2], r + 1.0), tf.constant([r], tf.int32), tf.constant(1.5, tf.float64)], op=hvd.Sum))
payload["allgather"] = plain(hvd.allgather(tf.fill([r + 1, 2], r)))
payload["grouped_allgather"] = plain(hvd.grouped_allgather([tf.constant([r]), tf.fill([1 - r, 1], 7.0)]))
payload["broadcast"] = plain(hvd.broadcast(tf.constant([r + 0.5, r]), root_rank=1))
variables = [tf.Variable([r * 1.0, 2.0]), tf.Variable(r + 3, dtype=tf.int64)]
hvd.broadcast_variables(variables, root_rank=1)
payload["broadcast_variables"] = plain([v.numpy() for v in variables])
payload["broadcast_"] = plain(hvd.broadcast_([tf.Variable([r * 5.0])], root_rank=0))
payload["broadcast_object"] = hvd.broadcast_object({"rank": r, "text": "x" * (r + 1)}, root_rank=1)
payload["allgather_object"] = hvd.allgather_object({"rank": r, "items": list(range(r + 1))})
received, splits = hvd.alltoall(tf.range(3) + 10 * r, splits=[1, 2] if r == 0 else [2, 1])
payload["alltoall"] = plain([received, splits])
payload["alltoall_even"] = plain(hvd.alltoall(tf.constant([10 * r, 10 * r + 1])))
rows = tf.reshape(tf.range(6.0), [3, 2]) * (r + 1)
payload["reducescatter"] = plain([hvd.reducescatter(rows, op=hvd.Sum), hvd.reducescatter(rows)])
payload["grouped_reducescatter"] = plain(hvd.grouped_reducescatter([rows, tf.range(2.0) + r], op=hvd.Sum))
payload["join"] = int(hvd.join().numpy())
mine = only_0 if r == 0 else only_1
payload["own_set"] = plain(hvd.allreduce(x, process_set=mine))
try:
    hvd.allreduce(x, process_set=only_1 if r == 0 else only_0)
except ValueError as err:
    payload["other_set_error"] = str(err)


# Collectives inside tf.function, traced once and run twice -------------------------------------
@tf.function
def in_graph(t):
    received, splits = hvd.alltoall(tf.concat([t, t], 0), splits=[2, 2])
    return (hvd.allreduce(t), hvd.allgather(t[:r + 1]), hvd.broadcast(t, root_rank=1), received,
            hvd.reducescatter(t, op=hvd.Sum))


payload["in_graph"] = [plain(in_graph(tf.constant([1.0 + r, 5.0]))) for _ in range(2)]


# Gradients through collectives, as Horovod defines them ------------------------------------------
v = tf.Variable([1.0, 2.0])
with tf.GradientTape(persistent=True) as tape:
    reduced = tf.reduce_sum(hvd.allreduce(v * (r + 1.0)) * (r + 1.0))
    gathered = tf.reduce_sum(hvd.allgather(v[:r + 1]) * tf.range(1.0, 4.0))
    broadcast = tf.reduce_sum(hvd.broadcast(v, root_rank=1) * (r + 1.0))
payload["gradients"] = plain([tape.gradient(reduced, v), tape.gradient(gathered, v), tape.gradient(broadcast, v)])


# Training: 2 processes x batch 8 against one process x batch 16 (tests compute the latter) -------
x_all, y_all = common.regression_data()
half = common.GLOBAL_BATCH // 2
mine = np.concatenate([np.arange(step * common.GLOBAL_BATCH + r * half, step * common.GLOBAL_BATCH + (r + 1) * half)
                       for step in range(common.EQUIVALENCE_STEPS)])
x_mine, y_mine = x_all[mine], y_all[mine]


def fit_with(**options):
    model = common.equivalence_model()
    model.compile(optimizer=hvd.DistributedOptimizer(tf.optimizers.SGD(0.05), **options), loss="mse",
                  experimental_run_tf_function=False)
    micro = half // options.get("backward_passes_per_step", 1)
    model.fit(x_mine, y_mine, batch_size=micro, epochs=1, shuffle=False, verbose=0)
    return [w.tolist() for w in model.get_weights()], int(model.optimizer.iterations.numpy())


payload["optimizer_weights"], payload["optimizer_iterations"] = fit_with()
payload["fp16_weights"], _ = fit_with(compression=hvd.Compression.fp16)
payload["predivide_weights"], _ = fit_with(gradient_predivide_factor=2.0)
payload["accumulated_weights"], payload["accumulated_iterations"] = fit_with(
    backward_passes_per_step=2, average_aggregated_gradients=True)

model = common.equivalence_model()
optimizer = tf.optimizers.SGD(0.05)
loss_fn = tf.keras.losses.MeanSquaredError()


@tf.function
def tape_step(features, targets):
    with tf.GradientTape() as tape:
        loss = loss_fn(targets, model(features, training=True))
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))


for step in range(common.EQUIVALENCE_STEPS):
    tape_step(x_mine[step * half:(step + 1) * half], y_mine[step * half:(step + 1) * half])
payload["tape_weights"] = [w.tolist() for w in model.get_weights()]

# DistributedGradientTape with fp16 on the wire: gradients 1/3 + r, which float16 rounds.
third = tf.Variable([1.0])
with tf.GradientTape() as fp16_tape:
    fp16_loss = third * (1.0 / 3.0 + r)
fp16_tape = hvd.DistributedGradientTape(fp16_tape, compression=hvd.Compression.fp16)
payload["tape_fp16_gradient"] = [float(fp16_tape.gradient(fp16_loss, [third])[0].numpy()[0])]
with tf.GradientTape() as f32_tape:
    f32_loss = third * (1.0 / 3.0 + r)
payload["tape_fp16_gradient"].append(float(hvd.DistributedGradientTape(f32_tape).gradient(f32_loss, [third])[0][0]))


# Loss scaling: a gradient overflow on rank 1 only makes both ranks skip the step ---------------
tf.keras.mixed_precision.set_global_policy("mixed_float16")
scaled = tf.keras.Sequential([tf.keras.Input((6,)), tf.keras.layers.Dense(4),
                              tf.keras.layers.Dense(1, dtype="float32")])
scaled.set_weights([np.full(w.shape, 0.1, "float32") for w in scaled.get_weights()])
scaled.compile(optimizer=hvd.DistributedOptimizer(tf.optimizers.SGD(0.01)), loss="mse")
x_scaled = np.ones((4, 6), "float32")
if r == 1:
    x_scaled[2:] = 6e4  # float16 overflows in rank 1's second batch only
scaled.fit(x_scaled, np.zeros((4, 1), "float32"), batch_size=2, shuffle=False, verbose=0)
tf.keras.mixed_precision.set_global_policy("float32")
payload["loss_scale"] = [float(scaled.optimizer.dynamic_scale.numpy()), int(scaled.optimizer.iterations.numpy()),
                         bool(all(np.isfinite(w).all() for w in scaled.get_weights()))]
payload["loss_scale_weights"] = [w.tolist() for w in scaled.get_weights()]

# A mismatched all-reduce fails on every rank, quickly, and leaves the job usable -----------------
start = time.perf_counter()
try:
    hvd.allreduce(tf.ones([r + 2]))
except ValueError as err:
    payload["mismatch"] = [type(err).__name__, str(err), time.perf_counter() - start]
payload["after_mismatch"] = plain(hvd.allreduce(tf.constant(1.0), op=hvd.Sum))

# Step counts K does not divide, with DistributedOptimizer ----------------------------------------
payload["step_counts"] = {str(k): common.step_counts(steps_per_execution=k, wrap_optimizer=hvd.DistributedOptimizer)
                          for k in (1, 4)}
common.write_result(out_dir, payload)

"""Runs one equivalence cell: train distributed and on one device, in the same process, and measure.

Single-process modes train on a MirroredStrategy over this process's 2 logical CPUs; the
tfdist.horovod modes train on this worker's share of each global batch (2 workers). Either
way the reference trains the same model from the same initial weights, with the same
optimizer settings, on ONE device, on the whole global batch of every step. Custom loops take
their loss from ``tfdist.compute_average_loss`` (which needs no global batch size), so on a
batch split unevenly over replicas or ranks every example weighs as on one device, in
tfdist.horovod too (Horovod itself averages each rank's mean gradient; ``hvd.DistributedOptimizer``
still does under Keras' gradient accumulation).
"""

from __future__ import annotations

import functools
import re

import keras
import numpy as np
import tensorflow as tf

import tfdist
from tests.equivalence import matrix
from tests.equivalence.matrix import Cell
from tfdist import sharding

GLOBAL_BATCH = 8
NUM_BATCHES = 4
LAST_BATCH = 5  # partial_split and uneven_worker: the last global batch
# how each global batch splits over 2 replicas / workers
SPLITS = {"even": [(4, 4)] * NUM_BATCHES,
          "partial_split": [(4, 4)] * (NUM_BATCHES - 1) + [(3, 2)],
          "uneven_worker": [(4, 4)] * (NUM_BATCHES - 1) + [(4, 1)]}
VOCABULARY = 10
BUCKETS = {"default": (tfdist.buckets.DEFAULT_BUCKET_BYTES, tfdist.buckets.DEFAULT_FIRST_BUCKET_BYTES),
           "tiny": (64, 64), "0": (0, 0)}
# The explicit LossScaleOptimizer's start. 2^22 overflows float16 only on the wire (gradients are float32
# sums there), so one device never skips a step. Under mixed_float16, whether a float16 batch sum overflows
# depends on how many examples it adds (8 on one device, 4 per replica): which steps skip would depend on the
# split, so there the scale (and Keras' default 2^15 in fit) stays far below overflow (the small output
# layer keeps float16 gradients near 100).
LOSS_SCALE = {"mixed_float16": 2.0 ** 15}
WIRE_OVERFLOWING_LOSS_SCALE = 2.0 ** 22


def make_data(cell: Cell):
    """(x, y, w, sizes): examples in step order, each step's global batch its rank-0 part then its rank-1 part."""
    sizes = SPLITS[cell.batches]
    total = sum(map(sum, sizes))
    rng = np.random.default_rng(7)
    if cell.inputs == "embedding":
        x = rng.integers(0, VOCABULARY, size=(total, 2)).astype("int32")
    else:
        x = rng.normal(size=(total, 4)).astype("float32")
    y = rng.normal(scale=0.1, size=(total, 1)).astype("float32")
    w = rng.uniform(0.5, 2.0, size=total).astype("float32") if cell.inputs == "sample_weights" else np.ones(total, "float32")
    return x, y, w, sizes


def build_model(cell: Cell) -> keras.Model:
    if cell.inputs == "embedding":
        inputs = keras.Input((2,), dtype="int32")
        hidden = keras.layers.Flatten()(keras.layers.Embedding(VOCABULARY, 3, name="embed")(inputs))
    else:
        inputs = hidden = keras.Input((4,))
    hidden = keras.layers.Dense(6, activation="tanh", name="first")(hidden)
    wide = "float64" if cell.precision == "float64_layer" else None
    hidden = keras.layers.Dense(5, activation="tanh", name="wide", dtype=wide)(hidden)
    small = keras.initializers.RandomNormal(stddev=0.05)
    outputs = keras.layers.Dense(1, name="out", dtype="float32", kernel_initializer=small)(hidden)
    return keras.Model(inputs, outputs)


def make_optimizer(cell: Cell) -> keras.optimizers.Optimizer:
    """The cell's optimizer, before any distribution wrapper."""
    def sgd(**options):
        return keras.optimizers.SGD(0.05, momentum=0.9, **options)

    kind = cell.optimizer
    if kind == "adam":
        return keras.optimizers.Adam(0.01)
    if kind == "multi_optimizer":
        return keras.optimizers.MultiOptimizer(keras.optimizers.OptimizerMap(sgd(), {".*first.*": keras.optimizers.Adam(0.01)}))
    if kind == "loss_scale":
        return keras.optimizers.LossScaleOptimizer(sgd(), initial_scale=_initial_scale(cell))
    options = {"sgd_momentum": {}, "clipnorm": {"clipnorm": 0.05}, "clipvalue": {"clipvalue": 0.02},
               "global_clipnorm": {"global_clipnorm": 0.05},
               "use_ema": {"use_ema": True, "ema_momentum": 0.5, "ema_overwrite_frequency": 2},
               "accumulation": {"gradient_accumulation_steps": 2}, "loss_scale_factor": {"loss_scale_factor": 64.0}}
    return sgd(**options[kind])


def _initial_scale(cell: Cell) -> float:
    return LOSS_SCALE.get(cell.precision, WIRE_OVERFLOWING_LOSS_SCALE)


def _compression(cell: Cell):
    return tfdist.Compression.fp16 if cell.wire == "fp16" else tfdist.Compression.none


def distribute_optimizer(cell: Cell, optimizer):
    """The wrapper the user applies in ``cell.mode`` (none for Keras fit without a compressed wire)."""
    import tfdist.horovod as hvd

    if cell.mode == "hvd_fit":
        return hvd.DistributedOptimizer(optimizer, compression=_compression(cell),
                                        shard_optimizer_state=cell.state == "sharded")
    if cell.mode.startswith("hvd_tape"):
        return optimizer
    if cell.mode in matrix.FIT_MODES and cell.wire == "none":
        return optimizer
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return keras.optimizers.LossScaleOptimizer(
            tfdist.DistributedOptimizer(optimizer.inner_optimizer, compression=_compression(cell)),
            initial_scale=_initial_scale(cell))
    return tfdist.DistributedOptimizer(optimizer, compression=_compression(cell))


def _squared_errors(y, prediction):
    return tf.reduce_mean(tf.square(tf.cast(prediction, tf.float32) - y), axis=-1)


def make_step(model, optimizer, tape_wrapper=None, strategy=None, function=True):
    """One training step of a custom loop: ``tfdist.compute_average_loss`` (sum(w * loss) / the global batch's
    size, however it split), scaled, differentiated, applied."""
    def replica_step(x, y, w):
        with tf.GradientTape() as tape:
            loss = tfdist.compute_average_loss(_squared_errors(y, model(x, training=True)), sample_weight=w)
            scaled = optimizer.scale_loss(loss)
        if tape_wrapper is not None:
            tape = tape_wrapper(tape)
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    if strategy is not None:
        def step(x, y, w):
            strategy.run(replica_step, args=(x, y, w))
    else:
        step = replica_step
    return tf.function(step) if function else step


def _batches(x, y, w, sizes):
    """(x, y, w) per global batch."""
    start = 0
    for size in map(sum, sizes):
        yield x[start:start + size], y[start:start + size], w[start:start + size]
        start += size


def train_reference(cell: Cell, initial, x, y, w, sizes):
    """One device, the whole global batch each step: ``fit`` or a custom loop as in ``cell.mode``, eagerly."""
    model = build_model(cell)
    model.set_weights(initial)
    optimizer = make_optimizer(cell)
    if cell.mode in (*matrix.FIT_MODES, "hvd_fit"):
        model.compile(optimizer=optimizer, loss="mse", run_eagerly=True)
        model.fit(tf.data.Dataset.from_tensor_slices((x, y, w)).batch(GLOBAL_BATCH), epochs=1, verbose=0)
    else:
        optimizer.build(model.trainable_variables)
        step = make_step(model, optimizer, function=False)
        for batch in _batches(x, y, w, sizes):
            step(*batch)
    return model, _trained_by(model, optimizer)


def train_mirrored(cell: Cell, strategy, initial, x, y, w):
    """fit or a custom loop on ``strategy`` (data_parallel: keras.distribution's DataParallel over its devices);
    tf.data splits each global batch over the replicas."""
    dataset = tf.data.Dataset.from_tensor_slices((x, y, w)).batch(GLOBAL_BATCH)
    with _scope(cell, strategy), sharding.scoped(cell.state == "sharded"):  # as tfdist.scope(shard_optimizer_state=)
        model = build_model(cell)
        model.set_weights(initial)
        optimizer = distribute_optimizer(cell, make_optimizer(cell))
        if cell.mode in matrix.FIT_MODES:
            model.compile(optimizer=optimizer, loss="mse")
        else:
            optimizer.build(model.trainable_variables)
    if cell.mode in matrix.FIT_MODES:
        assert model.distribute_strategy.num_replicas_in_sync == 2, model.distribute_strategy
        model.fit(dataset, epochs=1, verbose=0)
    else:
        step = make_step(model, optimizer, strategy=strategy)
        for batch in strategy.experimental_distribute_dataset(dataset):
            step(*batch)
    return model, _trained_by(model, optimizer)


def _scope(cell: Cell, strategy):
    """Where the model is built: the strategy's scope, or keras.distribution's DataParallel over its devices."""
    if cell.mode != "data_parallel":
        return strategy.scope()
    devices = [d.rsplit("device:", 1)[1].lower() for d in strategy.extended.worker_devices]
    return keras.distribution.DataParallel(devices=devices).scope()


def rank_share(x, y, w, sizes, rank: int):
    """This rank's examples: its part of every global batch, in order."""
    parts, start = [], 0
    for split in sizes:
        parts.append(slice(start + sum(split[:rank]), start + sum(split[:rank + 1])))
        start += sum(split)
    take = np.concatenate([np.arange(len(x))[s] for s in parts])
    return x[take], y[take], w[take]


def horovod_weights(w, sizes, ranks: int = 2):
    """The reference's example weights that make one device's mean gradient Horovod's mean of rank means: what
    ``hvd.DistributedOptimizer`` keeps under Keras' gradient accumulation (no count per micro-batch)."""
    factors = np.concatenate([np.full(part, sum(split) / (ranks * part), "float32")
                              for split in sizes for part in split if part])
    return w * factors


def train_horovod(cell: Cell, initial, x, y, w, sizes):
    import tfdist.horovod as hvd

    rank = hvd.rank()
    mine = rank_share(x, y, w, sizes, rank)
    local_batch = max(split[rank] for split in sizes)
    model = build_model(cell)
    model.set_weights(initial)
    optimizer = distribute_optimizer(cell, make_optimizer(cell))
    if cell.mode == "hvd_fit":
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(tf.data.Dataset.from_tensor_slices(mine).batch(local_batch), epochs=1, verbose=0)
        return model, model.optimizer
    optimizer.build(model.trainable_variables)
    step = make_step(model, optimizer, function=cell.mode == "hvd_tape_function",
                     tape_wrapper=lambda tape: hvd.DistributedGradientTape(tape, compression=_compression(cell)))
    start = 0
    for split in sizes:
        part = split[rank]
        step(*(array[start:start + part] for array in mine))
        start += part
    return model, optimizer


def _trained_by(model, optimizer):
    """The optimizer that trained: ``fit``'s (Keras may have wrapped it in a LossScaleOptimizer), else ours."""
    return getattr(model, "optimizer", None) or optimizer


def _iterations(optimizer) -> int:
    return int(optimizer.iterations.numpy())


def _loss_scale(optimizer) -> float | None:
    return float(optimizer.dynamic_scale.numpy()) if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) else None


def run(cell: Cell, strategy=None, reference: bool = True) -> dict:
    """Trains ``cell`` distributed and (with ``reference``) on one device; returns what ``matrix.judge`` reads.

    In a 2-worker job only rank 0 needs the reference; every rank returns its weights.
    """
    tfdist.set_bucket_bytes(*BUCKETS[cell.buckets])
    keras.config.set_dtype_policy("float32" if cell.precision == "float64_layer" else cell.precision)
    try:
        x, y, w, sizes = make_data(cell)
        keras.utils.set_random_seed(0)
        initial = build_model(cell).get_weights()
        keeps_horovods = cell.mode == "hvd_fit" and cell.optimizer == "accumulation"
        train_one_device = functools.partial(train_reference, cell, initial, x, y,
                                             horovod_weights(w, sizes) if keeps_horovods else w, sizes)
        try:
            if cell.multi_worker:
                model, optimizer = train_horovod(cell, initial, x, y, w, sizes)
            else:
                model, optimizer = train_mirrored(cell, strategy, initial, x, y, w)
        except Exception as error:
            by_design = matrix.expected_error(cell)
            if reference and not (by_design and re.search(by_design, str(error))):  # a refusal needs no reference
                _fails_on_one_device_too(train_one_device, error)
            raise
        if reference:
            try:
                expected, expected_optimizer = train_one_device()
            except Exception as alone:  # noqa: BLE001  (tfdist trained it: Keras' own limit, no reference)
                raise FailsOnOneDeviceToo(f"{type(alone).__name__} on one device {matrix.DISTRIBUTED_TRAINED}: "
                                          f"{alone}") from alone
    finally:
        keras.config.set_dtype_policy("float32")
    weights = _flat(model.get_weights())
    record = {"status": "ok", "weights": weights.tolist(), "finite": bool(np.all(np.isfinite(weights))),
              "iterations": _iterations(optimizer), "loss_scale": _loss_scale(optimizer)}
    if reference:
        start = _flat(initial)
        update, expected_update = weights - start, _flat(expected.get_weights()) - start
        scale = np.linalg.norm(expected_update)
        record.update(difference=float(np.linalg.norm(update - expected_update) / (scale if scale > 0 else 1.0)),
                      reference_iterations=_iterations(expected_optimizer),
                      reference_loss_scale=_loss_scale(expected_optimizer))
    return record


class FailsOnOneDeviceToo(Exception):
    """The cell's training fails on one device as well: Keras' own limit, not the distribution's."""


def _fails_on_one_device_too(train_one_device, error: Exception) -> None:
    """Raises ``FailsOnOneDeviceToo`` (naming ``error``) when one device fails too; returns otherwise."""
    try:
        train_one_device()
    except Exception as alone:  # noqa: BLE001
        raise FailsOnOneDeviceToo(f"{type(alone).__name__} on one device too: {alone}") from error


def _flat(weights) -> np.ndarray:
    return np.concatenate([np.ravel(v).astype("float64") for v in weights])

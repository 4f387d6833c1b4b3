"""Horovod-style helpers in one process: 2 logical CPUs (mirrored), argument checks, atomic saves."""

import itertools
import json
import os
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.jobs import REPO, job_env
from tests.workers import common
from tfdist import atomic_files, callbacks, collectives, keras_fixes

NON_CHIEF = json.dumps({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "worker", "index": 1}})

_key_bases = itertools.count(1)


@pytest.fixture
def mirrored(fresh_tfdist_strategy, monkeypatch):
    """2 replicas on logical CPUs, with collective keys no other strategy in this process uses.

    Every MirroredStrategy starts its collective group keys at 1 + _collective_key_base, so
    two strategies in one process that run collectives of different dtypes clash
    ("Collective instance 100 expected ... data_type 2 but got ... 1"); TF's own tests
    move the base the same way.
    """
    monkeypatch.setattr(tf.distribute.MirroredStrategy, "_collective_key_base", 1000 * next(_key_bases))
    return tfdist.get_strategy("mirrored", devices="CPU:[0-1]")


def train_accumulated(strategy, optimizer, steps, micro_batch, examples):
    with strategy.scope():
        model = common.equivalence_model()
        model.compile(optimizer=tfdist.DistributedOptimizer(optimizer, steps), loss="mse")
    x, y = common.regression_data(examples)
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(micro_batch), epochs=1, verbose=0)
    return model


def assert_close(got, want, atol=1e-6):
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=atol)


# Collectives -------------------------------------------------------------------------------

def test_collectives_count_each_worker_once_with_two_replicas(mirrored):
    assert tfdist.allreduce(3) == 3.0
    assert tfdist.allreduce(3, op="sum") == 3  # two replicas, one worker
    np.testing.assert_array_equal(tfdist.allreduce(np.arange(4), op="sum"), np.arange(4))
    assert tfdist.allgather(5) == [5]
    np.testing.assert_array_equal(tfdist.allgather(np.ones((2, 3))), np.ones((2, 3)))
    result = tfdist.broadcast(tf.constant([1.5, np.nan]))
    assert isinstance(result, tf.Tensor) and result.numpy()[0] == 1.5 and np.isnan(result.numpy()[1])


def test_collective_arguments_are_checked(mirrored):
    with pytest.raises(ValueError, match=r"allreduce op must be one of \('mean', 'sum'\); received op='max'"):
        tfdist.allreduce(1.0, op="max")
    with pytest.raises(ValueError, match=r"root_rank=1 is not among the ranks taking part, \[0\]; pass one of them"):
        tfdist.broadcast(1.0, root_rank=1)
    with pytest.raises(TypeError, match="take a number, NumPy array or tensor; received str"):
        collectives.allreduce("1.0")


# DistributedOptimizer ----------------------------------------------------------------------

@pytest.mark.parametrize("make_optimizer, steps", [
    (lambda: keras.optimizers.SGD(learning_rate=0.05), 2),
    (lambda: keras.optimizers.Adam(learning_rate=0.01, weight_decay=0.1, global_clipnorm=1.0), 4),
])
def test_accumulation_under_mirrored_equals_large_batch_steps(mirrored, make_optimizer, steps):
    examples = 3 * steps * common.GLOBAL_BATCH  # 3 updates
    # One device: Keras' own path clips per-replica gradients before the all-reduce, so a
    # mirrored big-batch run is not the reference when clipping; accumulation clips the sum.
    one_device = tf.distribute.OneDeviceStrategy("CPU:0")
    reference = train_accumulated(one_device, make_optimizer(), 1, common.GLOBAL_BATCH * steps, examples)
    model = train_accumulated(mirrored, make_optimizer(), steps, common.GLOBAL_BATCH, examples)
    assert int(model.optimizer.iterations.numpy()) == 3
    assert int(model.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy())
    assert_close(model.get_weights(), reference.get_weights(), atol=2e-6)


def test_accumulation_keeps_each_replicas_sum_until_the_one_all_reduce(mirrored):
    """After 1 of 2 micro-batches each replica's accumulator holds its own gradient: nothing was all-reduced."""
    with mirrored.scope():
        model = common.equivalence_model()
        model.compile(optimizer=tfdist.DistributedOptimizer(keras.optimizers.SGD(0.05), 2), loss="mse")
    x, y = common.regression_data(common.GLOBAL_BATCH)
    model.fit(x, y, batch_size=common.GLOBAL_BATCH, epochs=1, verbose=0, shuffle=False)  # one micro-batch
    accumulator = model.optimizer._accumulated_gradients[0].value
    first, second = (v.numpy() for v in mirrored.experimental_local_results(accumulator))
    assert not np.allclose(first, second)
    assert int(model.optimizer.iterations.numpy()) == 0


@pytest.mark.parametrize("steps", [1, 2])
def test_fp16_compression_stays_within_1e3_of_float32(mirrored, steps):
    examples = 3 * steps * common.GLOBAL_BATCH
    exact = train_accumulated(mirrored, keras.optimizers.SGD(0.05), steps, common.GLOBAL_BATCH, examples)
    with mirrored.scope():
        model = common.equivalence_model()
        model.compile(optimizer=tfdist.DistributedOptimizer(
            keras.optimizers.SGD(0.05), steps, compression=tfdist.compression.Compression.fp16), loss="mse")
    x, y = common.regression_data(examples)
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(common.GLOBAL_BATCH), epochs=1, verbose=0)
    assert_close(model.get_weights(), exact.get_weights(), atol=1e-3)
    assert not all(np.array_equal(a, b) for a, b in zip(model.get_weights(), exact.get_weights()))


def test_accumulation_composes_with_loss_scaling(mirrored):
    with mirrored.scope():
        inner = tfdist.DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.05), 2)
        model = common.equivalence_model()
        model.compile(optimizer=keras.optimizers.LossScaleOptimizer(inner), loss="mse")
    x, y = common.regression_data()
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(common.GLOBAL_BATCH // 2), epochs=1, verbose=0)
    assert_close(model.get_weights(), common.train_equivalence(), atol=1e-5)


def test_without_the_fix_keras_own_accumulation_fails_under_a_strategy(mirrored, monkeypatch):
    """If this starts passing, keras#20582 is fixed and tfdist.keras_fixes.accumulation can go."""
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    monkeypatch.setattr(BaseOptimizer, "_backend_apply_gradients",
                        keras_fixes.original_of(BaseOptimizer._backend_apply_gradients))
    with mirrored.scope():
        model = common.equivalence_model()
        model.compile(optimizer=keras.optimizers.SGD(gradient_accumulation_steps=2), loss="mse")
    x, y = common.regression_data(32)
    with pytest.raises(Exception, match="merge_call. called while defining a new graph"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)


def test_distributed_optimizer_is_the_same_keras_class_and_saves_as_it(tmp_path):
    optimizer = tfdist.DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.05), backward_passes_per_step=3)
    assert isinstance(optimizer, keras.optimizers.SGD) and optimizer.tfdist_distributed
    assert optimizer.backward_passes_per_step == 3 and optimizer.learning_rate.numpy() == pytest.approx(0.05)
    model = common.equivalence_model()
    model.compile(optimizer=optimizer, loss="mse")
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras").optimizer
    assert type(loaded) is keras.optimizers.SGD and loaded.gradient_accumulation_steps == 3


def test_distributed_optimizer_arguments_are_checked():
    with pytest.raises(TypeError, match="wraps a keras.optimizers.Optimizer; received str"):
        tfdist.DistributedOptimizer("sgd")
    with pytest.raises(ValueError, match="backward_passes_per_step must be an int >= 1; received backward_passes_per_step=0"):
        tfdist.DistributedOptimizer(keras.optimizers.SGD(), 0)
    with pytest.raises(TypeError, match="compression must be Compression.none, Compression.fp16 or an object"):
        tfdist.DistributedOptimizer(keras.optimizers.SGD(), compression="fp16")
    with pytest.raises(ValueError, match="already has gradient_accumulation_steps=2, but backward_passes_per_step=3"):
        tfdist.DistributedOptimizer(keras.optimizers.SGD(gradient_accumulation_steps=2), 3)
    built = keras.optimizers.SGD()
    built.build([keras.Variable(1.0)])
    with pytest.raises(ValueError, match="needs an unbuilt optimizer"):
        tfdist.DistributedOptimizer(built)


# Learning rate, verbose, print ---------------------------------------------------------------

class LearningRates(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.seen = []

    def on_train_batch_begin(self, batch, logs=None):
        self.seen.append(float(self.model.optimizer.learning_rate.numpy()))


def fit_recording(strategy, schedule, epochs=2, steps=4, dataset=None):
    with strategy.scope():
        model = common.equivalence_model()
    x, y = common.regression_data(16 * steps)
    recorder = LearningRates()
    model.fit(dataset or tf.data.Dataset.from_tensor_slices((x, y)).batch(16), epochs=epochs, verbose=0,
              callbacks=[schedule, recorder])
    return recorder.seen, model


def test_warmup_with_two_replicas_starts_at_half_and_prints_on_chief(mirrored, capsys):
    seen, model = fit_recording(mirrored, callbacks.LearningRateWarmupCallback(0.2, warmup_epochs=1, verbose=1),
                                epochs=2, steps=4)
    np.testing.assert_allclose(seen, [0.1, 0.125, 0.15, 0.175, 0.2, 0.2, 0.2, 0.2], rtol=1e-6)
    assert "Epoch 1: finished gradual learning rate warmup to 0.2." in capsys.readouterr().out


def test_smooth_schedule_uses_the_fractional_epoch():
    schedule = callbacks.LearningRateScheduleCallback(0.1, multiplier=lambda epoch: 1 + epoch, staircase=False,
                                                      end_epoch=1)
    seen, _ = fit_recording(tf.distribute.get_strategy(), schedule, epochs=2, steps=2)
    np.testing.assert_allclose(seen, [0.1, 0.15, 0.15, 0.15], rtol=1e-6)


def test_schedule_arguments_are_checked():
    with pytest.raises(ValueError, match="initial_lr must be a positive number; received initial_lr=0"):
        callbacks.LearningRateScheduleCallback(0, 1.0)
    with pytest.raises(ValueError, match="end_epoch must be after start_epoch; received start_epoch=3, end_epoch=2"):
        callbacks.LearningRateScheduleCallback(0.1, 1.0, start_epoch=3, end_epoch=2)
    with pytest.raises(ValueError, match="warmup_epochs must be an int >= 1; received warmup_epochs=0"):
        callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=0)
    x, y = common.regression_data(32)
    unknown_length = tf.data.Dataset.from_tensor_slices((x, y)).batch(16).filter(lambda a, b: True)
    with pytest.raises(ValueError, match="needs steps_per_epoch, and fit does not know it"):
        fit_recording(tf.distribute.get_strategy(), callbacks.LearningRateWarmupCallback(0.1), dataset=unknown_length)


def test_schedule_refuses_an_optimizer_with_its_own_schedule():
    model = common.equivalence_model()
    model.compile(optimizer=keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)), loss="mse")
    x, y = common.regression_data(16)
    with pytest.raises(ValueError, match="sets the learning rate itself, but the optimizer uses the schedule"):
        model.fit(x, y, verbose=0, callbacks=[callbacks.LearningRateScheduleCallback(0.1, 0.5)])


def test_scale_lr_verbose_and_print(mirrored, monkeypatch, capsys):
    assert tfdist.scale_lr(0.1) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="scale_lr needs a positive learning rate; received lr=-1"):
        tfdist.scale_lr(-1)
    assert tfdist.verbose() == 1 and tfdist.verbose("auto") == "auto"
    tfdist.print("from the chief")
    monkeypatch.setenv("TF_CONFIG", NON_CHIEF)
    assert tfdist.verbose() == 0
    tfdist.print("from a non-chief")
    assert capsys.readouterr().out == "from the chief\n"


# Throughput -----------------------------------------------------------------------------------

@pytest.mark.parametrize("batch_size", [16, None], ids=["given", "counted"])
def test_throughput_measures_a_known_step_time(batch_size):
    """Each step takes at least 50 ms (a sleeping callback): the rate is 16 examples per step time."""
    model = common.equivalence_model()
    x, y = common.regression_data(16 * 6)
    slow = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: time.sleep(0.05))
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0,
                        callbacks=[slow, callbacks.Throughput(batch_size, verbose=0)])
    rate, step = history.history["examples_per_sec"][0], history.history["step_time_sec"][0]
    assert 0.05 <= step < 0.5
    assert rate == pytest.approx(16 / step, rel=1e-6)


def test_throughput_asks_for_batch_size_when_it_cannot_count():
    class NoLossTracking(keras.Sequential):
        def train_step(self, data):
            return {"zero": tf.constant(0.0)}

    model = NoLossTracking([keras.Input((6,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = common.regression_data(32)
    with pytest.raises(ValueError, match=r"pass Throughput\(batch_size=GLOBAL_BATCH\)"):
        model.fit(x, y, batch_size=16, verbose=0, callbacks=[callbacks.Throughput()])


# Checkpoints -----------------------------------------------------------------------------------

def test_a_save_killed_midway_leaves_the_previous_complete_file(tmp_path):
    path, first = tmp_path / "ckpt.keras", tmp_path / "first.npy"
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "workers" / "interrupted_save.py"), str(path), str(first)],
                          env=job_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-3000:]
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    assert len(leftovers) == 1  # the half-written temporary file
    loaded = keras.saving.load_model(path)
    np.testing.assert_array_equal(np.concatenate([w.ravel() for w in loaded.get_weights()]), np.load(first))
    atomic_files.atomic_write(lambda p: loaded.save(p), str(path))  # the next save clears the leftover
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.keras", "first.npy"]


def test_checkpoint_paths_are_checked(tmp_path):
    (tmp_path / "dir.keras").mkdir()
    model = common.equivalence_model()
    x, y = common.regression_data(16)
    with pytest.raises(IsADirectoryError, match="is an existing directory; add a file name"):
        model.fit(x, y, verbose=0, callbacks=[callbacks.ModelCheckpoint(str(tmp_path / "dir.keras"))])

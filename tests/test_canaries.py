"""Canaries: tfdist replaces or overrides Keras and TensorFlow internals. A recorded signature
guards each (``tfdist.patching``); these tests fail if Keras still has the method but stops
calling it, so a fix would silently do nothing. When one fails after a Keras upgrade, read
what Keras does now before touching the fix.
"""

import keras
import pytest
import tensorflow as tf

import tfdist.horovod as hvd
from tests.workers import common
from tfdist import keras_fixes, optimizer as optimizer_lib, precision, sharding, strategy as strategy_lib, tf_fixes
from tfdist.horovod import optimizer as horovod_optimizer


def replacements(patches):
    return [(patch, r) for patch in patches for r in patch.replacements if r.function is not None]


def test_every_keras_fix_runs_in_a_users_fit(tmp_path, restore_dtype_policy):
    """A mixed-precision fit under 2 mirrored replicas, K=2 steps per call, moving averages (sharded), Keras' file,
    early-stopping and EMA-swapping callbacks, then evaluate and predict, and an async checkpoint: every replaced
    internal is called."""
    patches = [*keras_fixes.PATCHES, tf_fixes.patch, tf_fixes.multi_device_input]
    patches = [p for p in patches if not p.name.startswith("keras_distribution")]  # test_keras_distribution's
    for _, replacement in replacements(patches):
        replacement.calls = 0
    precision.set_policy("mixed_float16")
    strategy = strategy_lib.make_strategy("mirrored", devices="CPU:[0-1]")
    with strategy.scope(), sharding.scoped(True):  # the optimizer's state sharded over the 2 replicas
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.BatchNormalization(synchronized=True),
                                  keras.layers.Dense(1, dtype="float32")])
        model.compile(keras.optimizers.SGD(0.05, momentum=0.5, use_ema=True, ema_overwrite_frequency=2), "mse",
                      steps_per_execution=2)
    x, y = common.regression_data(16 * 5)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    model.fit(data, epochs=2, verbose=0, validation_data=data, callbacks=[
        keras.callbacks.ModelCheckpoint(str(tmp_path / "m.keras")),
        keras.callbacks.BackupAndRestore(str(tmp_path / "backup")),
        keras.callbacks.TensorBoard(str(tmp_path / "tb")),
        keras.callbacks.CSVLogger(str(tmp_path / "log.csv")),
        keras.callbacks.EarlyStopping(monitor="loss", patience=5),
        keras.callbacks.ReduceLROnPlateau(monitor="loss", patience=5),
        keras.callbacks.SwapEMAWeights(swap_on_epoch=True)])
    model.evaluate(data, verbose=0)
    model.predict(data, verbose=0)
    model.load_weights(str(tmp_path / "m.keras"))  # the sharded slots saved whole, loaded back into shards
    model.save_weights(str(tmp_path / "m.weights.h5"))  # (BackupAndRestore of sharded state writes no h5)
    with strategy.scope():  # TensorFlow's async checkpoint copies each variable to the host (not sharded slots yet)
        plain = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
    checkpoint = tf.train.Checkpoint(model=plain)
    checkpoint.save(str(tmp_path / "async"), options=tf.train.CheckpointOptions(enable_async=True))
    checkpoint.sync()
    never = [f"{patch.name}: {getattr(r.owner, '__name__', r.owner)}.{r.attribute}"
             for patch, r in replacements(patches) if r.calls == 0]
    assert never == []


def spy(monkeypatch, owner, name: str) -> list:
    """Counts calls of ``owner.name`` (a tfdist override) while a test runs; returns the call log."""
    calls, original = [], getattr(owner, name)

    def counting(self, *args, **kwargs):
        calls.append(name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, counting)
    return calls


def test_keras_calls_what_distributed_optimizer_overrides(monkeypatch):
    calls = spy(monkeypatch, optimizer_lib._DistributedMixin, "_all_reduce_sum_gradients")
    with strategy_lib.make_strategy("mirrored", devices="CPU:[0-1]").scope():
        model = common.equivalence_model()
        model.compile(optimizer_lib.DistributedOptimizer(keras.optimizers.SGD(0.05)),
                      loss="mse")
    x, y = common.regression_data()
    model.fit(x, y, batch_size=common.GLOBAL_BATCH, verbose=0)
    assert calls


def test_keras_calls_what_horovods_distributed_optimizer_overrides(monkeypatch):
    calls = spy(monkeypatch, horovod_optimizer._AllReduceBeforeUpdate, "_clip_gradients")
    hvd.init()
    try:
        model = common.equivalence_model()
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
        x, y = common.regression_data()
        model.fit(x, y, batch_size=common.GLOBAL_BATCH, verbose=0)
    finally:
        hvd.shutdown()
    assert calls  # traced into the train step, which every update runs


def test_a_changed_internal_refuses_to_build_the_optimizer(monkeypatch):
    """The guard of an override can fail: a Keras whose method takes other parameters."""
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    from tfdist.errors import KerasCompatibilityError
    from tfdist.patching import KerasCompatibilityWarning, Patch

    guard = Patch("demo_override", "demo", without="gradients would not be reduced.")
    guard.overrides(BaseOptimizer, "_clip_gradients", ("self", "grads", "extra"))
    monkeypatch.setattr(horovod_optimizer._AllReduceBeforeUpdate, "keras_internals", guard)
    monkeypatch.setattr(optimizer_lib, "_classes", {})
    with pytest.warns(KerasCompatibilityWarning), pytest.raises(
            KerasCompatibilityError, match=r"BaseOptimizer._clip_gradients takes \('self', 'grads'\), tfdist expects "
                                           r"\('self', 'grads', 'extra'\)\. Without them, gradients would not be "
                                           r"reduced\. Install Keras 3\.10 to 3\.15"):
        optimizer_lib._distributed_class(keras.optimizers.SGD, horovod_optimizer._AllReduceBeforeUpdate)

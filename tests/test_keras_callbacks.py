"""Keras' own callbacks under MirroredStrategy (2 logical CPUs, one process), and the patch checks.

The multi-worker side runs as real jobs in tests/test_user_scripts.py and test_faults.py.
"""

import os
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.workers import common
from tfdist import keras_fixes
from tfdist import patching, strategy as strategy_lib


@pytest.fixture
def mirrored():
    return strategy_lib.make_strategy("mirrored", devices="CPU:[0-1]")


class Interrupt(keras.callbacks.Callback):
    """Records the (epoch, batch) steps trained; raises after batch ``at[1]`` of epoch ``at[0]``."""

    def __init__(self, at=None):
        super().__init__()
        self.at, self.steps = at, []

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self.steps.append((self.epoch, batch))

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise RuntimeError("preempted")


def fit(strategy, callbacks, epochs=3):
    with strategy.scope():
        model = common.equivalence_model()
    x, y = common.regression_data(64)
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), epochs=epochs, verbose=0, callbacks=callbacks)
    return model


@pytest.mark.parametrize("devices", [None, "CPU:[0-1]"], ids=["one-device", "mirrored-2"])
@pytest.mark.parametrize("save_freq, resumed_at", [(2, (1, 2)), ("epoch", (1, 0))])
def test_backup_and_restore_resumes_where_the_backup_was_taken(devices, tmp_path, save_freq, resumed_at):
    """A backup every 2 batches resumes at the next batch of the cut epoch; per epoch, at its start."""
    strategy = strategy_lib.make_strategy("mirrored", devices=devices) if devices else tf.distribute.get_strategy()
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="preempted"):
        fit(strategy, [keras.callbacks.BackupAndRestore(backup, save_freq=save_freq), Interrupt(at=(1, 2))])
    resumed = Interrupt()
    model = fit(strategy, [keras.callbacks.BackupAndRestore(backup, save_freq=save_freq), resumed])
    epoch, batch = resumed_at
    assert resumed.steps == [(epoch, b) for b in range(batch, 4)] + [(2, b) for b in range(4)]
    reference = fit(tf.distribute.get_strategy(), [])
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-6)
    assert not os.path.exists(backup)


def test_without_the_fix_keras_replays_the_batches_a_mid_epoch_backup_had_trained(tmp_path, monkeypatch):
    """Keras on one device, 3 epochs of 4 batches, BackupAndRestore(save_freq=2), cut after batch 2 of epoch 1:
    resumed, Keras starts epoch 1 again and trains its batches 0-2 twice (15 steps for a 12-step fit), which
    keras/src/callbacks/backup_and_restore_test.py::test_best_case_step pins (tests/keras_gate/allowed.py). If this
    starts failing, Keras resumes at the saved batch: drop that allow-list entry."""
    from keras.src.callbacks.backup_and_restore import BackupAndRestore

    monkeypatch.setattr(BackupAndRestore, "on_train_begin", keras_fixes.original_of(BackupAndRestore.on_train_begin))
    backup, first, resumed = str(tmp_path / "backup"), Interrupt(at=(1, 2)), Interrupt()
    with pytest.raises(RuntimeError, match="preempted"):
        fit(tf.distribute.get_strategy(), [keras.callbacks.BackupAndRestore(backup, save_freq=2), first])
    fit(tf.distribute.get_strategy(), [keras.callbacks.BackupAndRestore(backup, save_freq=2), resumed])
    assert resumed.steps[:4] == [(1, 0), (1, 1), (1, 2), (1, 3)]
    assert len(first.steps) + len(resumed.steps) == 15


def test_logging_and_decision_callbacks_work_under_mirrored(mirrored, tmp_path):
    early = keras.callbacks.EarlyStopping(monitor="loss", patience=0, min_delta=10.0)  # stops after epoch 2
    fit(mirrored, [
        early,
        keras.callbacks.ReduceLROnPlateau(monitor="loss", patience=0, min_delta=10.0),
        keras.callbacks.ModelCheckpoint(str(tmp_path / "m-{epoch}.keras")),
        keras.callbacks.ModelCheckpoint(str(tmp_path / "best.weights.h5"), monitor="loss", save_best_only=True,
                                        save_weights_only=True),
        keras.callbacks.TensorBoard(str(tmp_path / "tb")),
        keras.callbacks.CSVLogger(str(tmp_path / "log.csv")),
    ], epochs=5)
    assert early.stopped_epoch == 1
    assert sorted(os.listdir(tmp_path)) == ["best.weights.h5", "log.csv", "m-1.keras", "m-2.keras", "tb"]
    assert len((tmp_path / "log.csv").read_text().splitlines()) == 3
    keras.models.load_model(tmp_path / "m-2.keras")


def test_early_stopping_and_reduce_lr_go_on_from_the_backup_after_a_restore(mirrored, tmp_path):
    """Their counters (patience waited, best, cooldown) are in the backup: a resumed fit stops at the same epoch
    with the same learning rate as one never cut (Keras resets them in on_train_begin: it stopped 2 epochs later)."""
    def counters():  # every epoch after the first is no improvement (min_delta): a wait each epoch
        return [keras.callbacks.EarlyStopping(monitor="loss", patience=3, min_delta=1e9),
                keras.callbacks.ReduceLROnPlateau(monitor="loss", patience=2, min_delta=1e9, factor=0.5)]

    def learning_rate(model):
        return float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))

    whole = counters()
    uncut = fit(mirrored, whole, epochs=10)
    assert whole[0].stopped_epoch == 3
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="preempted"):
        fit(mirrored, [*counters(), Interrupt(at=(2, 1)), keras.callbacks.BackupAndRestore(backup)], epochs=10)
    resumed = counters()  # BackupAndRestore last, as docs/preemption.md says: it saves after their epoch end
    model = fit(mirrored, [*resumed, keras.callbacks.BackupAndRestore(backup)], epochs=10)
    assert (resumed[0].stopped_epoch, resumed[0].best) == (whole[0].stopped_epoch, whole[0].best)
    assert learning_rate(model) == learning_rate(uncut) < 0.05  # lowered once, at the same epoch


class _StandIn:
    """A model-like object that is no Keras model: Keras' callbacks take one (its own tests pass stand-ins)."""

    def __init__(self):
        self.stop_training, self.weights = False, -1
        self.optimizer = keras.optimizers.SGD(0.1)

    def get_weights(self):
        return self.weights

    def set_weights(self, weights):
        self.weights = weights


@pytest.mark.parametrize("make", [
    lambda: keras.callbacks.EarlyStopping(monitor="val_loss", patience=1, restore_best_weights=True),
    lambda: keras.callbacks.ReduceLROnPlateau(monitor="val_loss", patience=1, factor=0.5)],
    ids=["early_stopping", "reduce_lr"])
def test_decision_callbacks_take_a_model_that_is_no_keras_model(make):
    """keras/src/callbacks/early_stopping_test.py drives EarlyStopping with such a stand-in: with no strategy
    behind it, it is one worker, and the callback decides as in Keras (tfdist averaged over workers first)."""
    callback, stand_in = make(), _StandIn()
    callback.set_model(stand_in)
    callback.on_train_begin()
    for epoch, loss in enumerate([0.2, 0.1, 0.3, 0.4]):
        stand_in.weights = epoch
        callback.on_epoch_end(epoch, logs={"val_loss": loss})
        if stand_in.stop_training:
            break
    callback.on_train_end()
    if isinstance(callback, keras.callbacks.EarlyStopping):
        assert (callback.stopped_epoch, stand_in.weights) == (2, 1)  # stopped after epoch 2, best weights back
    else:
        assert float(keras.ops.convert_to_numpy(stand_in.optimizer.learning_rate)) == pytest.approx(0.025)  # 2 waits


def test_every_patch_is_applied_on_this_keras():
    assert [(p.name, p.applied, p.problem) for p in keras_fixes.PATCHES] == [
        ("multi_worker_fit", True, None), ("loss_scale", True, None), ("sharded_state", True, None),
        ("gradient_buckets", True, None),
        ("accumulation", True, None),
        ("callbacks", True, None),
        ("replica_state", True, None), ("steps_per_execution", True, None), ("exact_steps_per_execution", True, None),
        ("auto_steps_per_execution", True, None), ("xla_cpu_replicas", True, None), ("uneven_data", True, None),
        ("precision_check", True, None), ("sync_batch_norm", True, None), ("keras_distribution_cluster", True, None),
        ("keras_distribution", True, None), ("quiet_fit", True, None), ("step_report", True, None), ("preemption", True, None), ("autotune", True, None),
        ("sparse_rows", True, None),
        ("scaled_loss", True, None), ("py_dataset_build", True, None), ("batch_shares", True, None),
        ("async_checkpoint", True, None), ("model_files", True, None), ("sharded_save_points", True, None)]


class _Owner:
    def method(self, a, b):
        return a + b


def test_a_patch_whose_internal_changed_warns_and_stays_off(monkeypatch):
    patch = patching.Patch("demo", "keras#1", without="demo things break.")
    patch.replaces(_Owner, "method", ("self", "a"))(lambda original, self, a: 0)
    patch.replaces(_Owner, "missing", ("self",))(lambda original, self: 0)
    with pytest.warns(patching.KerasCompatibilityWarning,
                      match=rf"tfdist cannot apply its fix for keras#1 \(demo\) to Keras {keras.__version__}: "
                            r"_Owner.method takes \('self', 'a', 'b'\), tfdist expects \('self', 'a'\). Without it, "
                            r"demo things break. tfdist's fixes were checked against Keras 3\.\d+ to 3\.\d+"):
        assert not patch.apply()
    assert _Owner().method(1, 2) == 3  # untouched
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not patch.apply()  # warned once


def test_a_missing_internal_is_named():
    patch = patching.Patch("demo", "keras#2", without="x.")
    patch.replaces(_Owner, "missing", ("self",))(lambda original, self: 0)
    with pytest.warns(patching.KerasCompatibilityWarning, match="_Owner.missing does not exist"):
        patch.apply()


def test_a_patch_keeps_the_original_reachable():
    patch = patching.Patch("demo", "keras#3", without="x.")

    class Owner(_Owner):
        pass

    patch.replaces(Owner, "method", ("self", "a", "b"))(lambda original, self, a, b: original(self, a, b) * 10)
    assert patch.apply() and Owner().method(1, 2) == 30
    assert patching.original_of(Owner.method)(Owner(), 1, 2) == 3


def test_a_patch_under_another_refuses_to_restore_and_the_outer_one_restores():
    """Restore unwraps the outermost function: from under a later patch it would take that one off instead."""
    class Owner(_Owner):
        pass

    inner, outer = (patching.Patch(name, "keras#4", without="x.") for name in ("inner", "outer"))
    inner.replaces(Owner, "method", ("self", "a", "b"))(lambda original, self, a, b: original(self, a, b) * 10)
    outer.replaces(Owner, "method", ("self", "a", "b"))(lambda original, self, a, b: original(self, a, b) + 1)
    assert inner.apply() and outer.apply() and Owner().method(1, 2) == 31
    with pytest.raises(RuntimeError, match=r"tfdist cannot undo its patch inner: \S*Owner\.method was patched again "
                                           r"since \(outer\); undo that one first"):
        inner.restore()
    assert inner.applied and Owner().method(1, 2) == 31  # nothing undone
    outer.restore()
    inner.restore()
    assert Owner().method(1, 2) == 3 and not inner.applied and not outer.applied


def test_mirrored_strategy_in_a_cluster_warns_that_workers_train_apart(monkeypatch):
    from tfdist import runtime_hooks

    tf.config.list_logical_devices()  # the runtime starts here, not under the fake cluster (it would wait for it)
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, '
                                    '"task": {"type": "worker", "index": 1}}')
    with pytest.warns(runtime_hooks.ClusterWarning, match=r"This process is worker 1 of 2 \(tf_config\), but "
                                                          r"MirroredStrategy spans this worker's own devices only"):
        tf.distribute.MirroredStrategy(["CPU:0"])


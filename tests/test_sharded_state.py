"""Optimizer state sharded across replicas (ZeRO-1, issue 42), on 2 and 4 logical CPUs in one process.

Each shardable Keras optimizer, with the options a user sets, trains as one device does (weights to
1e-6, the same step count) while each replica holds 1/N of every slot; every replica's weights are the
same bits; a sharded optimizer saves the checkpoint of an unsharded one, which loads on any number of
replicas. What cannot be sharded exactly is refused, naming it. tests/test_sharded_state_multi_worker.py
runs worker processes.
"""

import contextlib
import re

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
import tfdist.horovod as hvd
from tfdist import sharding
from tfdist.keras_fixes import sharded_state

pytestmark = pytest.mark.usefixtures("fresh_tfdist_strategy", "restore_dtype_policy")

GLOBAL = 16
rng = np.random.default_rng(0)
X, Y = rng.normal(size=(48, 8)).astype("float32"), rng.normal(size=(48, 4)).astype("float32")

# Each shardable optimizer with the options users set on it (clipping acts on the summed gradient).
OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adam": lambda: keras.optimizers.Adam(0.01, amsgrad=True, global_clipnorm=0.5),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1, clipnorm=0.05),
    "adamax": lambda: keras.optimizers.Adamax(0.01, clipvalue=0.01),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1, initial_accumulator_value=0.2),
    "adadelta": lambda: keras.optimizers.Adadelta(1.0),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01, centered=True, momentum=0.5),
    "nadam": lambda: keras.optimizers.Nadam(0.01),
    "ftrl": lambda: keras.optimizers.Ftrl(0.1, l1_regularization_strength=0.01, l2_regularization_strength=0.01),
    "lion": lambda: keras.optimizers.Lion(0.001),
    # Moving averages are slots too: moved shard by shard, gathered whole to overwrite the weights.
    "adam_ema": lambda: keras.optimizers.Adam(0.01, use_ema=True, ema_momentum=0.9),
    "sgd_ema_overwrite": lambda: keras.optimizers.SGD(0.05, momentum=0.5, use_ema=True, ema_momentum=0.5,
                                                      ema_overwrite_frequency=2),
}


def mlp():
    """Every weight's size divides by 4 (no padding): 8x16, 16, 16x4, 4."""
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(4)])


def compiled(make_optimizer):
    keras.utils.set_random_seed(1)
    model = mlp()
    model.compile(make_optimizer(), "mse")
    return model


def train(make_optimizer, replicas, shard=True, epochs=2, policy="float32"):
    """``fit`` at global batch GLOBAL on one device, or under tfdist.scope() over ``replicas`` CPUs."""
    keras.config.set_dtype_policy(policy)
    if replicas == 1:
        model = compiled(make_optimizer)
    else:
        with tfdist.scope("mirrored", devices=f"CPU:[0-{replicas - 1}]", shard_optimizer_state=shard):
            model = compiled(make_optimizer)
    model.fit(X, Y, batch_size=GLOBAL, epochs=epochs, shuffle=False, verbose=0)
    return model


def replica_values(variable):
    return [v.numpy() for v in variable.value.values]


def assert_trains_as_one_device(one, many, atol=1e-6):
    assert int(many.optimizer.iterations.numpy()) == int(one.optimizer.iterations.numpy())
    for got, want in zip(many.get_weights(), one.get_weights()):
        np.testing.assert_allclose(got, want, atol=atol)
    for variable in many.trainable_variables:
        first, *others = replica_values(variable)
        assert all(np.array_equal(first, other) for other in others)  # every replica the same bits


@pytest.mark.parametrize("name, replicas", [(name, 2) for name in OPTIMIZERS] + [
    ("adam", 4), ("ftrl", 4), ("sgd_ema_overwrite", 4)])
def test_each_optimizer_sharded_trains_as_one_device_holding_a_share_of_its_state(name, replicas):
    one = train(OPTIMIZERS[name], 1)
    many = train(OPTIMIZERS[name], replicas)
    assert sharded_state.is_sharded(many.optimizer)
    assert_trains_as_one_device(one, many)
    whole = [int(np.prod(v.shape)) for v in one.optimizer.variables]  # the same variables, in the same order
    assert len(whole) == len(many.optimizer.variables)
    for size, variable in zip(whole, many.optimizer.variables):
        if size > 1:  # a slot: 1/N of the weight on each replica
            assert replica_values(variable)[0].shape == (size // replicas,), variable.path
    scalars = sum(tf.as_dtype(v.dtype).size for v, size in zip(one.optimizer.variables, whole) if size == 1)
    assert tfdist.optimizer_state_bytes(many.optimizer) - scalars == (
        tfdist.optimizer_state_bytes(one.optimizer) - scalars) // replicas


def test_a_weight_whose_size_does_not_divide_pads_its_last_shard():
    """A Dense(3) bias on 2 replicas: shards of 2 (one padding zero), and still one device's weights."""
    def small():
        return keras.optimizers.Adam(0.01)

    def build():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(7), keras.layers.Dense(3)])
        model.compile(small(), "mse")
        return model

    one = build()
    one.fit(X[:, :5], Y[:, :3], batch_size=GLOBAL, epochs=2, shuffle=False, verbose=0)
    with tfdist.scope("mirrored", devices="CPU:[0-1]", shard_optimizer_state=True):
        two = build()
    two.fit(X[:, :5], Y[:, :3], batch_size=GLOBAL, epochs=2, shuffle=False, verbose=0)
    assert_trains_as_one_device(one, two)
    assert {replica_values(v)[0].shape for v in two.optimizer.variables} >= {(18,), (4,), (11,), (2,)}


def test_a_sharded_step_all_reduces_each_replicas_shard_of_the_gradients_never_a_whole_one(monkeypatch):
    """Each replica's shard row is summed on its own (the sums a replica does not keep are dropped as they come):
    no all-reduce holds a whole gradient, and still one device's weights."""
    from tensorflow.python.distribute import cross_device_utils

    sizes = []
    original = cross_device_utils.CollectiveReplicaLauncher.all_reduce

    def all_reduce(self, input_tensor, *args, **kwargs):
        sizes.append(input_tensor.shape.num_elements())
        return original(self, input_tensor, *args, **kwargs)

    monkeypatch.setattr(cross_device_utils.CollectiveReplicaLauncher, "all_reduce", all_reduce)
    one = train(OPTIMIZERS["nadam"], 1)
    two = train(OPTIMIZERS["nadam"], 2)
    assert_trains_as_one_device(one, two)
    shards = sum(-(-int(np.prod(v.shape)) // 2) for v in two.trainable_variables)  # one row: 106 of 212 elements
    assert sizes and max(sizes) <= shards, sizes


def test_mixed_float16_sharded_equals_unsharded_on_the_same_replicas():
    """Loss scaling wraps the sharded optimizer; the shards' update is the whole update's, bit for bit."""
    whole = train(lambda: keras.optimizers.Adam(0.01), 2, shard=False, policy="mixed_float16")
    sharded = train(lambda: keras.optimizers.Adam(0.01), 2, policy="mixed_float16")
    assert isinstance(sharded.optimizer, keras.optimizers.LossScaleOptimizer)
    assert sharded_state.is_sharded(sharded.optimizer)
    assert_trains_as_one_device(whole, sharded, atol=0)
    assert float(sharded.optimizer.dynamic_scale.numpy()) == float(whole.optimizer.dynamic_scale.numpy())


def test_mixed_float16_sharded_saves_and_loads_through_its_loss_scale_optimizer(tmp_path):
    """Keras' LossScaleOptimizer saves its inner optimizer's slots among its own: they are saved whole too."""
    whole = train(lambda: keras.optimizers.Adam(0.01), 2, shard=False, policy="mixed_float16")
    sharded = train(lambda: keras.optimizers.Adam(0.01), 2, policy="mixed_float16")
    whole.save_weights(tmp_path / "whole.weights.h5")
    sharded.save_weights(tmp_path / "sharded.weights.h5")
    with h5py.File(tmp_path / "whole.weights.h5") as w, h5py.File(tmp_path / "sharded.weights.h5") as s:
        assert len(w["optimizer/vars"]) == len(s["optimizer/vars"])
        for key in w["optimizer/vars"]:
            np.testing.assert_array_equal(s["optimizer/vars"][key][()], w["optimizer/vars"][key][()])
    with tfdist.scope("mirrored", devices="CPU:[0-1]", shard_optimizer_state=True):
        again = compiled(lambda: keras.optimizers.Adam(0.01))
    again.fit(X[:GLOBAL], Y[:GLOBAL], batch_size=GLOBAL, epochs=1, verbose=0)  # builds its optimizer
    again.load_weights(tmp_path / "whole.weights.h5")
    for got, want in zip(again.optimizer.variables, whole.optimizer.variables):
        np.testing.assert_array_equal(got.numpy(), want.numpy())  # a shard's numpy() is the whole slot


def test_a_tf_train_checkpoint_holds_whole_slots_and_a_saved_model_is_refused(tmp_path):
    """A custom loop's tf.train.Checkpoint writes each slot whole (one device restores it) and restores it into
    shards; tf.saved_model.save, whose graph would hold shards, is a ShardingError naming what to use."""
    one = train(OPTIMIZERS["adam"], 1, epochs=1)
    two = train(OPTIMIZERS["adam"], 2, epochs=1)
    path = tf.train.Checkpoint(model=two, optimizer=two.optimizer).write(str(tmp_path / "ckpt"))
    plain = compiled(OPTIMIZERS["adam"])
    plain.optimizer.build(plain.trainable_variables)
    tf.train.Checkpoint(model=plain, optimizer=plain.optimizer).read(path).assert_consumed()
    for got, want in zip(plain.optimizer.variables, one.optimizer.variables):
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-6)
    with tfdist.scope("mirrored", devices="CPU:[0-1]", shard_optimizer_state=True):
        again = compiled(OPTIMIZERS["adam"])
        again.optimizer.build(again.trainable_variables)
    tf.train.Checkpoint(model=again, optimizer=again.optimizer).read(path).assert_consumed()
    for model in (one, again):
        model.fit(X, Y, batch_size=GLOBAL, epochs=1, shuffle=False, verbose=0)
    assert_trains_as_one_device(one, again)
    with pytest.raises(tfdist.ShardingError, match=r"a SavedModel \(tf.saved_model.save\) or a checkpoint saved "
                                                   r"inside a tf.function cannot hold them"):
        tf.saved_model.save(two, str(tmp_path / "saved_model"))


def test_a_custom_loop_applies_sharded_gradients_inside_strategy_run():
    one = compiled(OPTIMIZERS["adam"])
    with tfdist.scope("mirrored", devices="CPU:[0-1]", shard_optimizer_state=True) as strategy:
        two = compiled(OPTIMIZERS["adam"])
        optimizer = two.optimizer
        optimizer.build(two.trainable_variables)

    @tf.function
    def step(x, y):
        def replica_step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.square(two(x) - y)) / GLOBAL
            optimizer.apply_gradients(zip(tape.gradient(loss, two.trainable_variables), two.trainable_variables))
        strategy.run(replica_step, (x, y))

    data = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((X, Y)).batch(GLOBAL))
    for x, y in data:
        step(x, y)
    one.optimizer.build(one.trainable_variables)
    for start in range(0, len(X), GLOBAL):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.reduce_sum(tf.square(one(X[start:start + GLOBAL]) - Y[start:start + GLOBAL]), -1))
        one.optimizer.apply_gradients(zip(tape.gradient(loss, one.trainable_variables), one.trainable_variables))
    assert sharded_state.is_sharded(optimizer)
    assert_trains_as_one_device(one, two)
    with pytest.raises(tfdist.ShardingError, match=re.escape(
            "shards its state over 2 replicas and applies gradients only inside strategy.run")):
        with strategy.scope():
            optimizer.apply_gradients(zip([tf.zeros_like(v) for v in two.trainable_variables], two.trainable_variables))


def test_a_sharded_checkpoint_is_keras_own_and_loads_on_any_number_of_replicas(tmp_path, monkeypatch):
    """2 sharded replicas save; the file holds one device's whole slots; one device and 4 sharded replicas
    load it and train on as one device does."""
    one = train(OPTIMIZERS["adam"], 1, epochs=1)
    saved_slots = [v.numpy() for v in one.optimizer.variables]
    one.fit(X, Y, batch_size=GLOBAL, epochs=1, shuffle=False, verbose=0)
    two = train(OPTIMIZERS["adam"], 2, epochs=1)
    two.save(tmp_path / "model.keras")
    two.save_weights(tmp_path / "model.weights.h5")
    with h5py.File(tmp_path / "model.weights.h5") as f:
        stored = [f["optimizer/vars"][str(i)][()] for i in range(len(f["optimizer/vars"]))]
    assert len(stored) == len(saved_slots)
    for got, want in zip(stored, saved_slots):
        np.testing.assert_allclose(got, want, atol=1e-6)

    plain = keras.models.load_model(tmp_path / "model.keras")  # no strategy: Keras' own optimizer
    assert not sharded_state.is_sharded(plain.optimizer)
    plain.fit(X, Y, batch_size=GLOBAL, epochs=1, shuffle=False, verbose=0)
    assert_same_weights(plain, one)

    tf.distribute.MirroredStrategy._collective_key_base += 100000  # a second strategy in this test
    monkeypatch.setenv(sharding.ENV, "1")
    with tf.distribute.MirroredStrategy([f"CPU:{i}" for i in range(4)]).scope():
        four = keras.models.load_model(tmp_path / "model.keras")
    assert sharded_state.is_sharded(four.optimizer)
    four.fit(X, Y, batch_size=GLOBAL, epochs=1, shuffle=False, verbose=0)
    assert_trains_as_one_device(one, four)


def test_swap_ema_weights_evaluates_and_ends_with_the_averages_as_one_device():
    """SwapEMAWeights(swap_on_epoch=True): each epoch's evaluation and the last epoch read the whole averages."""
    def run(replicas):
        history = []
        callbacks = [keras.callbacks.SwapEMAWeights(swap_on_epoch=True),
                     keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: history.append(logs["val_loss"]))]
        with tfdist.scope("mirrored", devices=f"CPU:[0-{replicas - 1}]", shard_optimizer_state=True) if (
                replicas > 1) else contextlib.nullcontext():
            model = compiled(OPTIMIZERS["adam_ema"])
        model.fit(X, Y, batch_size=GLOBAL, epochs=3, shuffle=False, verbose=0, validation_data=(X[:16], Y[:16]),
                  callbacks=callbacks)
        return model, history

    (one, one_history), (two, two_history) = run(1), run(2)
    assert sharded_state.is_sharded(two.optimizer)
    np.testing.assert_allclose(two_history, one_history, rtol=1e-6)
    assert_trains_as_one_device(one, two)
    for got, want in zip(two.optimizer._model_variables_moving_average, one.optimizer._model_variables_moving_average):
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-6)


def assert_same_weights(got_model, want_model):
    for got, want in zip(got_model.get_weights(), want_model.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("make_optimizer, message", [
    (lambda: keras.optimizers.Lamb(0.01), r"cannot shard the state of Lamb: its update is not element by element"),
    (lambda: keras.optimizers.Adafactor(0.01), r"cannot shard the state of Adafactor"),
    (lambda: keras.optimizers.Muon(0.01), r"cannot shard the state of Muon"),
    (lambda: keras.optimizers.SGD(0.01, gradient_accumulation_steps=2),
     r"does not shard gradient accumulation \(SGD\(gradient_accumulation_steps=2\)\): its accumulators hold each "
     r"replica's own unreduced gradients"),
], ids=["lamb", "adafactor", "muon", "accumulation"])
def test_what_cannot_be_sharded_exactly_is_refused_at_the_first_fit(make_optimizer, message):
    with tfdist.scope("mirrored", devices="CPU:[0-1]", shard_optimizer_state=True):
        model = compiled(make_optimizer)
    with pytest.raises(tfdist.ShardingError, match=message):
        model.fit(X, Y, batch_size=GLOBAL, epochs=1, verbose=0)


def test_the_switch_names_a_bad_value(monkeypatch):
    with pytest.raises(TypeError, match=r"shard_optimizer_state takes True or False; received 'yes'"):
        with tfdist.scope("mirrored", devices="CPU:[0-1]", shard_optimizer_state="yes"):
            pass
    monkeypatch.setenv(sharding.ENV, "sometimes")
    with pytest.raises(ValueError, match=r"TFDIST_SHARD_OPTIMIZER_STATE='sometimes' is not a switch: set it to 1"):
        keras.optimizers.SGD(0.1)
    monkeypatch.delenv(sharding.ENV)
    with pytest.raises(tfdist.ShardingError, match=r"tfdist.horovod does not shard optimizer state: Horovod scripts "
                                                   r"save on rank 0 alone"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), shard_optimizer_state=True)


def test_distributed_optimizer_and_the_environment_turn_it_on_and_a_scope_turns_it_off(monkeypatch):
    with tfdist.scope("mirrored", devices="CPU:[0-1]"):
        model = compiled(lambda: tfdist.DistributedOptimizer(keras.optimizers.Adam(0.01), shard_optimizer_state=True))
        monkeypatch.setenv(sharding.ENV, "1")
        by_environment = compiled(OPTIMIZERS["adam"])
    with tfdist.scope("mirrored", devices="CPU:[0-1]", shard_optimizer_state=False):
        off = compiled(OPTIMIZERS["adam"])
    for each in (model, by_environment, off):
        each.fit(X, Y, batch_size=GLOBAL, epochs=1, verbose=0)
    assert [sharded_state.is_sharded(m.optimizer) for m in (model, by_environment, off)] == [True, True, False]


def test_tfdists_callbacks_broadcast_and_correct_momentum_without_touching_the_shards_wrongly():
    """BroadcastGlobalVariablesCallback skips the shards (they differ by design; reading one whole raised
    Keras' "Could not convert ... NONE"); LearningRateScheduleCallback(momentum_correction=True) scales each
    replica's shard of the momentum."""
    def callbacks():
        return [tfdist.callbacks.BroadcastGlobalVariablesCallback(0),
                tfdist.callbacks.LearningRateScheduleCallback(0.05, lambda epoch: 0.5 ** epoch, momentum_correction=True)]

    def sgd():
        return keras.optimizers.SGD(0.05, momentum=0.9)

    one = compiled(sgd)
    one.fit(X, Y, batch_size=GLOBAL, epochs=3, shuffle=False, verbose=0, callbacks=callbacks())
    with tfdist.scope("mirrored", devices="CPU:[0-1]", shard_optimizer_state=True):
        two = compiled(sgd)
    two.fit(X, Y, batch_size=GLOBAL, epochs=3, shuffle=False, verbose=0, callbacks=callbacks())
    assert sharded_state.is_sharded(two.optimizer)
    assert_trains_as_one_device(one, two)


@pytest.mark.parametrize("shard, clipnorm, tuned", [(False, None, True), (True, None, False), (True, 1.0, True)])
def test_autotune_leaves_alone_a_sharded_step_that_sums_shard_rows_in_no_bucket(monkeypatch, shard, clipnorm, tuned):
    """A multi-worker fit tunes the gradient buckets (TFDIST_AUTOTUNE=1): a sharded step that sums shard rows uses
    no bucket, so its candidates are one function timed for nothing, whose "choice" an unsharded run of the same
    model and hosts would apply from the record file. Clipping sums the gradients whole, in buckets: tuned."""
    from tfdist import autotune, process_group
    from tfdist.keras_fixes import autotune_fit

    monkeypatch.setattr(autotune, "_switch", True)
    monkeypatch.setattr(process_group, "is_multi_worker", lambda strategy: True)  # 2 workers, as the tuner sees them
    monkeypatch.setattr(process_group, "for_strategy", lambda strategy: type("Group", (), {"rank": 0})())
    monkeypatch.setattr(autotune_fit, "_the_chief_tunes", lambda group: True)
    monkeypatch.setattr(autotune_fit, "_hosts", lambda strategy: ["127.0.0.1", "127.0.0.1"])
    monkeypatch.setattr(autotune_fit, "_recorded", lambda group, key: None)
    with tfdist.scope("mirrored", devices="CPU:[0-1]", shard_optimizer_state=shard):
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(1024), keras.layers.Dense(512),
                                  keras.layers.Dense(10)])
        model.compile(keras.optimizers.Adam(0.01, clipnorm=clipnorm), "mse")
        model.optimizer.build(model.trainable_variables)
    assert len(autotune.candidates(*autotune_fit._gradients(model))) > 1
    model.make_train_function(force=True)
    assert isinstance(model.train_function, autotune.Tuner) is tuned


ZERO_SIZE_SCRIPT = r"""
import sys
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 3)
import keras, numpy as np, tfdist

class Empty(keras.layers.Layer):  # a weight of no elements (a float64 group of its own)
    def build(self, shape):
        self.e = self.add_weight(shape=(0,), initializer="zeros", name="e", dtype="float64")
    def call(self, x):
        return x + tf.cast(tf.reduce_sum(self.e), x.dtype)

rng = np.random.default_rng(0)
x, y = rng.normal(size=(48, 8)).astype("float32"), rng.normal(size=(48, 3)).astype("float32")
def build():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3), Empty()])
    model.compile(keras.optimizers.Adam(0.01, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=2), "mse")
    return model
one = build()
one.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
with tfdist.scope("mirrored", devices="CPU:[0-2]", shard_optimizer_state=True):
    three = build()
three.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
for got, want in zip(three.get_weights(), one.get_weights()):
    np.testing.assert_allclose(got, want, atol=1e-6)
for got, want in zip(three.optimizer.variables, one.optimizer.variables):  # whole slots, gathered
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-6)
three.save_weights(sys.argv[1])  # Keras' file, whole slots
again = build()
again.fit(x[:16], y[:16], batch_size=16, epochs=1, shuffle=False, verbose=0)  # builds the optimizer
again.load_weights(sys.argv[1])
for got, want in zip(again.optimizer.variables, one.optimizer.variables):
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-6)
print("trained as one device")
"""


def test_a_weight_of_no_elements_trains_and_reads_whole_without_a_collective_that_crashes(tmp_path):
    """TensorFlow's all-gather of no elements kills the process (a segfault, in 2.21): a sharded weight of size 0
    (and its slots) is gathered without one. In a process of its own, so a crash fails only this test."""
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", ZERO_SIZE_SCRIPT, str(tmp_path / "zero.weights.h5")], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert done.returncode == 0 and "trained as one device" in done.stdout, (done.returncode, done.stderr[-3000:])


class _ScaledWithAnIdleWeight(keras.layers.Layer):
    """A scalar weight (1 element on 3 replicas: two padding zeros) and a weight no loss reaches (no gradient)."""

    def build(self, shape):
        self.scale = self.add_weight(shape=(), initializer="ones", name="scale")
        self.idle = self.add_weight(shape=(5,), initializer="ones", name="idle")

    def call(self, x):
        return x * self.scale


def test_shard_rows_of_odd_weights_train_as_one_device_over_partial_batches_and_a_second_fit():
    """Summed by shard rows on 3 replicas: an Embedding's sparse gradient, a float64 layer (a group of its own),
    sizes that do not divide by 3, a scalar, a frozen layer and a weight with no gradient; 50 examples in batches
    of 16 (the last split 1/1/0: the examples' count summed in one more all-reduce), 3 steps per execution, then
    a second fit of batches of 12 (a retrace)."""
    rng_ = np.random.default_rng(0)
    features, tokens = rng_.normal(size=(50, 8)).astype("float32"), rng_.integers(0, 10, size=(50, 4)).astype("int32")
    targets = rng_.normal(size=(50, 3)).astype("float32")

    def build():
        keras.utils.set_random_seed(1)
        f, t = keras.Input((8,)), keras.Input((4,), dtype="int32")
        embedded = keras.layers.Flatten()(keras.layers.Embedding(10, 3)(t))
        wide = keras.layers.Dense(7)(keras.layers.Dense(5, dtype="float64")(f))
        frozen = keras.layers.Dense(4, trainable=False)(f)
        out = _ScaledWithAnIdleWeight()(keras.layers.Dense(3)(keras.layers.Concatenate()([embedded, wide, frozen])))
        model = keras.Model([f, t], out)
        model.compile(keras.optimizers.AdamW(0.01, weight_decay=0.1), "mse", steps_per_execution=3)
        return model

    def fit(model):
        model.fit([features, tokens], targets, batch_size=16, epochs=2, shuffle=False, verbose=0)
        model.fit([features, tokens], targets, batch_size=12, epochs=1, shuffle=False, verbose=0)
        return model

    one = fit(build())
    with tfdist.scope("mirrored", devices="CPU:[0-2]", shard_optimizer_state=True):
        three = build()
    assert_trains_as_one_device(one, fit(three))
    assert sharded_state.sums_shard_rows(three.optimizer)

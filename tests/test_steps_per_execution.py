"""compile(steps_per_execution=K) under MirroredStrategy (keras#19246): same results as K=1.

The 2-worker case runs in tests/test_multi_worker.py.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.workers import common
from tfdist import keras_fixes, strategy as strategy_lib


@pytest.fixture
def mirrored():
    return strategy_lib.make_strategy("mirrored", devices="CPU:[0-1]")


def train(strategy, steps_per_execution):
    """2 epochs of 16 batches (the last one partial) at K; returns what a user would compare."""
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
        rng = np.random.default_rng(1)
        model.set_weights([rng.normal(size=w.shape).astype("float32") for w in model.get_weights()])
        model.compile(keras.optimizers.SGD(0.05), "mse", metrics=["mae"], steps_per_execution=steps_per_execution)
    x = np.random.default_rng(0).random((250, 6)).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, x.sum(1, keepdims=True))).batch(16)
    batches = []
    history = model.fit(dataset, epochs=2, verbose=0, callbacks=[
        keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: batches.append(batch))])
    return {"weights": model.get_weights(), "history": history.history, "batches": batches,
            "evaluate": model.evaluate(dataset, verbose=0), "predict": model.predict(dataset, verbose=0),
            "iterations": int(model.optimizer.iterations.numpy())}


def test_k_steps_per_call_equal_one_step_per_call(mirrored):
    one, five = train(mirrored, 1), train(mirrored, 5)
    for a, b in zip(one["weights"], five["weights"]):
        np.testing.assert_allclose(a, b, atol=1e-5)
    for key in ("loss", "mae"):
        np.testing.assert_allclose(one["history"][key], five["history"][key], rtol=1e-5)
    np.testing.assert_allclose(one["evaluate"], five["evaluate"], rtol=1e-5)
    np.testing.assert_allclose(one["predict"], five["predict"], atol=1e-5)
    assert one["iterations"] == five["iterations"] == 32
    # Callbacks see every K-th batch, as Keras documents: since Keras 3.11 a call's last batch (the last call, which
    # the data ends, the batch a whole call would end at: Keras' number), before its first.
    assert five["batches"] in ([4, 9, 14, 19] * 2, [0, 5, 10, 15] * 2)



def test_the_k_step_loop_is_traced_without_autograph(mirrored, monkeypatch):
    """tfdist's loop is TensorFlow ops already (tf.while_loop, tf.cond), as Keras' own step functions are (which it
    marks do_not_convert): AutoGraph transpiled five functions of it (and Keras' optional-input wrapper) at every
    first fit, about 0.4 s of a worker's CPU (benchmarks/plain_vs_tfdist.py), and changed nothing."""
    from tensorflow.python.autograph.impl import api

    converted, convert = [], api._convert_actual
    monkeypatch.setattr(api, "_convert_actual",
                        lambda entity, ctx: converted.append(entity.__qualname__) or convert(entity, ctx))
    result = train(mirrored, 5)
    assert converted == []
    assert result["iterations"] == 32

@pytest.mark.parametrize("devices", [None, "CPU:[0-1]"], ids=["one-device", "mirrored-2"])
def test_callbacks_see_keras_batch_numbers_when_the_data_ends_the_epoch(devices):
    """Keras 3.15.1 on one device, 10 batches at K=3: 10 steps, on_train_batch_end(2, 5, 8, 11) (its last call stops
    at the data's end and reports the batch a whole call would end at; keras/src/trainers/trainer_test.py pins it).
    tfdist trained the same 10 steps but reported 9; on 2 replicas it reports as on one device."""
    strategy = strategy_lib.make_strategy("mirrored", devices=devices) if devices else tf.distribute.get_strategy()
    model, seen = compiled(strategy, steps_per_execution=3), []
    x = np.zeros((10 * 4, 6), "float32")
    model.fit(x, x[:, :1], batch_size=4, epochs=2, verbose=0, callbacks=[
        keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: seen.append(batch))])
    assert seen == [2, 5, 8, 11] * 2
    assert int(model.optimizer.iterations.numpy()) == 20


def test_one_device_traces_the_train_step_as_often_as_keras():
    """keras/src/trainers/trainer_test.py::test_retracing: K=20, 100 batches of 1, Adam: Keras traces the train step
    at most twice (the first trace makes the optimizer's variables, so tf.function traces again). tfdist's loop,
    which holds the step at two call sites, traced it 4 times."""
    traced = []

    class Counted(keras.Sequential):
        def train_step(self, *args):
            traced.append(1)
            return super().train_step(*args)

    model = Counted([keras.Input((4,)), keras.layers.Dense(1, activation="relu")])
    model.compile(loss="mse", optimizer="adam", steps_per_execution=20)
    model.fit(np.ones((100, 4)), np.ones((100, 1)), batch_size=1, verbose=0)
    assert len(traced) <= 2
    assert int(model.optimizer.iterations.numpy()) == 100


@pytest.mark.parametrize("run_eagerly", [False, True], ids=["graph", "eager"])
def test_a_last_call_that_finds_the_data_ended_ends_the_epoch(run_eagerly):
    """steps_per_epoch=7 at K=3 over 5 batches of unknown count: the call at batch 6 finds no data. Keras' own path
    ends the epoch (StopIteration); its per-batch path, which runs tfdist's shorter last call, failed with an unbound
    ``outputs``."""
    model = compiled(tf.distribute.get_strategy(), steps_per_execution=3, run_eagerly=run_eagerly)
    x = np.zeros((5 * 4, 6), "float32")
    data = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).filter(lambda a, b: True).batch(4)
    with pytest.warns(UserWarning, match="ran out of data"):
        model.fit(data, epochs=1, steps_per_epoch=7, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 5


def test_without_the_fix_keras_fails_under_mirrored(mirrored, monkeypatch):
    """If this starts passing, Keras fixed keras#19246: drop tfdist.keras_fixes.steps_per_execution."""
    from keras.src.backend.tensorflow import trainer

    monkeypatch.setattr(trainer.TensorFlowTrainer, "_make_function",
                        keras_fixes.original_of(trainer.TensorFlowTrainer._make_function))
    with pytest.raises(tf.errors.InvalidArgumentError, match="You must feed a value for placeholder tensor"):
        train(mirrored, 4)


@pytest.mark.parametrize("devices", [None, "CPU:[0-1]"], ids=["one-device", "mirrored-2"])
def test_step_counts_k_does_not_divide_are_the_users(devices):
    strategy = strategy_lib.make_strategy("mirrored", devices=devices) if devices else tf.distribute.get_strategy()
    common.assert_same_steps(common.step_counts(strategy, 1), common.step_counts(strategy, 4))


def test_without_the_fix_keras_trains_whole_calls_past_the_step_count(monkeypatch):
    """If this starts failing, Keras runs the steps asked for: drop steps_per_execution.exact_steps_patch."""
    from keras.src.trainers.epoch_iterator import EpochIterator

    monkeypatch.setattr(EpochIterator, "_enumerate_iterator", keras_fixes.original_of(EpochIterator._enumerate_iterator))
    model = compiled(tf.distribute.get_strategy(), steps_per_execution=4)
    x = np.zeros((6 * 4, 6), "float32")
    model.fit(tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(4).repeat(), epochs=3, steps_per_epoch=10,
              verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 3 * 12


def compiled(strategy, **compile_kwargs):
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse", **compile_kwargs)
    return model


def fit_steps(model, callbacks=(), steps_per_epoch=None):
    """K that fit used: the batches callbacks saw in 40 batches."""
    seen = []
    recorder = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: seen.append(model.steps_per_execution))
    x = np.zeros((40 * 4, 6), "float32")
    model.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0, steps_per_epoch=steps_per_epoch,
              callbacks=[*callbacks, recorder])
    return seen[0]


def test_auto_picks_k_unless_a_callback_needs_every_batch(fresh_tfdist_strategy):
    import tfdist

    every_batch = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: None)
    assert fit_steps(compiled(tf.distribute.get_strategy(), steps_per_execution="auto")) == 16
    assert fit_steps(compiled(tf.distribute.get_strategy(), steps_per_execution="auto"), steps_per_epoch=5) == 5
    with tfdist.scope(devices="CPU:[0-1]") as strategy:  # no K given under tfdist's strategy: auto
        model = compiled(strategy)
    assert fit_steps(model, callbacks=[keras.callbacks.EarlyStopping(monitor="loss")]) == 16
    assert fit_steps(model, callbacks=[every_batch]) == 1
    assert fit_steps(compiled(strategy, steps_per_execution=1)) == 1  # the user's own K is kept
    assert fit_steps(compiled(tf.distribute.get_strategy())) == 1  # plain Keras keeps Keras' default
    assert model.steps_per_execution == 1  # K is fit's only: predict(steps=2) gives 2 batches
    assert model.predict(np.zeros((40, 6), "float32"), batch_size=4, steps=2, verbose=0).shape == (8, 1)


def test_auto_trains_the_steps_asked_for_when_k_changes_between_fits(fresh_tfdist_strategy):
    """K=16, then a per-batch callback (K=1), then fewer steps than K: every fit trains exactly its steps."""
    import tfdist

    with tfdist.scope(devices="CPU:[0-1]") as strategy:
        model = compiled(strategy)
    seen = []
    every_batch = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: seen.append(batch))
    x = np.zeros((40 * 4, 6), "float32")
    for callbacks, steps in (([], 40), ([every_batch], 30), ([], 5), ([every_batch], 7), ([], 40), ([], 40)):
        before, seen[:] = int(model.optimizer.iterations.numpy()), []
        model.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0, steps_per_epoch=steps, callbacks=callbacks)
        assert int(model.optimizer.iterations.numpy()) - before == steps, (callbacks, steps)
        assert seen == (list(range(steps)) if callbacks else [])


@pytest.mark.parametrize("per_batch_callback", [False, True], ids=["k-auto", "k-1"])
def test_a_dataset_of_unknown_length_trains_one_optimizer_step_per_batch(fresh_tfdist_strategy, per_batch_callback):
    """Keras ends such an epoch when a call's first get_next finds no data; the optimizer's step counter does
    not depend on the data, so TensorFlow ran its increment in that failed call: one extra step an epoch
    (Adam's bias correction and every schedule moved), 15 steps for 3 epochs of 4 batches."""
    import tfdist

    with tfdist.scope(devices="CPU:[0-1]") as strategy:
        model = compiled(strategy)
    x = np.random.default_rng(0).random((64, 6)).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).filter(lambda a, b: True).batch(16)
    assert dataset.cardinality() == tf.data.UNKNOWN_CARDINALITY
    callbacks = [keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: None)] * per_batch_callback
    model.fit(dataset, epochs=3, verbose=0, callbacks=callbacks)
    assert int(model.optimizer.iterations.numpy()) == 12


class TensorIfStepModel(keras.Model):
    """A user's train_step with a Python ``if`` on a tensor: Keras 3 does not AutoGraph-convert it (its step functions
    are do_not_convert), so plain ``fit`` fails while tracing; tfdist's loop must not convert it either."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self(x, training=True) - y))
            if tf.reduce_sum(y) > 0:
                loss = loss * 2.0
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        return {"loss": loss}


@pytest.mark.parametrize("steps_per_execution", [None, 4], ids=["auto", "K=4"])
def test_a_users_train_step_is_converted_as_plain_keras_converts_it(mirrored, steps_per_execution):
    """Oracle: plain Keras on one device. Before 6126bf0 tfdist's loop (AutoGraph on) converted a user's train_step,
    so this trained under tfdist at K>1 only (and failed at K=1 or with a per-batch callback)."""
    def fit(strategy):
        with strategy.scope():
            inputs = keras.Input((4,))
            model = TensorIfStepModel(inputs, keras.layers.Dense(1)(inputs))
            model.compile("sgd", "mse", **({} if steps_per_execution is None else
                                           {"steps_per_execution": steps_per_execution}))
        x = np.ones((32, 4), "float32")
        model.fit(tf.data.Dataset.from_tensor_slices((x, x.sum(1, keepdims=True))).batch(8), verbose=0)

    with pytest.raises(tf.errors.OperatorNotAllowedInGraphError, match="as a Python `bool`"):
        fit(tf.distribute.get_strategy())  # plain Keras' own error
    with pytest.raises(tf.errors.OperatorNotAllowedInGraphError, match="as a Python `bool`"):
        fit(mirrored)

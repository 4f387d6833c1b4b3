"""What Keras 3 users report broken under strategies, pinned on 2 logical devices (the 2-worker metric
average, keras#19280, is in tests/test_multi_worker.py)."""

import numpy as np
import pytest
import tensorflow as tf

import tfdist  # noqa: F401  (applies the Keras fixes)


def _model():
    import keras

    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)])


def test_a_replica_with_an_empty_last_batch_gives_no_nan_metrics():
    """keras#21467: 17 rows at batch 8 leave 1 row for 2 replicas: one replica gets none."""
    import keras

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(17, 3)).astype("float32"), rng.normal(size=(17, 1)).astype("float32")
    with tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"]).scope():
        model = _model()
        model.compile(keras.optimizers.SGD(0.01), "mse", metrics=["mae", keras.metrics.RootMeanSquaredError()])
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, validation_data=(x, y))
    for name, values in history.history.items():
        assert np.isfinite(values).all(), (name, values)
    assert all(np.isfinite(w).all() for w in model.get_weights())
    result = model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    error = model.predict(x, batch_size=8, verbose=0) - y
    assert result["mae"] == pytest.approx(np.abs(error).mean(), rel=1e-5)


@pytest.mark.parametrize("loss_scale", [False, True])
def test_jit_compile_under_mirrored_strategy_on_cpus_is_a_clear_error(loss_scale):
    """keras#21366 (LossScaleOptimizer + jit_compile=True under MirroredStrategy) and keras#18145; also the canary:
    the check replaces Trainer.compile, which Keras' Model.compile must still be."""
    import keras

    with tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"]).scope():
        model = _model()
        optimizer = keras.optimizers.SGD(0.01)
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer) if loss_scale else optimizer
        with pytest.raises(ValueError, match=r"compile\(jit_compile=True\) cannot run under a strategy over 2 CPU "
                                             r"devices: XLA .* Received: jit_compile=True. Pass jit_compile=False"):
            model.compile(optimizer, "mse", jit_compile=True)
        model.compile(optimizer, "mse")  # "auto": Keras turns XLA off under a strategy, and it trains
    x = np.ones((8, 3), "float32")
    assert np.isfinite(model.fit(x, x[:, :1], batch_size=8, verbose=0).history["loss"]).all()


def test_jit_compile_on_one_device_still_works():
    import keras

    model = _model()
    model.compile(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01)), "mse", jit_compile=True)
    x = np.ones((8, 3), "float32")
    assert np.isfinite(model.fit(x, x[:, :1], batch_size=8, verbose=0).history["loss"]).all()


@pytest.mark.parametrize("optimizer", ["adam", "sgd_global_clipnorm"])
def test_a_sparse_gradient_with_a_repeated_row_updates_as_its_dense_sum(optimizer):
    """An Embedding's gradient holds a row per id looked up; Keras 3 squares the repeats of an id apart (Adam's
    second moment, global_clipnorm's norm). Summed first (tfdist.keras_fixes.sparse_rows), the update is the dense
    gradient's, which is what N devices apply."""
    import keras

    dense = tf.constant([[3.0, 3.0], [0.0, 0.0], [2.0, 5.0]])
    repeated = tf.IndexedSlices(tf.constant([[1.0, 2.0], [2.0, 5.0], [2.0, 1.0]]), tf.constant([0, 2, 0]),
                                tf.constant([3, 2]))

    def updated(gradient):
        variable = keras.Variable(tf.ones((3, 2)))
        keras_optimizer = keras.optimizers.Adam(0.1) if optimizer == "adam" else \
            keras.optimizers.SGD(0.1, global_clipnorm=1.0)
        for _ in range(2):
            keras_optimizer.apply([gradient], [variable])
        return variable.numpy()

    np.testing.assert_allclose(updated(repeated), updated(dense), rtol=1e-6)


def test_fit_warns_about_shuffle_only_when_the_caller_passed_it():
    """Keras warns "`shuffle=True` was passed, but will be ignored" for every fit(tf.data.Dataset): its default."""
    import warnings

    import keras

    model = _model()
    model.compile(keras.optimizers.SGD(0.01), "mse")
    data = tf.data.Dataset.from_tensor_slices((np.ones((8, 3), "float32"), np.ones((8, 1), "float32"))).batch(4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(data, epochs=1, verbose=0)
        model.fit((batch for batch in data.as_numpy_iterator()), steps_per_epoch=2, epochs=1, verbose=0)
    assert not [w for w in caught if "shuffle" in str(w.message)]
    with pytest.warns(UserWarning, match="`shuffle=True` was passed, but will be ignored"):
        model.fit(data, epochs=1, verbose=0, shuffle=True)


def test_a_pydataset_with_workers_trains_every_batch_in_order_under_a_strategy():
    """Keras builds the model from a batch of a throwaway iterator: a PyDataset with workers feeds every iterator from
    one running enqueuer, so the first epoch started at batch 3 of 8 (and at a timing-dependent batch across workers:
    tests/test_preemption.py's PyDataset job). Each batch's loss equals one device's. One epoch: with threads, Keras'
    enqueuer can reorder a later epoch's batches on one device too (its race, seen 1 run in 4)."""
    import keras

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 3)).astype("float32"), rng.normal(size=(64, 1)).astype("float32")

    class Batches(keras.utils.PyDataset):
        def __init__(self):
            super().__init__(workers=2, max_queue_size=2)

        def __len__(self):
            return 8

        def __getitem__(self, index):
            return x[index * 8:(index + 1) * 8], y[index * 8:(index + 1) * 8]

    class Losses(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seen = []

        def on_train_batch_end(self, batch, logs=None):
            self.seen.append(float(logs["loss"]))

    def train(scope):
        keras.utils.set_random_seed(3)
        with scope:
            model = _model()
            model.compile(keras.optimizers.SGD(0.05), "mse")
        losses = Losses()
        model.fit(Batches(), epochs=1, verbose=0, shuffle=False, callbacks=[losses])
        return losses.seen, model.get_weights()

    one_losses, one_weights = train(tf.distribute.get_strategy().scope())
    two_losses, two_weights = train(tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"]).scope())
    np.testing.assert_allclose(two_losses, one_losses, rtol=1e-5)
    for got, want in zip(two_weights, one_weights):
        np.testing.assert_allclose(got, want, atol=1e-6)

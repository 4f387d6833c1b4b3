"""BatchNormalization under strategies: moving statistics are the mean over replicas; synchronized BN equals 1 device.

Single process, 2 logical CPU devices (tests/conftest.py); the 2-worker runs are in
tests/test_batchnorm_multi_worker.py.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfdist  # noqa: F401  (applies the Keras fixes)
from tests.workers import common
from tfdist.keras_fixes import replica_state

MOMENTUM = 0.5


def _bn_first_model(synchronized=False):
    import keras

    return keras.Sequential([keras.Input((3,)), keras.layers.BatchNormalization(momentum=MOMENTUM,
                                                                                 synchronized=synchronized),
                             keras.layers.Dense(1)])


def _data(rows=16):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 3)).astype("float32") * np.array([1.0, 3.0, 0.5], "float32") + [0.0, 5.0, -2.0]
    return x, rng.normal(size=(rows, 1)).astype("float32")


def test_moving_statistics_are_the_mean_over_replicas_on_every_replica():
    """BN first: its batch statistics are the inputs', so NumPy gives the expected moving averages."""
    x, y = _data()
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        model = _bn_first_model()
        model.compile("sgd", "mse")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)  # 2 steps of 8, 4 rows per replica
    mean, var = np.zeros(3), np.ones(3)
    expected_mean, expected_var = [], []
    for replica in (0, 1):
        m, v = mean, var
        for step in (0, 1):
            rows = x[step * 8 + replica * 4: step * 8 + replica * 4 + 4]
            m = MOMENTUM * m + (1 - MOMENTUM) * rows.mean(0)
            v = MOMENTUM * v + (1 - MOMENTUM) * rows.var(0)
        expected_mean.append(m)
        expected_var.append(v)
    bn = model.layers[0]
    for variable, expected in ((bn.moving_mean, np.mean(expected_mean, 0)), (bn.moving_variance, np.mean(expected_var, 0))):
        for copy in variable.value.values:  # every replica's copy
            np.testing.assert_allclose(copy.numpy(), expected, rtol=1e-5)
    assert not np.allclose(expected_mean[0], expected_mean[1])  # the replicas saw different statistics



def test_the_mean_is_traced_without_autograph(monkeypatch):
    """The averaging function is TensorFlow ops only: AutoGraph transpiled it (and its per-replica part) for every
    model with non-trainable weights, and changed nothing (Keras marks its own functions do_not_convert)."""
    from tensorflow.python.autograph.impl import api

    converted, convert = [], api._convert_actual
    monkeypatch.setattr(api, "_convert_actual",
                        lambda entity, ctx: converted.append(entity.__qualname__) or convert(entity, ctx))
    x, y = _data()
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        model = _bn_first_model()
        model.compile("sgd", "mse")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert converted == []
    copies = [c.numpy() for c in model.layers[0].moving_mean.value.values]
    np.testing.assert_array_equal(copies[0], copies[1])

def _train_cnn(strategy, synchronized=True, epochs=2):
    return common.train_batchnorm_cnn(strategy, synchronized, epochs)


def test_synchronized_batchnorm_on_two_devices_equals_one_device():
    one, one_loss = _train_cnn(tf.distribute.get_strategy())
    two, two_loss = _train_cnn(tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"]))
    assert len(one.get_weights()) == len(two.get_weights()) == 8
    for got, want in zip(two.get_weights(), one.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_allclose(two_loss, one_loss, rtol=1e-5)
    assert two_loss[-1] < two_loss[0]


def test_plain_batchnorm_copies_agree_after_fit():
    model, _ = _train_cnn(tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"]), synchronized=False, epochs=1)
    bn = model.layers[1]
    for variable in (bn.moving_mean, bn.moving_variance):
        first, second = (copy.numpy() for copy in variable.value.values)
        np.testing.assert_array_equal(first, second)


def test_keras_fit_calls_the_overridden_callback_list_on_epoch_end(monkeypatch):
    """Canary: the averaging hangs on CallbackList.on_epoch_end; if fit stops calling it, this fails."""
    from keras.src.callbacks.callback_list import CallbackList

    assert replica_state.patch.applied
    seen = []
    patched = CallbackList.on_epoch_end
    monkeypatch.setattr(CallbackList, "on_epoch_end", lambda self, epoch, logs=None: (seen.append(epoch),
                                                                                       patched(self, epoch, logs)))
    x, y = _data()
    model = _bn_first_model()
    model.compile("sgd", "mse")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    assert seen == [0, 1]


def test_average_replica_state_without_a_strategy_does_nothing():
    model = _bn_first_model()
    model.build((None, 3))
    assert replica_state.average_replica_state(model) == 0
    assert [v.name for v in replica_state.replica_state(model)] == ["moving_mean", "moving_variance"]

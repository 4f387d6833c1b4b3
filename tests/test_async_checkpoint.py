"""TensorFlow's asynchronous checkpoint of a Keras 3 model (tfdist.keras_fixes.async_checkpoint): Keras'
variables failed the second ``save(options=CheckpointOptions(enable_async=True))``; each save now holds the
values of its moment, on one device and under a MirroredStrategy, and restores in plain TensorFlow."""

import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.jobs import job_env

pytestmark = pytest.mark.usefixtures("fresh_tfdist_strategy")
ASYNC = tf.train.CheckpointOptions(enable_async=True)


def _model():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(keras.optimizers.Adam(0.1), "mse")
    return model


def _fit(model, seed):
    rng = np.random.default_rng(seed)
    model.fit(rng.normal(size=(16, 4)), rng.normal(size=(16, 3)), batch_size=8, verbose=0)
    return [v.numpy() for v in model.weights] + [v.numpy() for v in model.optimizer.variables]


@pytest.mark.parametrize("distributed", [False, True], ids=["one_device", "mirrored"])
def test_two_async_saves_in_a_row_each_hold_their_moment(tmp_path, distributed):
    strategy = tf.distribute.get_strategy()
    if distributed:
        with tfdist.scope("mirrored", devices="CPU:[0-1]") as strategy:
            pass
    with strategy.scope():
        model = _model()
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    saved = []
    for seed in (1, 2, 3):  # three saves: the second and third retraced TensorFlow's copy and failed
        values = _fit(model, seed)
        saved.append((checkpoint.save(str(tmp_path / "ckpt"), options=ASYNC), values))
    checkpoint.sync()
    for path, values in saved:
        with strategy.scope():
            restored = _model()
            restored.optimizer.build(restored.trainable_variables)
        tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).restore(path).assert_consumed()
        for got, want in zip([v.numpy() for v in restored.weights] + [v.numpy() for v in restored.optimizer.variables],
                             values):
            np.testing.assert_array_equal(got, want)


def test_an_async_save_restores_without_tfdist(tmp_path):
    model = _model()
    values = _fit(model, 1)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    checkpoint.save(str(tmp_path / "ckpt"), options=ASYNC)
    path = checkpoint.save(str(tmp_path / "ckpt"), options=ASYNC)
    checkpoint.sync()
    np.save(tmp_path / "want.npy", np.concatenate([v.ravel() for v in values]))
    script = f"""
import keras, numpy as np, tensorflow as tf
keras.utils.set_random_seed(3)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
model.compile(keras.optimizers.Adam(0.1), "mse")
model.optimizer.build(model.trainable_variables)
tf.train.Checkpoint(model=model, optimizer=model.optimizer).restore({path!r}).assert_consumed()
got = np.concatenate([v.numpy().ravel() for v in model.weights] + [v.numpy().ravel() for v in model.optimizer.variables])
assert np.array_equal(got, np.load({str(tmp_path / "want.npy")!r})), "values differ"
print("restored")
"""
    result = subprocess.run([sys.executable, "-c", script], env=job_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "restored" in result.stdout, result.stderr[-2000:]

"""Training in float32, mixed_float16 and mixed_bfloat16: same accuracy, no NaN, custom loops."""

import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.jobs import REPO, job_env
from tfdist import precision, strategy as strategy_lib

pytestmark = pytest.mark.usefixtures("restore_dtype_policy")

ACCURACY_TOLERANCE = 0.04  # absolute, on 512 held-out examples


def _blobs(num_examples, seed):
    """4 classes, separable by a small MLP; fixed seeds."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num_examples, 8)).astype("float32")
    w = np.random.default_rng(0).normal(size=(8, 4))
    y = np.argmax(x @ w + 0.5 * np.tanh(x[:, :4]), axis=1)
    return x, y


class _FiniteWeights(keras.callbacks.Callback):
    """Records whether every weight stayed finite (checked per epoch: a NaN weight stays NaN)."""

    def __init__(self):
        super().__init__()
        self.always_finite = True

    def on_epoch_end(self, epoch, logs=None):
        self.always_finite &= all(np.all(np.isfinite(w)) for w in self.model.get_weights())


def _train_classifier(policy):
    precision.set_policy(policy)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(4, activation="softmax", dtype="float32")])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    finite = _FiniteWeights()
    x, y = _blobs(1024, seed=1)
    model.fit(x, y, batch_size=64, epochs=4, verbose=0, callbacks=[finite])
    x_test, y_test = _blobs(512, seed=2)
    return model, model.evaluate(x_test, y_test, verbose=0, return_dict=True)["accuracy"], finite.always_finite


def test_mixed_policies_reach_float32_accuracy_without_nan():
    accuracies = {}
    for policy in ("float32", "mixed_float16", "mixed_bfloat16"):
        model, accuracies[policy], always_finite = _train_classifier(policy)
        assert always_finite, f"{policy}: a weight became NaN or inf"
        assert model.layers[0].compute_dtype == {"float32": "float32", "mixed_float16": "float16",
                                                 "mixed_bfloat16": "bfloat16"}[policy]
    assert accuracies["float32"] > 0.85, accuracies
    for policy in ("mixed_float16", "mixed_bfloat16"):
        assert abs(accuracies[policy] - accuracies["float32"]) <= ACCURACY_TOLERANCE, accuracies


@pytest.fixture(scope="module")
def mirrored():
    return strategy_lib.make_strategy("mirrored", devices="CPU:[0-1]")


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_custom_loop_trains_and_skips_overflowing_steps(policy, mirrored):
    precision.set_policy(policy)
    keras.utils.set_random_seed(0)
    with mirrored.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="tanh"),
                                  keras.layers.Dense(1, dtype="float32")])
        optimizer = precision.wrap_optimizer(keras.optimizers.SGD(0.05), loss_scale=True)
    step = precision.make_train_step(model, keras.losses.MeanSquaredError(), optimizer, mirrored)
    rng = np.random.default_rng(3)
    x = rng.normal(size=(512, 4)).astype("float32")
    y = (x @ rng.normal(size=(4, 1)) * 0.5).astype("float32")
    batches = mirrored.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(32))
    losses = [float(step(batch)) for batch in batches]
    assert losses[-1] < 0.5 * losses[0], losses
    scale, weights = precision.current_loss_scale(optimizer), model.get_weights()

    x_bad = np.ones((4, 4), "float32")
    x_bad[3, 0] = np.inf  # rows 2-3 go to replica 1: only it overflows
    bad = mirrored.experimental_distribute_dataset(tf.data.Dataset.from_tensors((x_bad, np.ones((4, 1), "float32"))))
    step(next(iter(bad)))
    assert precision.current_loss_scale(optimizer) == scale / 2
    for got, want in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(got, want)
    for weight in model.weights:
        first, second = (v.numpy() for v in mirrored.experimental_local_results(weight.value))
        np.testing.assert_array_equal(first, second)


def test_custom_loop_needs_loss_scaling_for_float16():
    precision.set_policy("mixed_float16")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    with pytest.raises(precision.PrecisionError,
                       match=r"computes in float16, but SGD does no loss scaling: pass "
                             r"tfdist.precision.wrap_optimizer\(optimizer\)"):
        precision.make_train_step(model, keras.losses.MeanSquaredError(), keras.optimizers.SGD())


def test_custom_loop_example_runs_its_manual_step():
    result = subprocess.run([sys.executable, "examples/custom_loop.py", "--precision", "mixed_float16",
                             "--steps", "41", "--manual"], cwd=REPO, env=job_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    losses = [float(line.split("loss ")[1].split()[0]) for line in result.stdout.splitlines() if line.startswith("step")]
    assert losses[-1] < losses[0]
    assert "mixed_float16: compute float16, variables float32" in result.stdout

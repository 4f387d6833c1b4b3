"""fit under tfdist.scope() on 2 logical CPUs equals one device with the same global batch (issue 28):
MultiOptimizer under mixed_float16, a float64 layer among float32 ones, an Embedding with a partial last
batch, and Keras' own optimizer options (use_ema, gradient_accumulation_steps, loss_scale_factor, clipping)."""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
import tfdist.horovod as hvd
from tfdist import buckets

pytestmark = pytest.mark.usefixtures("fresh_tfdist_strategy", "restore_dtype_policy")

GLOBAL = 16
rng = np.random.default_rng(0)
X, Y = rng.normal(size=(48, 8)).astype("float32"), rng.normal(size=(48, 1)).astype("float32")


@pytest.fixture(autouse=True)
def fresh_bucket_settings(monkeypatch):
    monkeypatch.setattr(buckets, "_settings", {})
    monkeypatch.delenv(buckets.ENV, raising=False)


def mlp():
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh", name="enc"),
                             keras.layers.Dense(1, name="head", dtype="float32")])


def train(build, make_optimizer, x, y, *, replicas, policy="float32"):
    """The model after ``fit`` at global batch GLOBAL, on one device or under tfdist.scope() over 2 CPUs."""
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(1)
    if replicas == 1:
        model = build()
        model.compile(make_optimizer(), "mse")
    else:
        with tfdist.scope("mirrored", devices="CPU:[0-1]") as strategy:
            assert strategy.num_replicas_in_sync == 2
            model = build()
            model.compile(make_optimizer(), "mse")
    model.fit(x, y, batch_size=GLOBAL, epochs=2, shuffle=False, verbose=0)
    return model


def assert_equals_one_device(build, make_optimizer, x=X, y=Y, policy="float32", atol=1e-6):
    one = train(build, make_optimizer, x, y, replicas=1, policy=policy)
    two = train(build, make_optimizer, x, y, replicas=2, policy=policy)
    assert int(two.optimizer.iterations.numpy()) == int(one.optimizer.iterations.numpy())
    for got, want in zip(two.get_weights(), one.get_weights()):
        np.testing.assert_allclose(got, want, atol=atol)
    return one, two


def multi_optimizer():
    optimizers = keras.optimizers.OptimizerMap(keras.optimizers.SGD(0.05, momentum=0.9))
    optimizers["enc/.*"] = keras.optimizers.SGD(0.02, clipnorm=1.0)  # clipping all-reduces first, then clips
    return keras.optimizers.MultiOptimizer(optimizers)


def test_multi_optimizer_under_mixed_float16_reduces_once():
    """The LossScaleOptimizer all-reduces before its finite check; the MultiOptimizer's inner optimizers (one
    clipping, which all-reduces before it clips) used to all-reduce the sums again: an update 2x one device's.
    (SGD shows a doubled gradient; Adam would hide it, being scale-free.)"""
    one, two = assert_equals_one_device(mlp, multi_optimizer, policy="mixed_float16", atol=5e-4)  # float16 rounding
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(1)
    start = mlp().get_weights()

    def update_norm(model):
        return np.sqrt(sum(np.sum((w - s) ** 2) for w, s in zip(model.get_weights(), start)))
    assert update_norm(two) == pytest.approx(update_norm(one), rel=1e-3)


def float64_layer():
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="tanh")(inputs)
    hidden = keras.layers.Dense(8, dtype="float64")(hidden)
    return keras.Model(inputs, keras.layers.Dense(1)(hidden))


def test_a_float64_layer_among_float32_ones():
    """A bucket holds one dtype: an all-reduce concatenates its gradients (ConcatV2 of float32 and float64 failed,
    with any bucket size; test_buckets_never_mix_dtypes shows the plans for 0 and one bucket)."""
    tfdist.set_bucket_bytes(1200)  # several buckets, float32 ones on both sides of the float64 layer's
    assert_equals_one_device(float64_layer, lambda: keras.optimizers.SGD(0.05, momentum=0.9))


def test_buckets_never_mix_dtypes():
    kinds = ["f32", "f32", "f64", "f64", "f32", "f32"]
    assert buckets.plan([4] * 6, 0, 0, kinds=kinds) == [[0, 1, 4, 5], [2, 3]]
    assert buckets.plan([4] * 6, 8, 8, kinds=kinds) == [[4, 5], [2, 3], [0, 1]]
    assert buckets.plan([4] * 6, 100, 100, kinds=kinds) == [[0, 1, 4, 5], [2, 3]]


def embedding_model():
    return keras.Sequential([keras.Input((4,), dtype="int32"), keras.layers.Embedding(20, 3),
                             keras.layers.Flatten(), keras.layers.Dense(1)])


def test_an_embedding_with_a_partial_last_batch():
    """46 examples at batch 16: the last step has fewer rows of the sparse gradient than the others in the same
    multi-step call, which failed TensorFlow's all-gather ("Shape mismatch in the collective instance")."""
    ids = np.random.default_rng(1).integers(0, 20, size=(46, 4)).astype("int32")  # rows repeat within a batch
    targets = np.random.default_rng(2).normal(size=(46, 1)).astype("float32")
    assert_equals_one_device(embedding_model, lambda: keras.optimizers.SGD(0.05, momentum=0.9), ids, targets)


@pytest.mark.parametrize("options", [
    {"use_ema": True, "ema_overwrite_frequency": 2, "loss_scale_factor": 8.0, "clipnorm": 0.05},
    {"gradient_accumulation_steps": 3, "use_ema": True, "ema_overwrite_frequency": 2, "global_clipnorm": 0.01},
    {"gradient_accumulation_steps": 2, "clipvalue": 0.01},
], ids=lambda options: "+".join(options))
def test_keras_optimizer_options(options):
    """Keras' use_ema overwrite and gradient_accumulation_steps put a merge_call inside a cond (keras#20582)."""
    # Adam divides by the root of tiny second moments, so float rounding of a near-zero gradient shows at 1e-6
    _, two = assert_equals_one_device(mlp, lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1, **options),
                                      atol=1e-5)
    steps = options.get("gradient_accumulation_steps", 1)
    assert int(two.optimizer.iterations.numpy()) == 2 * len(X) // GLOBAL // steps


@pytest.mark.parametrize("wrapper, name", [(lambda o: tfdist.DistributedOptimizer(o), "tfdist.DistributedOptimizer"),
                                           (lambda o: hvd.DistributedOptimizer(o), "hvd.DistributedOptimizer")])
def test_distributed_optimizer_refuses_a_multi_optimizer_and_names_the_fix(wrapper, name):
    optimizers = keras.optimizers.OptimizerMap(keras.optimizers.SGD(0.05))
    with pytest.raises(TypeError, match=rf"{re.escape(name)} wraps one optimizer; received a MultiOptimizer\. Under "
                                        r"tfdist a MultiOptimizer works as it is .* wrap its inner optimizers: "
                                        rf"keras\.optimizers\.OptimizerMap\({re.escape(name)}\(opt, "):
        wrapper(keras.optimizers.MultiOptimizer(optimizers))

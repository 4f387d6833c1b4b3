"""tfdist.precision: policy names, optimizer wrapping, output checks, scope(precision=...)."""

import keras
import numpy as np
import pytest

import tfdist
from tfdist import precision

pytestmark = pytest.mark.usefixtures("restore_dtype_policy")


@pytest.mark.parametrize("name", ["float32", "mixed_float16", "mixed_bfloat16"])
def test_set_policy_sets_keras_policy(name):
    assert precision.set_policy(name) == name
    assert keras.config.dtype_policy().name == name


def test_unknown_policy_lists_the_valid_ones():
    with pytest.raises(precision.PrecisionError,
                       match=r"Unknown precision 'float16'; choose one of \['float32', 'mixed_float16', "
                             r"'mixed_bfloat16', 'auto'\]"):
        precision.set_policy("float16")


@pytest.mark.parametrize("capabilities, expected", [
    ([], "float32"),                          # CPU only
    ([(6, 1)], "float32"),                    # Pascal: no tensor cores
    ([(7, 0)], "mixed_float16"),              # Volta
    ([(7, 5), (7, 5)], "mixed_float16"),      # Turing
    ([(8, 0)], "mixed_bfloat16"),             # Ampere
    ([(9, 0), (8, 6)], "mixed_bfloat16"),
    ([(8, 0), (7, 0)], "mixed_float16"),      # the oldest GPU decides
])
def test_auto_policy_follows_compute_capability(capabilities, expected):
    assert precision.auto_policy(capabilities) == expected


def test_auto_on_this_cpu_machine_is_float32(no_gpu_here):
    assert precision.auto_policy() == "float32"
    assert precision.set_policy("auto") == "float32"


def test_mixed_float16_keeps_float32_variables_and_computes_in_float16():
    precision.set_policy("mixed_float16")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    dense = model.layers[0]
    assert dense.kernel.dtype == "float32" and dense.bias.dtype == "float32"
    assert dense.compute_dtype == "float16"
    assert keras.backend.standardize_dtype(model(np.ones((2, 4), "float32")).dtype) == "float16"
    model.compile(optimizer="sgd", loss="mse")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)


def test_mixed_bfloat16_computes_in_bfloat16_without_loss_scaling():
    precision.set_policy("mixed_bfloat16")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    assert model.layers[0].kernel.dtype == "float32" and model.layers[0].compute_dtype == "bfloat16"
    model.compile(optimizer="sgd", loss="mse")
    assert isinstance(model.optimizer, keras.optimizers.SGD)


def test_wrap_optimizer_wraps_for_float16_only_and_never_nests():
    sgd = keras.optimizers.SGD(0.1)
    assert precision.wrap_optimizer(sgd) is sgd  # float32
    precision.set_policy("mixed_bfloat16")
    assert precision.wrap_optimizer(sgd) is sgd
    precision.set_policy("mixed_float16")
    wrapped = precision.wrap_optimizer(sgd, initial_scale=1024, dynamic_growth_steps=10)
    assert isinstance(wrapped, keras.optimizers.LossScaleOptimizer)
    assert wrapped.inner_optimizer is sgd
    assert (wrapped.initial_scale, wrapped.dynamic_growth_steps) == (1024.0, 10)
    assert precision.wrap_optimizer(wrapped) is wrapped
    assert precision.current_loss_scale(wrapped) == 1024.0
    assert precision.current_loss_scale(sgd) is None


def test_wrap_optimizer_wraps_any_optimizer_and_finds_a_nested_loss_scale():
    class Wrapper(keras.optimizers.SGD):  # the shape of an optimizer that wraps another
        def __init__(self, inner):
            super().__init__(0.1)
            self.inner_optimizer = inner

    inner = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam())
    outer = Wrapper(inner)
    assert precision.wrap_optimizer(outer, loss_scale=True) is outer
    plain = Wrapper(keras.optimizers.Adam())
    assert precision.wrap_optimizer(plain, loss_scale=True).inner_optimizer is plain


def test_wrap_optimizer_forced_under_bfloat16():
    precision.set_policy("mixed_bfloat16")
    assert isinstance(precision.wrap_optimizer(keras.optimizers.SGD(), loss_scale=True),
                      keras.optimizers.LossScaleOptimizer)


@pytest.mark.parametrize("kwargs, message", [
    ({"optimizer": "adam"}, r"needs a keras.optimizers.Optimizer instance; received str"),
    ({"initial_scale": 0}, r"initial_scale must be positive: received 0"),
    ({"dynamic_growth_steps": 0}, r"dynamic_growth_steps must be a positive int: received 0"),
    ({"dynamic_growth_steps": 2.5}, r"dynamic_growth_steps must be a positive int: received 2.5"),
])
def test_wrap_optimizer_rejects_bad_arguments(kwargs, message):
    kwargs = {"optimizer": keras.optimizers.SGD(), **kwargs}
    with pytest.raises(precision.PrecisionError, match=message):
        precision.wrap_optimizer(**kwargs)


def _classifier(last_dtype=None, fix_with_activation=False):
    layers = [keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
              keras.layers.Dense(3, activation="softmax", name="probs", dtype=last_dtype)]
    if fix_with_activation:
        layers.append(keras.layers.Activation("linear", dtype="float32", name="to_float32"))
    return keras.Sequential(layers, name="clf")


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_check_model_names_the_half_precision_output_layer(policy):
    precision.set_policy(policy)
    dtype = policy.removeprefix("mixed_")
    with pytest.warns(precision.PrecisionWarning,
                      match=rf"Model 'clf': output layer 'probs' computes in {dtype}.*dtype='float32'.*"
                            r"Activation\('linear', dtype='float32'\)"):
        assert precision.check_model(_classifier()) == ["probs"]


@pytest.mark.filterwarnings("error::tfdist.precision.PrecisionWarning")
def test_check_model_accepts_float32_outputs():
    precision.set_policy("mixed_float16")
    assert precision.check_model(_classifier(last_dtype="float32")) == []
    assert precision.check_model(_classifier(fix_with_activation=True)) == []
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(4)(inputs)
    two_heads = keras.Model(inputs, [keras.layers.Dense(1, dtype="float32")(hidden),
                                     keras.layers.Dense(1, name="half_head")(hidden)])
    with pytest.warns(precision.PrecisionWarning, match="'half_head'"):
        assert precision.check_model(two_heads) == ["half_head"]


def test_scope_sets_precision_for_the_block_and_fit_checks_the_model(fresh_tfdist_strategy):
    x = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
    y = np.arange(16) % 3
    with tfdist.scope("mirrored", devices="CPU:[0-1]", precision="mixed_float16") as strategy:
        assert strategy.num_replicas_in_sync == 2
        assert keras.config.dtype_policy().name == "mixed_float16"
        model = _classifier()
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    assert keras.config.dtype_policy().name == "float32"
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    with pytest.warns(precision.PrecisionWarning, match="output layer 'probs' computes in float16"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)


def test_scope_and_init_reject_an_unknown_precision_before_building(fresh_tfdist_strategy):
    from tfdist import strategy

    with pytest.raises(precision.PrecisionError, match=r"Unknown precision 'fp16'"):
        with tfdist.scope(precision="fp16"):
            pass
    with pytest.raises(precision.PrecisionError, match=r"Unknown precision 'half'"):
        tfdist.init(precision="half")
    assert strategy.current_strategy() is None


def test_init_sets_the_policy_for_the_process(fresh_tfdist_strategy):
    import tensorflow as tf

    try:
        tfdist.init("default", precision="mixed_bfloat16")
        assert keras.config.dtype_policy().name == "mixed_bfloat16"
    finally:
        tf.distribute.experimental_set_strategy(None)


def test_check_model_falls_back_to_the_last_layer_of_a_subclassed_model():
    class Net(keras.Model):
        def __init__(self):
            super().__init__(name="net")
            self.hidden = keras.layers.Dense(4)
            self.head = keras.layers.Dense(2, name="head")

        def call(self, x):
            return self.head(self.hidden(x))

    precision.set_policy("mixed_float16")
    with pytest.warns(precision.PrecisionWarning, match="Model 'net': output layer 'head' computes in float16"):
        assert precision.check_model(Net()) == ["head"]

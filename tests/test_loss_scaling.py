"""Dynamic loss scaling with one device and with 2 mirrored replicas, and the tfdist fix.

An overflow (an infinite gradient) must skip the step on every replica and halve the
scale; ``dynamic_growth_steps`` finite steps in a row double it.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist import buckets, keras_fixes, precision, strategy as strategy_lib

pytestmark = pytest.mark.usefixtures("restore_dtype_policy")

START = np.array([1.0, 2.0], "float32")
INF = float("inf")


@pytest.fixture(scope="module")
def mirrored():
    return strategy_lib.make_strategy("mirrored", devices="CPU:[0-1]")


@pytest.fixture(params=["one_device", "mirrored"])
def strategy(request, mirrored):
    return mirrored if request.param == "mirrored" else tf.distribute.get_strategy()


def _setup(strategy, initial_scale=8.0, dynamic_growth_steps=2000):
    with strategy.scope():
        variable = keras.Variable(START, name="w")
        optimizer = precision.wrap_optimizer(keras.optimizers.SGD(0.5), initial_scale, dynamic_growth_steps,
                                             loss_scale=True)
        optimizer.build([variable])

    @tf.function
    def step(bad_replica):
        """Gradient [1, 1] on every replica, except [inf, 1] on replica ``bad_replica``."""
        def replica_fn():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            grad = tf.where(tf.equal(replica, bad_replica), tf.constant([INF, 1.0]), tf.constant([1.0, 1.0]))
            optimizer.apply([grad], [variable])
        strategy.run(replica_fn)

    return variable, optimizer, step


def _local(strategy, variable):
    """The variable's value on each replica."""
    return [v.numpy() for v in strategy.experimental_local_results(variable.value)]


def test_overflow_skips_the_step_and_halves_the_scale(strategy):
    variable, optimizer, step = _setup(strategy)
    step(tf.constant(-1))  # finite everywhere: an SGD step
    after_finite = START - 0.5 * strategy.num_replicas_in_sync / 8.0
    for value in _local(strategy, variable):
        np.testing.assert_allclose(value, after_finite)
    last_replica = strategy.num_replicas_in_sync - 1
    step(tf.constant(last_replica))  # the overflow lands on the last replica only
    for value in _local(strategy, variable):
        np.testing.assert_array_equal(value, after_finite.astype("float32"))
    assert [float(s) for s in _local(strategy, optimizer.dynamic_scale)] == [4.0] * strategy.num_replicas_in_sync
    assert int(optimizer.iterations.numpy()) == 1  # the skipped step does not count


def test_scale_doubles_after_dynamic_growth_steps_finite_steps(strategy):
    variable, optimizer, step = _setup(strategy, initial_scale=8.0, dynamic_growth_steps=3)
    scales = []
    for _ in range(7):
        step(tf.constant(-1))
        scales.append(precision.current_loss_scale(optimizer))
    assert scales == [8.0, 8.0, 16.0, 16.0, 16.0, 32.0, 32.0]
    for value in _local(strategy, variable):
        assert np.all(np.isfinite(value))


def _fit_one_batch_that_overflows_on_replica_1(mirrored):
    """Through compile's own LossScaleOptimizer: float16 turns 1e5 into inf on replica 1 only."""
    precision.set_policy("mixed_float16")
    with mirrored.scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, kernel_initializer="zeros")])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    before = model.get_weights()  # zeros: replica 0's scaled gradients (-2**15) fit in float16
    x = np.array([[1, 1], [1, 1], [1, 1], [1e5, 1]], "float32")  # rows 2-3 go to replica 1
    model.fit(x, np.ones((4, 1), "float32"), batch_size=4, epochs=1, shuffle=False, verbose=0)
    return model, before


@pytest.mark.filterwarnings("ignore::tfdist.precision.PrecisionWarning")
def test_fit_under_mirrored_skips_a_batch_that_overflows_on_one_replica(mirrored):
    model, before = _fit_one_batch_that_overflows_on_replica_1(mirrored)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert precision.current_loss_scale(model.optimizer) == 2.0**14
    for got, want in zip(model.get_weights(), before):
        np.testing.assert_array_equal(got, want)
    for weight in model.weights:
        first, second = _local(mirrored, weight)
        np.testing.assert_array_equal(first, second)


@pytest.mark.filterwarnings("ignore::tfdist.precision.PrecisionWarning")
def test_without_the_fix_an_overflow_on_replica_1_reaches_the_weights(mirrored, monkeypatch):
    """Keras 3.15 reads replica 0's finite flag only. If this fails, Keras fixed it: drop the patch.

    Buckets off: with them, tfdist all-reduces before the check, which hides the bug as well."""
    monkeypatch.setattr(keras.optimizers.LossScaleOptimizer, "check_finite",
                        keras_fixes.original_of(keras.optimizers.LossScaleOptimizer.check_finite))
    monkeypatch.setattr(buckets, "_settings", {"bucket_bytes": 0, "first_bucket_bytes": 0})
    variable, optimizer, step = _setup(mirrored)
    step(tf.constant(1))
    assert all(not np.all(np.isfinite(value)) for value in _local(mirrored, variable))
    assert precision.current_loss_scale(optimizer) == 8.0  # the scale did not even drop
    model, _ = _fit_one_batch_that_overflows_on_replica_1(mirrored)
    assert not all(np.all(np.isfinite(w)) for w in model.get_weights())
    assert precision.current_loss_scale(model.optimizer) == 2.0**15


@pytest.mark.filterwarnings("ignore::tfdist.precision.PrecisionWarning")
def test_wrap_optimizer_composes_with_distributed_optimizer(mirrored):
    """LossScaleOptimizer(DistributedOptimizer(SGD, k=2)): overflows skipped, then one accumulated step."""
    precision.set_policy("mixed_float16")
    with mirrored.scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, kernel_initializer="zeros")])
        inner = tfdist.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2)
        optimizer = precision.wrap_optimizer(inner)
        model.compile(optimizer=optimizer, loss="mse")
    assert model.optimizer is optimizer and optimizer.inner_optimizer is inner
    y = np.ones((8, 1), "float32")
    model.fit(np.array([[1, 1], [1, 1], [1, 1], [1e5, 1]] * 2, "float32"), y, batch_size=4, shuffle=False, verbose=0)
    assert precision.current_loss_scale(optimizer) == 2.0**13  # two skipped steps
    assert all(np.all(w == 0) for w in model.get_weights())
    model.fit(np.ones((8, 2), "float32"), y, batch_size=4, shuffle=False, verbose=0)
    assert int(optimizer.iterations.numpy()) == 1  # 2 micro-batches, 1 update
    for weight in model.get_weights():  # mse gradient -2 at zero weights
        np.testing.assert_allclose(weight, 0.2, rtol=1e-6)


def test_fp16_wire_skips_only_the_steps_one_device_skips(mirrored):
    """Scaled gradients of 3 * 2**15 = 98304 overflow float16 (65504); tfdist sends them unscaled, so no step is lost.

    One device, gradient [6, 2]; two replicas, [3, 1] each (the same global batch), all-reduced in float16.
    """
    def train(strategy, compression):
        with strategy.scope():
            variable = keras.Variable(START, name="w")
            optimizer = keras.optimizers.LossScaleOptimizer(
                tfdist.DistributedOptimizer(keras.optimizers.SGD(0.01), compression=compression), initial_scale=2.0**15)
            optimizer.build([variable])

        @tf.function
        def step():
            def replica_fn():
                grad = tf.constant([6.0, 2.0]) / strategy.num_replicas_in_sync * optimizer.dynamic_scale
                optimizer.apply([grad], [variable])
            strategy.run(replica_fn)

        for _ in range(3):
            step()
        return int(optimizer.inner_optimizer.iterations.numpy()), precision.current_loss_scale(optimizer), \
            _local(strategy, variable)

    steps, scale, (weights,) = train(tf.distribute.get_strategy(), tfdist.Compression.none)
    assert (steps, scale) == (3, 2.0**15)  # no step skipped on one device
    fp16_steps, fp16_scale, replicas = train(mirrored, tfdist.Compression.fp16)
    assert (fp16_steps, fp16_scale) == (steps, scale)
    for value in replicas:
        np.testing.assert_allclose(value, weights, rtol=1e-6)

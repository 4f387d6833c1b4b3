"""Every term of fit's loss weighs as on one device, whatever Keras path it takes (issue 49;
tfdist.keras_fixes.batch_shares): several outputs with loss weights, a sum beside a mean, ``add_loss``, a
masked sequence loss, a loss function that returns a scalar, a ``compute_loss`` of the model's own, and the
paths that all-reduce the counts first (a loss scale, gradient accumulation). 2 logical CPUs against one
device, batches of 6 over 45 examples (the last, 3, splits 2/1)."""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import tfdist
from tests.jobs import run_job
from tfdist.keras_fixes import batch_shares

pytestmark = pytest.mark.usefixtures("fresh_tfdist_strategy")

EXAMPLES, BATCH = 45, 6


def _data(sequence=False, examples=EXAMPLES):
    rng = np.random.default_rng(4)
    if sequence:  # padded sequences of 1-5 steps: the replicas' unmasked steps differ
        x = rng.normal(size=(examples, 5, 3)).astype("float32")
        lengths = rng.integers(1, 6, size=examples)
        x[np.arange(5)[None, :] >= lengths[:, None]] = 0.0
        return x, rng.normal(size=(examples, 5, 2)).astype("float32")
    x = rng.normal(size=(examples, 4)).astype("float32")
    return x, {"a": rng.normal(size=(examples, 2)).astype("float32"),
               "b": rng.normal(size=(examples, 1)).astype("float32")}


class _ActivityMean(keras.layers.Layer):
    """An ``add_loss`` that is a mean over the batch's examples (an activity penalty)."""

    def call(self, inputs):
        self.add_loss(0.3 * ops.mean(ops.square(inputs)))
        return inputs


def _two_outputs():
    inputs = keras.Input((4,))
    hidden = _ActivityMean()(keras.layers.Dense(5, activation="tanh", kernel_regularizer="l2")(inputs))
    return keras.Model(inputs, {"a": keras.layers.Dense(2, name="a")(hidden),
                                "b": keras.layers.Dense(1, name="b")(hidden)})


def _sequence():
    inputs = keras.Input((5, 3))
    hidden = keras.layers.Masking()(inputs)
    return keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Dense(4, activation="tanh")(hidden)))


class OwnLossModel(keras.Model):
    """``compute_loss`` of the model's own: Keras' losses through ``super()``, plus ``extra`` of its own."""

    extra = 0.0

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training)
        return loss + self.extra * ops.mean(ops.square(keras.tree.flatten(y_pred)[0])) if self.extra else loss


def _own_loss(extra):
    def build():
        base = _two_outputs()
        model = OwnLossModel(base.inputs, base.outputs)
        model.extra = extra
        return model
    return build


def _scalar_sum(y_true, y_pred):  # a loss function that returns its batch's sum (Keras leaves it unreduced)
    return ops.sum(ops.square(y_true - y_pred))


class OwnCallSum(keras.losses.Loss):
    """A Loss whose ``__call__`` is its own: no Keras reduction sees its value."""

    def __call__(self, y_true, y_pred, sample_weight=None):
        return ops.sum(ops.square(y_true - y_pred))


TWO_LOSSES = {"a": keras.losses.MeanSquaredError(reduction="sum"), "b": keras.losses.Huber()}
CASES = {
    # the sum's global count is all-reduced inside compute_loss (a merge_call): the other replica's forward pass
    # runs meanwhile and replaced this replica's add_loss on the shared layer, until compute_loss read a snapshot
    "sum_beside_a_mean_with_loss_weights": (_two_outputs, lambda: TWO_LOSSES, {"a": 0.3, "b": 2.0}, {}),
    # one value for the batch: summed over the replicas as Keras does (exact for a sum)
    "scalar_sum_function": (_two_outputs, lambda: {"a": _scalar_sum, "b": "mse"}, None, {}),
    # a Loss of its own __call__: nothing may be divided after the all-reduce (it was never multiplied)
    "loss_with_its_own_call": (_two_outputs, lambda: {"a": OwnCallSum(), "b": "mse"}, None, {}),
    "masked_sequence_mean": (_sequence, lambda: keras.losses.MeanSquaredError(), None, {}),
    "masked_sequence_weighted": (_sequence, lambda: keras.losses.MeanSquaredError(
        reduction="mean_with_sample_weight"), None, {}),
    "compute_loss_calling_super": (_own_loss(0.0), lambda: TWO_LOSSES, None, {}),
    "loss_scale_counts_apart": (_two_outputs, lambda: TWO_LOSSES, None, {"loss_scale": True}),
    "accumulation_counts_apart": (_two_outputs, lambda: TWO_LOSSES, None, {"gradient_accumulation_steps": 2}),
}


def _optimizer(loss_scale=False, **options):
    optimizer = keras.optimizers.SGD(0.01, **options)
    return keras.optimizers.LossScaleOptimizer(optimizer) if loss_scale else optimizer


def _run(case, strategy=None, examples=EXAMPLES):
    build, losses, loss_weights, options = CASES[case] if isinstance(case, str) else case
    x, y = _data(build is _sequence, examples)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        keras.utils.set_random_seed(2)
        model = build()
        model.compile(_optimizer(**options), losses(), loss_weights=loss_weights)
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    logged = [history.history[key] for key in sorted(history.history)]  # the loss and each output's loss
    return model.get_weights(), logged, model.evaluate(x, y, batch_size=BATCH, verbose=0)


def _mirrored():
    with tfdist.scope("mirrored", devices="CPU:[0-1]") as strategy:
        pass
    return strategy


def _assert_equal(got, want):
    for a, b in zip(got[0], want[0]):
        np.testing.assert_allclose(a, b, atol=1e-6)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5)
    np.testing.assert_allclose(got[2], want[2], rtol=1e-5)


@pytest.mark.filterwarnings("ignore:A loss returned one value")
@pytest.mark.parametrize("case", list(CASES))
def test_every_loss_term_weighs_as_on_one_device(case):
    _assert_equal(_run(case, _mirrored()), _run(case))


def test_a_loss_of_one_value_for_the_batch_is_named_once():
    batch_shares._warned_scalar[0] = False
    with pytest.warns(UserWarning, match=r"A loss returned one value for the whole batch under several replicas: "
                                         r"tfdist cannot tell a mean from a sum, so it sums the replicas' values"):
        _run("scalar_sum_function", _mirrored())


def test_a_tensor_of_the_models_own_is_summed_over_the_replicas_as_keras_does(monkeypatch):
    """A ``compute_loss`` that adds a mean of its own: tfdist weighs what passes through Keras' losses, and the
    rest as Keras weighs it (summed over the replicas): with an even split, Keras' own weights."""
    case = (_own_loss(0.2), lambda: {"a": "mse", "b": "mse"}, None, {})
    strategy = _mirrored()
    exact = _run(case, strategy, examples=48)  # batches of 6 split 3/3
    monkeypatch.setenv(batch_shares.ENV, "keras")
    _assert_equal(exact, _run(case, strategy, examples=48))



# (per-example loss shape, sample_weight shape): a dataset's [B, 1] weights column, a sequence loss with one
# weight per example or per step, and the rank-matching cases.
AVERAGE_SHAPES = [((4,), None), ((4,), (4,)), ((4,), (4, 1)), ((4, 1), (4,)), ((4, 4), (4,)), ((4, 3), (4,)),
                  ((4, 3), (4, 1)), ((4, 3), (4, 3))]


@pytest.mark.parametrize("loss_shape, weight_shape", AVERAGE_SHAPES)
def test_compute_average_loss_is_tf_nn_compute_average_loss(loss_shape, weight_shape):
    """One replica: ``tf.nn.compute_average_loss``'s value (it broadcast [4] with [4, 1] to an outer product, and
    applied [4] weights along a sequence's steps)."""
    rng = np.random.default_rng(1)
    loss = tf.constant(rng.uniform(size=loss_shape), tf.float32)
    weight = None if weight_shape is None else tf.constant(rng.uniform(size=weight_shape), tf.float32)
    assert tfdist.compute_average_loss(loss, weight).numpy() == tf.nn.compute_average_loss(loss, weight).numpy()


@pytest.mark.parametrize("loss_shape, weight_shape", AVERAGE_SHAPES)
def test_compute_average_loss_under_replicas_divides_by_the_global_count(loss_shape, weight_shape):
    """2 replicas hold 3 and 1 of the 4 examples: their values add up to ``tf.nn.compute_average_loss`` of the
    whole batch."""
    rng = np.random.default_rng(1)
    loss = rng.uniform(size=loss_shape).astype("float32")
    weight = None if weight_shape is None else rng.uniform(size=weight_shape).astype("float32")
    strategy = _mirrored()
    parts = strategy.experimental_distribute_values_from_function(
        lambda context: (loss[:3], None if weight is None else weight[:3]) if context.replica_id_in_sync_group == 0
        else (loss[3:], None if weight is None else weight[3:]))
    per_replica = strategy.run(tf.function(lambda part: tfdist.compute_average_loss(*part)), args=(parts,))
    got = strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)
    np.testing.assert_allclose(got.numpy(), tf.nn.compute_average_loss(loss, weight).numpy(), rtol=1e-6)


def test_compute_average_loss_names_weights_that_do_not_broadcast():
    with pytest.raises(ValueError, match=r"compute_average_loss: sample_weight of shape \(5,\) does not broadcast to "
                                         r"per_example_loss of shape \(4, 3\) .*give one weight per example"):
        tfdist.compute_average_loss(tf.ones((4, 3)), tf.ones((5,)))


class AverageLossModel(keras.Model):
    """A ``train_step`` of its own, as TensorFlow's custom-training guide writes one: ``compute_average_loss`` of
    the per-example losses, then the ``add_loss`` losses by ``tf.nn.scale_regularization_loss``."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            per_example = ops.mean(ops.square(y["b"] - y_pred["b"]), axis=-1)
            loss = tfdist.compute_average_loss(per_example)
            loss += tf.nn.scale_regularization_loss(tf.add_n(self.losses))
        self.optimizer.apply_gradients(zip(tape.gradient(loss, self.trainable_variables), self.trainable_variables))
        return {"loss": loss}


class Stash(keras.layers.Layer):
    """Keeps a per-example penalty as an attribute (MoE and VAE layers do), read in compute_loss."""

    def call(self, inputs):
        self.penalty = ops.mean(ops.square(inputs), axis=-1)
        return inputs


class StashModel(keras.Model):
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training)
        return loss + 0.3 * tfdist.compute_average_loss(self.get_layer("stash").penalty)  # one replica's: as Keras


def _own_loss_model(cls, stash=False):
    def build():
        inputs = keras.Input((4,))
        hidden = keras.layers.Dense(5, activation="tanh", activity_regularizer=keras.regularizers.L2(0.3))(inputs)
        hidden = Stash(name="stash")(hidden) if stash else hidden
        return cls(inputs, {"a": keras.layers.Dense(2, name="a")(hidden), "b": keras.layers.Dense(1, name="b")(hidden)})
    return build


@pytest.mark.parametrize("build", [_own_loss_model(AverageLossModel), _own_loss_model(StashModel, stash=True)],
                         ids=["compute_average_loss_and_self_losses", "a_stashed_penalty_after_super"])
def test_state_the_forward_pass_leaves_is_this_replicas(build):
    """compute_average_loss's all-reduce is launched in the replica's thread: with a merge_call the other replica's
    forward pass ran meanwhile and replaced the add_loss losses and attributes on the shared layers (0.037 off)."""
    case = (build, lambda: {"a": "mse", "b": "mse"}, None, {})
    got, want = _run(case, _mirrored(), examples=48), _run(case, examples=48)
    for a, b in zip(got[0], want[0]):
        np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("mode", ["fit", "horovod", "dynamic"])
def test_a_workers_static_shapes_do_not_choose_its_collectives(tmp_path, mode):
    """Worker 0's batches have a static time dimension, worker 1's a dynamic one (padded): each chose another
    weighing and their collectives mismatched ("Shape mismatch in the collective instance"); under tfdist.horovod
    the count rode with one rank's join flag only, and hvd.join() could not stand in for gradients of no static
    shape (``dynamic``: both ranks padded)."""
    job = run_job("static_shapes_job.py", tmp_path, mode, timeout=240).check()
    assert job.results[0]["weights"] == job.results[1]["weights"]

"""A global batch that does not split evenly over 2 logical CPUs trains, evaluates and predicts as on one device
(issue 43): each replica's loss weighs by its share of the batch (tfdist.keras_fixes.batch_shares), and a batch
that does not divide by the replicas no longer fails Keras' build. The 2- and 3-worker cases run in
tests/test_multi_worker.py."""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.jobs import run_job
from tests.workers import common
from tfdist.keras_fixes import batch_shares

pytestmark = pytest.mark.usefixtures("fresh_tfdist_strategy")


def one_and_two(examples, batch, optimizer):
    one = common.uneven_run(common.uneven_model(optimizer), examples, batch)
    with tfdist.scope("mirrored", devices="CPU:[0-1]"):
        model = common.uneven_model(optimizer)
    return one, common.uneven_run(model, examples, batch)


# (49, 4): the last batch (1 example) splits 1/0; (5, 5): every batch splits 3/2 (Keras' build failed: "Inputs to
# operation AddN ... must have the same size and shape"); (45, 6): the last batch (3) splits 2/1.
@pytest.mark.parametrize("examples, batch, optimizer", common.UNEVEN_CASES)
def test_uneven_splits_train_evaluate_and_predict_as_one_device(examples, batch, optimizer):
    one, two = one_and_two(examples, batch, optimizer)
    common.assert_uneven_run_equal(two, one, examples, batch)


@pytest.mark.parametrize("examples, batch, reduction", common.REDUCTION_CASES)
def test_every_reduction_trains_as_one_device(examples, batch, reduction):
    """Issue 49: a ``sum`` reduction (no 1 / replicas in Keras: its gradients were divided by the global count
    without the count's factor, 0.11x one device's step) and ``mean_with_sample_weight`` (each replica divides
    by its own weights' sum) give one device's weights, loss and evaluation."""
    one = common.reduction_run(examples, batch, reduction)
    with tfdist.scope("mirrored", devices="CPU:[0-1]") as strategy:
        pass
    common.assert_uneven_run_equal(common.reduction_run(examples, batch, reduction, strategy), one, examples, batch)


def test_keras_weighting_comes_back_on_request(monkeypatch):
    """TFDIST_BATCH_WEIGHTING=keras: each replica's mean loss by 1/replicas, as Keras and plain MirroredStrategy."""
    monkeypatch.setenv(batch_shares.ENV, "keras")
    one, two = one_and_two(45, 6, "sgd")
    assert np.abs(np.subtract(two["weights"][0], one["weights"][0])).max() > 1e-3  # the 2/1 split's examples weigh 1/4 and 1/2


def test_a_bad_weighting_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(batch_shares.ENV, "horovod")
    with pytest.raises(ValueError, match=r"TFDIST_BATCH_WEIGHTING='horovod': use 'exact' \(each replica's loss "
                                         r"weighs by its share of the global batch, as one device\) or 'keras'"):
        batch_shares.weighting()


def test_compute_average_loss_in_a_custom_loop_needs_no_global_batch_size():
    """strategy.run over batches of 5 (3/2) and a last one of 1 (1/0): the weights of one device's mean loss."""
    with tfdist.scope("mirrored", devices="CPU:[0-1]") as strategy:
        pass
    for got, want in zip(common.uneven_loop(strategy), common.uneven_loop_by_hand()):
        np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.fixture(scope="module", params=[2, 3], ids=["2-workers", "3-workers"])
def job(request, tmp_path_factory):
    return run_job("uneven_split_job.py", tmp_path_factory.mktemp("uneven"), num_workers=request.param,
                   timeout=300).check()


@pytest.mark.parametrize("examples, batch, optimizer", common.UNEVEN_CASES)
def test_workers_train_evaluate_and_predict_uneven_splits_as_one_device(job, examples, batch, optimizer):
    want = common.uneven_run(common.uneven_model(optimizer), examples, batch)
    runs = [result[f"{examples}/{batch}"] for result in job.results.values()]
    for got in runs:
        common.assert_uneven_run_equal(got, want, examples, batch)
        assert got["weights"] == runs[0]["weights"]  # every worker the same bits


@pytest.fixture(scope="module", params=[2, 3], ids=["2-ranks", "3-ranks"])
def hvd_job(request, tmp_path_factory):
    return run_job("uneven_split_hvd_job.py", tmp_path_factory.mktemp("uneven_hvd"), num_workers=request.param,
                   timeout=300).check()


@pytest.mark.parametrize("examples, batch, reduction", common.REDUCTION_CASES)
def test_workers_train_every_reduction_as_one_device(job, examples, batch, reduction):
    want = common.reduction_run(examples, batch, reduction)
    runs = [result[f"{examples}/{batch}/{reduction}"] for result in job.results.values()]
    for got in runs:
        common.assert_uneven_run_equal(got, want, examples, batch)
        assert got["weights"] == runs[0]["weights"]


@pytest.mark.parametrize("examples, batch, optimizer", common.UNEVEN_CASES + ((49, 4, "sgd_scaled"),))
def test_horovod_ranks_train_and_predict_uneven_splits_as_one_device(hvd_job, examples, batch, optimizer):
    """tfdist.horovod: each rank its share of every global batch (a rank out of the last one joins); every
    example weighs as on one device, and the ranks end bit-equal."""
    want = common.uneven_run(common.uneven_model(optimizer), examples, batch)
    runs = [hvd_job.results[rank][f"{examples}/{batch}/{optimizer}"] for rank in sorted(hvd_job.results)]
    for got in runs:
        for a, b in zip(got["weights"], want["weights"]):
            np.testing.assert_allclose(a, b, atol=1e-6)
        np.testing.assert_allclose(got["predict"], want["predict"], atol=1e-6)
        assert got["weights"] == runs[0]["weights"]
    if examples == 49:  # the last global batch (1 example) is rank 0's alone
        assert [run["batches"] for run in runs] == [13] + [12] * (len(runs) - 1)


def test_workers_custom_loop_with_compute_average_loss_equals_one_device(job):
    for result in job.results.values():
        for got, want in zip(result["loop"], common.uneven_loop_by_hand()):
            np.testing.assert_allclose(got, want, atol=1e-6)


def test_compute_average_loss_refuses_a_scalar():
    with pytest.raises(ValueError, match=r"compute_average_loss takes one loss per example .* reduction='none'"):
        tfdist.compute_average_loss(tf.constant(1.0))


class _LossInAddLoss(keras.layers.Layer):
    """``add_loss`` of a Keras Loss called in the forward pass (Keras scales it by 1/replicas there)."""

    def call(self, inputs):
        self.add_loss(0.1 * keras.losses.MeanSquaredError()(inputs, tf.zeros_like(inputs)))
        return inputs


def test_losses_called_outside_the_training_loss_weigh_as_on_one_device():
    """A Keras Loss called for ``add_loss`` in the forward pass (Keras scaled it by 1/replicas there and again as
    an additional loss: 1/replicas of one device's), and Losses used as metrics (Keras logged the mean of the
    replicas' 1/replicas shares: half of one device's on 2), on 45 examples in batches of 6 (the last splits
    2/1): one device's weights and logs."""
    x, y = common.uneven_data(45)

    def run(strategy=None):
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            keras.utils.set_random_seed(1)
            model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), _LossInAddLoss(),
                                      keras.layers.Dense(1)])
            model.compile(keras.optimizers.SGD(0.05), "mse", metrics=[
                keras.losses.MeanAbsoluteError(name="mae_loss"), keras.losses.MeanSquaredError(reduction="sum")])
        history = model.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0)
        return model.get_weights(), history.history, model.evaluate(x, y, batch_size=6, verbose=0)

    with tfdist.scope("mirrored", devices="CPU:[0-1]") as strategy:
        pass
    (got, got_history, got_evaluated), (want, want_history, want_evaluated) = run(strategy), run()
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert sorted(got_history) == sorted(want_history)
    for key in want_history:
        np.testing.assert_allclose(got_history[key], want_history[key], rtol=1e-5)
    np.testing.assert_allclose(got_evaluated, want_evaluated, rtol=1e-5)

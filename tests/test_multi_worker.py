"""A real 2-worker cluster started through `tfdist run`: Keras 3 fit/evaluate/predict work.

``fit`` under tfdist.scope() with per-worker data (``distribute_datasets_from_function``) of different lengths
finishes too. How: the workers agree on the longest worker's step count (tfdist.keras_fixes.uneven; Keras
took each worker's own, and the shorter one left its peers in a collective); TensorFlow's
distributed iterator all-reduces "has data" every step and feeds a worker out of data empty
batches, whose loss Keras reduces to 0 (divide_no_nan) and whose gradient is 0. tfdist weighs
each replica's loss by its share of the step's examples (tfdist.keras_fixes.batch_shares), so
the update is one device's on the step's examples (Keras' 1/replicas gave Horovod's join average,
whose denominator counts a worker with no data).
"""

import numpy as np
import pytest

from tests.jobs import run_job
from tests.workers import common


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return run_job("foundation_job.py", tmp_path_factory.mktemp("foundation"), timeout=240).check()


def test_workers_see_the_cluster(job):
    assert sorted(job.results) == [0, 1]
    for rank, result in job.results.items():
        assert result["strategy"] == "CollectiveAllReduceStrategy"  # TF's class behind MultiWorkerMirroredStrategy
        assert result["size"] == 2 and result["num_workers"] == 2
        assert result["rank"] == rank
        assert result["is_chief"] == (rank == 0)


def test_fit_evaluate_predict_complete_with_identical_weights(job):
    first, second = job.results[0], job.results[1]
    assert first["loss_history"] == second["loss_history"]
    assert first["loss_history"][-1] < first["loss_history"][0]
    assert first["evaluate_loss"] == pytest.approx(second["evaluate_loss"])
    assert first["predict_shape"] == [256, 1]
    for a, b in zip(first["final_weights"], second["final_weights"]):
        np.testing.assert_array_equal(a, b)


def test_two_workers_match_one_device(job):
    reference = common.train_equivalence()
    for rank in (0, 1):
        for got, want in zip(job.results[rank]["equivalence_weights"], reference):
            np.testing.assert_allclose(got, want, atol=1e-5)


def test_steps_per_execution_3_matches_one_device_step_by_step(job):
    """keras#19246: K steps per call under MultiWorkerMirroredStrategy (5 steps: a chunk of 3, then 2)."""
    reference = common.train_equivalence()
    for rank in (0, 1):
        for got, want in zip(job.results[rank]["steps_per_execution_3"], reference):
            np.testing.assert_allclose(got, want, atol=1e-5)


def test_auto_k_is_agreed_when_only_one_worker_has_a_per_batch_callback(job):
    """Each worker picks K from its own callbacks: a logger on the chief alone must not give 1 against 16."""
    first, second = (job.results[rank]["auto_k_callback_on_one_worker"] for rank in (0, 1))
    assert first["steps"] == second["steps"] == 8
    assert first["weights"] == second["weights"]


def test_step_counts_k_does_not_divide_are_the_users(job):
    """K=4 and tfdist's default K ("auto") run exactly the steps asked for, as K=1 does, on 2 workers."""
    for rank in (0, 1):
        counts = job.results[rank]["step_counts"]
        common.assert_same_steps(counts["1"], counts["4"])
        common.assert_same_steps(counts["1"], counts["None"])
    for a, b in zip(job.results[0]["step_counts"]["None"]["weights"], job.results[1]["step_counts"]["None"]["weights"]):
        np.testing.assert_array_equal(a, b)


def test_fit_on_numpy_arrays_matches_one_device_with_validation(job):
    """fit(x=ndarray, y=ndarray, batch_size=GLOBAL): each worker trains on its share of each batch."""
    reference = common.train_equivalence_on_arrays()
    for rank in (0, 1):
        got = job.results[rank]["arrays"]
        for a, b in zip(got["weights"], reference["weights"]):
            np.testing.assert_allclose(a, b, atol=1e-5)
        assert got["val_loss_split"] == pytest.approx(reference["val_loss_split"], abs=1e-5)
        assert got["val_loss_data"] == pytest.approx(reference["val_loss_data"], abs=1e-5)


def test_fit_with_fewer_batches_on_one_worker_finishes_as_one_device_on_each_steps_examples(job):
    uneven = [job.results[rank]["uneven"] for rank in (0, 1)]
    first, second = uneven[0]["fit"], uneven[1]["fit"]
    assert first["steps"] == second["steps"] == 10  # the longer worker's batches
    assert uneven[0]["batches"] == uneven[1]["batches"] == [10, 10]  # with a batch callback too
    for a, b in zip(first["weights"], second["weights"]):
        np.testing.assert_array_equal(a, b)
    want = common.join_by_hand([common.join_data(0, 10), common.join_data(1, 6)], per_example=True)
    for got, expected in zip(first["weights"], want):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert np.isfinite(first["loss"]).all() and first["loss"] == second["loss"]


def test_metrics_are_averaged_over_every_worker(job):
    """keras#19280: a metric is the mean over every example of every worker (40 and 24, uneven), the same on each."""
    kernel, bias = (np.asarray(w) for w in job.results[0]["uneven"]["fit"]["weights"])
    x = np.concatenate([common.join_data(10, 10)[0], common.join_data(11, 6)[0]])
    y = np.concatenate([common.join_data(10, 10)[1], common.join_data(11, 6)[1]])
    error = x @ kernel + bias - y
    for rank in (0, 1):
        result = job.results[rank]["uneven"]["evaluate"]
        assert result["mae"] == pytest.approx(np.abs(error).mean(), rel=1e-5)
        assert result["loss"] == pytest.approx((error ** 2).mean(), rel=1e-5)


def test_without_the_fix_keras_multi_worker_fit_fails(tmp_path):
    """If this starts passing, Keras fixed keras#20585 and tfdist.keras_fixes.multi_worker can go."""
    result = run_job("tutorial/main.py", tmp_path, timeout=120, launcher_args=("--no-fixes",))
    assert result.returncode != 0
    assert "Attempt to convert a value (PerReplica" in result.output
    assert not result.results

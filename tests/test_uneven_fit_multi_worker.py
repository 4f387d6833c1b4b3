"""``fit`` under tfdist.scope() with per-worker data (``distribute_datasets_from_function``) of different lengths
finishes on 2 real workers.

How: the workers agree on the longest worker's step count (tfdist.keras_fixes.uneven; Keras
took each worker's own, and the shorter one left its peers in a collective); TensorFlow's
distributed iterator all-reduces "has data" every step and feeds a worker out of data empty
batches, whose loss Keras reduces to 0 (divide_no_nan) and whose gradient is 0. Keras scales
each replica's loss by 1/replicas, so the update is Horovod's join average (the denominator
counts every worker).
"""

import numpy as np
import pytest

from tests.jobs import run_job
from tests.workers import common


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return run_job("uneven_fit_job.py", tmp_path_factory.mktemp("uneven")).check()


def test_fit_with_fewer_batches_on_one_worker_finishes_with_the_join_average(job):
    first, second = job.results[0]["fit"], job.results[1]["fit"]
    assert first["steps"] == second["steps"] == 10  # the longer worker's batches
    assert job.results[0]["batches"] == job.results[1]["batches"] == [10, 10]  # with a batch callback too
    for a, b in zip(first["weights"], second["weights"]):
        np.testing.assert_array_equal(a, b)
    want = common.join_by_hand([common.join_data(0, 10), common.join_data(1, 6)])
    for got, expected in zip(first["weights"], want):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert np.isfinite(first["loss"]).all() and first["loss"] == second["loss"]


def test_metrics_are_averaged_over_every_worker(job):
    """keras#19280: a metric is the mean over every example of every worker (40 and 24, uneven), the same on each."""
    kernel, bias = (np.asarray(w) for w in job.results[0]["fit"]["weights"])
    x = np.concatenate([common.join_data(10, 10)[0], common.join_data(11, 6)[0]])
    y = np.concatenate([common.join_data(10, 10)[1], common.join_data(11, 6)[1]])
    error = x @ kernel + bias - y
    for rank in (0, 1):
        result = job.results[rank]["evaluate"]
        assert result["mae"] == pytest.approx(np.abs(error).mean(), rel=1e-5)
        assert result["loss"] == pytest.approx((error ** 2).mean(), rel=1e-5)

"""BatchNormalization on 2 real workers: statistics the mean over workers, saved by the chief; synchronized BN
equals 1 device."""

import keras
import numpy as np
import pytest

from tests.jobs import run_job
from tests.workers import common


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("batchnorm")
    return run_job("batchnorm_job.py", out, timeout=420).check(), out


def test_every_weight_equal_on_both_workers_statistics_the_mean_of_theirs(job):
    result, _ = job
    first, second = result.results[0], result.results[1]
    assert first["replicas"] == 2
    for a, b in zip(first["plain_weights"], second["plain_weights"]):
        np.testing.assert_array_equal(a, b)
    moving_mean, moving_variance = first["plain_weights"][4], first["plain_weights"][5]  # after gamma, beta
    np.testing.assert_allclose(moving_mean, np.mean([first["local"][0], second["local"][0]], 0), rtol=1e-6)
    np.testing.assert_allclose(moving_variance, np.mean([first["local"][1], second["local"][1]], 0), rtol=1e-6)
    assert not np.allclose(first["local"][0], second["local"][0])  # each worker's shard had its own statistics
    assert first["plain_loss"][-1] < first["plain_loss"][0]


def test_mobilenet_v2_ends_with_every_weight_equal_on_both_workers(job):
    """The TensorFlow guide's model: its BatchNormalization statistics included, bit for bit."""
    result, _ = job
    first, second = result.results[0]["mobilenet"], result.results[1]["mobilenet"]
    assert first["statistics"] == 2 * 52 and first["statistics_moved"]  # moving mean and variance of 52 BN layers
    assert first["weights"] == second["weights"]


def test_the_chiefs_saved_model_holds_the_mean_statistics(job):
    result, out = job
    assert sorted(p.name for p in out.iterdir()) == ["bn.keras", "worker0.json", "worker1.json"]
    restored = keras.models.load_model(out / "bn.keras")
    for got, want in zip(restored.get_weights(), result.results[1]["plain_weights"]):
        np.testing.assert_array_equal(got, want)


def test_synchronized_batchnorm_on_two_workers_equals_one_device(job):
    result, _ = job
    reference, reference_loss = common.train_batchnorm_cnn(synchronized=True)
    for rank in (0, 1):
        for got, want in zip(result.results[rank]["synced_weights"], reference.get_weights()):
            np.testing.assert_allclose(got, want, atol=1e-5)
        np.testing.assert_allclose(result.results[rank]["synced_loss"], reference_loss, rtol=1e-5)


def test_gradient_buckets_do_not_wait_for_synchronized_batchnorms_backward_all_reduce(job):
    """Its all-reduces run in their own lane: the last layer's bucket starts before the backward pass reaches the
    layer; the bucket of the convolution before it waits, as its data needs."""
    result, _ = job
    for rank in (0, 1):
        lane = result.results[rank]["sync_bn_lane"]
        assert lane["buckets"] >= 2 and lane["layer_collectives"] == 2, lane
        assert not lane["first_bucket_waits"] and lane["last_bucket_waits"], lane

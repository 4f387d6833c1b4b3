"""A real 2-worker `tfdist run` job reads TFRecord shards through tfdist.data and trains."""

import numpy as np
import pytest

from tests.jobs import run_job
from tfdist import data

NUM_RECORDS, NUM_SHARDS, GLOBAL_BATCH = 128, 4, 16


def bright_or_dark(num_records):
    """Label 1: bright images, label 0: dark ones (learnable in a few SGD steps)."""
    rng = np.random.default_rng(0)
    labels = np.arange(num_records) % 2
    images = rng.integers(0, 100, (num_records, 8, 8, 3)) + 120 * labels[:, None, None, None]
    return images.astype(np.uint8), labels


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    shards = data.write_tfrecords(bright_or_dark(NUM_RECORDS), str(tmp_path_factory.mktemp("shards")),
                                  num_shards=NUM_SHARDS)
    steps = NUM_RECORDS // GLOBAL_BATCH
    return run_job("data_job.py", tmp_path_factory.mktemp("data_job"), shards.pattern, str(GLOBAL_BATCH),
                   str(steps)).check()


def test_each_record_reaches_exactly_one_worker(job):
    first, second = job.results[0]["indices"], job.results[1]["indices"]
    assert len(first) == len(second) == NUM_RECORDS // 2  # whole files: 2 shards of 32 each
    assert sorted(first + second) == list(range(NUM_RECORDS))


def test_training_on_shards_lowers_the_loss_with_identical_weights(job):
    first, second = job.results[0], job.results[1]
    assert first["losses"] == second["losses"]
    losses = first["losses"]
    assert losses[0] > losses[1] > losses[2], losses
    for a, b in zip(first["weights"], second["weights"]):
        np.testing.assert_array_equal(a, b)

"""Fault injection: a worker SIGKILLed mid-epoch stops the job fast, or a restart resumes it."""

import time

import numpy as np
import tensorflow as tf

from tests.jobs import run_job
from tests.workers import common


def test_killed_worker_stops_the_job_within_30s_naming_it(tmp_path):
    result = run_job("fault_job.py", tmp_path, timeout=120)
    stopped_at = time.time()
    assert result.returncode == 137, result.output[-3000:]
    assert "worker 1 was killed by SIGKILL; stopped all workers" in result.output
    assert stopped_at - float((tmp_path / "killed_at").read_text()) < 30
    assert not result.results  # nobody finished


def test_restart_resumes_from_the_backup_and_repeats_at_most_one_epoch(tmp_path):
    result = run_job("fault_job.py", tmp_path, timeout=180, launcher_args=("--max-restarts", "1")).check()
    assert "worker 1 was killed by SIGKILL" in result.output and "restarting all workers (1/1)" in result.output
    for rank in (0, 1):
        assert result.results[rank]["attempt"] == 1
        assert result.results[rank]["epochs"] == [1, 2, 3]  # epoch 1 (cut short) again, then 2, 3
    reference = uninterrupted_weights(epochs=4)
    for rank in (0, 1):
        for got, want in zip(result.results[rank]["weights"], reference):
            np.testing.assert_allclose(got, want, atol=1e-5)


def uninterrupted_weights(epochs):
    model = common.equivalence_model()
    x, y = common.regression_data(64)
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(common.GLOBAL_BATCH), epochs=epochs, verbose=0)
    return model.get_weights()


def test_a_stuck_peer_makes_the_others_fail_after_the_collective_timeout(tmp_path):
    result = run_job("stuck_peer_job.py", tmp_path, "5", timeout=120)
    assert result.returncode == 1, result.output[-3000:]
    assert "worker 0 exited with code 1" in result.output and "Collective has timed out" in result.output
    waited = result.results[0]["timed_out_at"] - result.results[1]["stuck_at"]
    assert 4 < waited < 20

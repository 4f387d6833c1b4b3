"""Optimizer state sharded over worker processes (ZeRO-1, issue 42): 2 workers train Adam with moving averages
(use_ema) as one device, holding half the state each; their checkpoint is Keras' own (plain Keras loads it on one device) and 3 workers resume
from it exactly; a preempted sharded job saves and resumes at the agreed step exactly."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.jobs import run_job
from tests.test_preemption import GRACE, assert_resumed_exactly
from tests.test_preemption import uninterrupted  # noqa: F401  (a fixture)
from tests.workers import common
from tfdist import sharding


def one_device(epochs):
    """The one-device run the jobs must equal, after ``epochs`` epochs."""
    model = common.resumable_model(use_ema=True)
    x, y = common.regression_data(common.GLOBAL_BATCH * common.SHARDED_STEPS)
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(common.GLOBAL_BATCH), epochs=epochs, verbose=0)
    return model


def assert_workers_equal_one_device(results, reference, replicas):
    assert sorted(results) == list(range(replicas))
    for result in results.values():
        assert result["sharded"] and result["replicas"] == replicas
        assert result["iterations"] == int(reference.optimizer.iterations.numpy())
        for got, want in zip(result["weights"], reference.get_weights()):
            np.testing.assert_allclose(got, want, atol=1e-6)
        assert result["weights"] == results[0]["weights"]  # every worker the same bits


def sharded_bytes(optimizer, replicas):
    """The bytes one of ``replicas`` holds of ``optimizer``'s state: a slot's ceil(size / N) elements."""
    sizes = [(int(np.prod(v.shape)), tf.as_dtype(v.dtype).size) for v in optimizer.variables]
    return sum((-(-size // replicas) if size > 1 else 1) * width for size, width in sizes)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("sharded")
    return out_dir, run_job("sharded_state_job.py", out_dir, "train", timeout=240).check()


def test_two_sharded_workers_train_as_one_device_holding_half_the_state(trained):
    _, job = trained
    reference = one_device(common.SHARDED_EPOCHS)
    assert_workers_equal_one_device(job.results, reference, 2)
    whole = tfdist.optimizer_state_bytes(reference.optimizer)
    assert job.results[0]["state_bytes"] == sharded_bytes(reference.optimizer, 2) < 0.6 * whole


def test_their_checkpoint_loads_in_plain_keras_and_three_sharded_workers_resume_it_exactly(trained, tmp_path):
    out_dir, _ = trained
    reference = one_device(common.SHARDED_EPOCHS)
    plain = keras.models.load_model(out_dir / "model.keras")  # this process: one device, Keras' own optimizer
    for got, want in zip(plain.optimizer.variables, reference.optimizer.variables):
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-6)
    (tmp_path / "model.keras").write_bytes((out_dir / "model.keras").read_bytes())
    resumed = run_job("sharded_state_job.py", tmp_path, "resume", num_workers=3, timeout=240).check()
    assert_workers_equal_one_device(resumed.results, one_device(common.SHARDED_EPOCHS + 1), 3)


def test_a_save_on_the_chief_alone_is_an_error_naming_the_workers_that_did_not_save(tmp_path):
    """A Horovod habit (``if rank == 0: model.save(...)``) would wait forever in the gather of the slots."""
    job = run_job("sharded_state_job.py", tmp_path, "chief_saves", timeout=240).check()
    assert job.results[1]["error"] is None
    assert ("reads or saves the sharded optimizer state of sequential (saving it) whole" in job.results[0]["error"]
            and "but worker(s) [1] did not within 3 s. Call model.save / save_weights / checkpoint.save on every "
                "worker" in job.results[0]["error"]), job.results[0]["error"]
    assert not (tmp_path / "model.keras").exists()  # refused before the file was opened


def test_a_preempted_sharded_job_saves_at_the_agreed_step_and_resumes_exactly(tmp_path, uninterrupted):  # noqa: F811
    result = run_job("preempt_job.py", tmp_path, "worker", timeout=300, env={sharding.ENV: "1"},
                     launcher_args=(*GRACE, "--max-restarts", "1")).check()
    assert "exited with code 85 (preempted" in result.output and "restarting all workers (1/1)" in result.output
    assert all(r["sharded"] for r in result.results.values())
    assert_resumed_exactly(tmp_path, result.results, uninterrupted)

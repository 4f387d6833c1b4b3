"""Ray: a tfdist training function under TensorflowTrainer, and `tfdist run --ray` (real Ray, local clusters)."""

import json
import logging
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.jobs import REPO, WORKERS, job_env
from tests.test_launcher import alive, worker_pids

TIMEOUT = 240


def run_ray(*args, env=None, timeout=TIMEOUT):
    command = [sys.executable, "-m", "tfdist.run", "--ray", *args]
    return subprocess.run(command, cwd=REPO, env=env or ray_env(), capture_output=True, text=True, timeout=timeout)


def ray_env():
    env = job_env(shield=False)
    env.pop("RAY_ADDRESS", None)
    return env


def test_run_ray_with_no_address_starts_ray_here_and_runs_the_example(tmp_path):
    """Runs first, before this module's shared cluster exists: Ray's default then starts a local one."""
    result = run_ray("-n", "2", "--timeout", "200", "--", sys.executable, "examples/multi_worker_fit.py",
                     str(tmp_path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "placing 2 workers (1 CPU each)" in result.stdout
    assert "[0] worker 0 of 2: 2 replicas in sync" in result.stdout and "[1] loss" not in result.stdout
    assert "all workers finished" in result.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["multi_worker_model.keras"]


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster (2 CPUs) for the rest of the module; its workers import this checkout."""
    import ray

    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(REPO)  # Ray's processes inherit it
    try:
        context = ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = saved
    yield context.address_info["gcs_address"]
    ray.shutdown()


def test_tensorflow_trainer_runs_a_tfdist_training_function(ray_cluster, tmp_path):
    import keras

    driver = subprocess.run([sys.executable, str(WORKERS / "ray_trainer_job.py"), str(tmp_path), ray_cluster],
                            env=job_env(shield=False), capture_output=True, text=True, timeout=TIMEOUT)
    assert driver.returncode == 0, driver.stdout[-3000:] + driver.stderr[-5000:]
    workers = [json.loads((tmp_path / f"worker{rank}.json").read_text()) for rank in (0, 1)]
    assert [json.loads(w["tf_config"])["task"]["index"] for w in workers] == [0, 1]  # Ray's TF_CONFIG
    assert all(w["replicas"] == 2 for w in workers)
    for first, second in zip(workers[0]["weights"], workers[1]["weights"]):
        np.testing.assert_array_equal(first, second)
    losses = workers[0]["loss"]
    assert losses[-1] < losses[0]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["metrics"]["epoch"] == 3 and result["metrics"]["loss"] == pytest.approx(losses[-1], rel=1e-6)
    assert [row["epoch"] for row in result["history"]] == [1, 2, 3]
    checkpoint = result["checkpoint"]
    assert os.listdir(checkpoint) == ["model.keras"]  # the chief's file only
    restored = keras.models.load_model(os.path.join(checkpoint, "model.keras"))
    for got, want in zip(restored.get_weights(), workers[0]["weights"]):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_run_ray_stops_every_worker_when_one_fails(ray_cluster, tmp_path):
    result = run_ray(ray_cluster, "-n", "2", "--grace-period", "1", "--", sys.executable,
                     str(WORKERS / "toy_worker.py"), str(tmp_path), "fail1")
    assert result.returncode == 3, result.stdout + result.stderr[-3000:]
    assert "[0] hello from 0" in result.stdout and "[1] hello from 1" in result.stdout
    assert "worker 1 exited with code 3; stopped all workers (2 worker(s), exit codes [SIGTERM, 3]" in result.stdout
    assert not any(alive(pid) for pid in worker_pids(tmp_path))


def test_run_ray_restarts_every_worker(ray_cluster, tmp_path):
    result = run_ray(ray_cluster, "-n", "2", "--grace-period", "1", "--max-restarts", "1", "--", sys.executable,
                     str(WORKERS / "toy_worker.py"), str(tmp_path), "fail_first_attempt")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "worker 1 exited with code 5" in result.stdout and "restarting all workers (1/1)" in result.stdout
    started = {p.name for p in tmp_path.glob("pid*")}  # worker 0 of attempt 0 may be stopped before it writes
    assert {"pid1.0", "pid0.1", "pid1.1"} <= started
    envs = [json.loads((tmp_path / f"worker{i}.json").read_text()) for i in (0, 1)]
    assert [e["TFDIST_LOCAL_RANK"] for e in envs] == ["0", "1"] and envs[0]["TFDIST_LOCAL_SIZE"] == "2"
    assert [e["TFDIST_GRACE_PERIOD"] for e in envs] == ["1", "1"]  # --grace-period


def test_run_ray_names_what_it_cannot_place(ray_cluster, tmp_path):
    started = time.monotonic()
    result = run_ray(ray_cluster, "-n", "3", "--start-timeout", "3", "--", sys.executable,
                     str(WORKERS / "toy_worker.py"), str(tmp_path), "echo")
    assert result.returncode == 124
    assert ("Ray could not place 3 workers of {'CPU': 1.0} within --start-timeout 3s (the cluster has {CPU: 2}"
            in result.stdout), result.stdout
    assert not list(tmp_path.glob("pid*")) and time.monotonic() - started < 60


def test_run_ray_at_an_address_where_nothing_answers_fails_fast(tmp_path):
    started = time.monotonic()
    result = run_ray("127.0.0.1:1", "-n", "2", "--", sys.executable, str(WORKERS / "toy_worker.py"),
                     str(tmp_path), "echo")
    assert result.returncode == 2
    assert "nothing answers at the Ray address 127.0.0.1:1 (Connection refused): start Ray there" in result.stdout
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("kwargs, message", [
    ({"checkpoint_every": -1}, r"checkpoint_every must be an int >= 0 \(0: no checkpoints\): received -1"),
    ({"checkpoint_every": 1.5}, r"checkpoint_every must be an int >= 0 \(0: no checkpoints\): received 1.5"),
    ({"filename": "model.h5"}, r"filename must be a file name ending in .keras \(Keras' format\): received 'model.h5'"),
])
def test_report_callback_checks_its_arguments(kwargs, message):
    from tfdist.ray_train import ReportCallback

    with pytest.raises(ValueError, match=message):
        ReportCallback(**kwargs)


def test_load_model_without_a_checkpoint_says_how_to_get_one():
    from tfdist.ray_train import load_model

    with pytest.raises(ValueError, match=r"received no checkpoint \(None\): the run reported none; pass "
                                         r"ReportCallback\(checkpoint_every=1\)"):
        load_model(None)


def test_rays_own_example_with_one_line_changed_keeps_only_whole_checkpoints(ray_cluster, tmp_path):
    """Ray's ReportCheckpointCallback on every worker: with tfdist only the chief's model.keras reaches Ray."""
    import zipfile

    import keras

    epochs = 9  # unpatched, about 1 checkpoint in 3 was a corrupt zip; one run: Ray starts its workers once
    driver = subprocess.run([sys.executable, str(WORKERS / "ray_example_driver.py"), str(tmp_path), ray_cluster,
                             str(epochs)], env=job_env(shield=False), capture_output=True, text=True, timeout=2 * TIMEOUT)
    assert driver.returncode == 0, driver.stdout[-3000:] + driver.stderr[-5000:]
    kept = json.loads((tmp_path / "result.json").read_text())["checkpoints"]
    assert len(kept) == epochs  # one per epoch
    for path in kept:
        assert sorted(os.listdir(path)) == [".metadata.json", "model.keras"]  # Ray's metadata, the chief's model
        with zipfile.ZipFile(os.path.join(path, "model.keras")) as archive:
            assert archive.testzip() is None  # every member's CRC is right
        model = keras.models.load_model(os.path.join(path, "model.keras"))
        assert model.output_shape == (None, 10)

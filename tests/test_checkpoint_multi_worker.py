"""tfdist.CheckpointManager on real workers with sharded optimizer state (tests/workers/checkpoint_job.py): 2
workers save one part each, no part holding the whole optimizer state; the checkpoint restores exactly in one
process and on 3 workers; a job killed (SIGKILL) while its async save writes resumes from the checkpoint before."""

import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import tfdist
from tests.jobs import WORKERS, job_env, run_job
from tests.workers import common
from tfdist.checkpoint import store

STEPS_PER_EPOCH = 48 // common.CHECKPOINT_BATCH


def one_device(epochs: int) -> list:
    model = common.checkpoint_model()
    x, y = common.checkpoint_data()
    model.fit(x, y, batch_size=common.CHECKPOINT_BATCH, epochs=epochs, shuffle=False, verbose=0)
    return common.checkpoint_state(model)


def assert_close(got, want, atol=1e-6):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol)


@pytest.fixture(scope="module")
def saved_by_two(tmp_path_factory):
    directory = tmp_path_factory.mktemp("checkpoints")
    job = run_job("checkpoint_job.py", tmp_path_factory.mktemp("save"), str(directory), "save", "1",
                  timeout=300).check()
    return directory, job


def test_each_worker_writes_its_part_and_no_part_holds_the_whole_optimizer_state(saved_by_two):
    directory, job = saved_by_two
    [(step, path)] = store.committed(str(directory))
    assert step == STEPS_PER_EPOCH and sorted(os.listdir(path)) == ["manifest.json", "part-0.npz", "part-1.npz"]
    manifest = store.read_manifest(path)
    slots = [v["key"] for v in manifest["variables"] if v["sharded"]]
    assert len(slots) == 2 * 4  # AdamW's two moments of 4 weights, each in 2 shards
    for worker in (0, 1):
        with np.load(store.part_path(path, worker)) as part:
            assert {k for k in part.files if k.rsplit("/", 1)[0] in slots} == {f"{k}/{worker}" for k in slots}
            assert any(k.startswith("model/") for k in part.files)  # the weights are shared out too
    assert job.results[0]["state"] == job.results[1]["state"]
    assert_close(job.results[0]["state"], one_device(1))


def test_the_checkpoint_of_two_workers_restores_in_one_process_and_resumes_exactly(saved_by_two):
    directory, job = saved_by_two
    model = common.checkpoint_model()
    assert tfdist.CheckpointManager(str(directory)).restore(model) == STEPS_PER_EPOCH
    assert common.checkpoint_state(model) == job.results[0]["state"]  # bit for bit
    x, y = common.checkpoint_data()
    model.fit(x, y, batch_size=common.CHECKPOINT_BATCH, epochs=1, shuffle=False, verbose=0)
    assert_close(common.checkpoint_state(model), one_device(2))


def test_the_checkpoint_of_two_workers_restores_on_three_and_resumes_exactly(saved_by_two, tmp_path):
    directory, job = saved_by_two
    resumed = run_job("checkpoint_job.py", tmp_path, str(directory), "resume", "1", num_workers=3,
                      timeout=300).check()
    want = one_device(2)
    for rank, result in resumed.results.items():
        assert result["workers"] == 3 and result["restored_step"] == STEPS_PER_EPOCH
        assert result["restored"] == job.results[0]["state"]
        assert_close(result["state"], want)
        assert result["state"] == resumed.results[0]["state"]


@pytest.mark.parametrize("killed", [(0, 1), (1,)], ids=["every_worker", "worker_1"])
def test_a_job_killed_while_its_async_save_writes_resumes_from_the_checkpoint_before(tmp_path, killed):
    """SIGKILL to every worker, or to worker 1 alone (worker 0 waits for its part: the launcher stops it at once), in
    the middle of the second save's write. The rerun resumes from the first save exactly, and its save removes the
    partial folder the killed job left."""
    directory, out = tmp_path / "checkpoints", tmp_path / "killed"
    out.mkdir()
    command = [sys.executable, "-m", "tfdist.run", "-n", "2", "--timeout", "300", "--grace-period", "2", "--",
               sys.executable, str(WORKERS / "checkpoint_job.py"), str(out), str(directory), "killed", "1"]
    launcher = subprocess.Popen(command, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    try:
        markers = [out / "writing0", out / "writing1"]
        deadline = time.monotonic() + 240
        while not all(m.exists() and m.read_text() for m in markers):
            assert launcher.poll() is None, launcher.communicate()[0][-4000:]
            assert time.monotonic() < deadline, "the second save never started writing"
            time.sleep(0.2)
        for rank in killed:  # in the middle of its write
            os.kill(int(markers[rank].read_text()), signal.SIGKILL)
        launcher.wait(timeout=60)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert [step for step, _ in store.committed(str(directory))] == [STEPS_PER_EPOCH]  # the second never committed
    assert [name for name in os.listdir(directory) if name.startswith(".partial-")]
    resumed = run_job("checkpoint_job.py", tmp_path / "resumed", str(directory), "resume_save", "1",
                      timeout=300).check()
    for result in resumed.results.values():
        assert result["restored_step"] == STEPS_PER_EPOCH
        assert_close(result["state"], one_device(2))
    assert sorted(os.listdir(directory)) == [".owner", f"step-{STEPS_PER_EPOCH}", f"step-{2 * STEPS_PER_EPOCH}"]


def test_a_second_fit_with_the_same_backup_and_restore_of_sharded_state_backs_up_again(tmp_path):
    """The first fit's end removes backup_dir, its manager's claim with it: the second fit's backup failed with
    'Another CheckpointManager (None) writes .../backup/sharded now'."""
    job = run_job("checkpoint_job.py", tmp_path / "out", str(tmp_path), "backup_twice", "1", timeout=300).check()
    for result in job.results.values():
        assert_close(result["state"], one_device(2))


def test_the_workers_of_a_job_restore_the_same_checkpoint_while_another_job_commits(tmp_path):
    """Another job commits step-99 after worker 0 chose step-4 and before worker 1 chose: each worker read the
    newest it saw, so the replicas of one model held two checkpoints' states."""
    job = run_job("checkpoint_job.py", tmp_path / "out", str(tmp_path / "checkpoints"), "racing", "1",
                  timeout=300).check()
    assert [(tmp_path / "out" / f"read{rank}").read_text() for rank in (0, 1)] == [f"step-{STEPS_PER_EPOCH}"] * 2


def test_a_checkpoint_removed_while_the_workers_restore_it_is_restored_from_the_newer_one_on_every_worker(tmp_path):
    """Another job commits step 8 and removes step 4 (max_to_keep) after worker 0 read step 4 and before worker 1
    did: worker 1 failed with a bare FileNotFoundError (worker 0 returned, restored). Now every worker reads step 8."""
    job = run_job("checkpoint_job.py", tmp_path / "out", str(tmp_path / "checkpoints"), "removed", "1",
                  timeout=300).check()
    for result in job.results.values():
        assert result["restored_step"] == 2 * STEPS_PER_EPOCH
        assert result["state"] == result["saved"]  # the second save's state, bit for bit, on both workers
    assert [step for step, _ in store.committed(str(tmp_path / "checkpoints"))] == [2 * STEPS_PER_EPOCH]


def test_a_first_save_whose_claim_fails_fails_on_every_worker_at_once_and_the_next_one_commits(tmp_path):
    """Worker 0's claim of the directory failed in save itself: it raised there, while worker 1 waited for the
    verdict of that save (the hang timeout) and the next save's workers agreed on two names (each waited again)."""
    job = run_job("checkpoint_job.py", tmp_path / "out", str(tmp_path / "checkpoints"), "claim_fails", "1",
                  timeout=240, env={"TFDIST_HANG_TIMEOUT": "60"}).check()
    for result in job.results.values():
        assert "[Errno 13] Permission denied" in result["first"]
        assert result["first_seconds"] < 30
    assert [step for step, _ in store.committed(str(tmp_path / "checkpoints"))] == [STEPS_PER_EPOCH]

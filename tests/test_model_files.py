"""model.save, save_weights, ModelCheckpoint and BackupAndRestore on every worker of a job with sharded optimizer
state (tfdist.keras_fixes.model_files, issue 50): every file is whole (every worker wrote one path at once: a zip
with a bad CRC), plain Keras loads it, and training resumes from it exactly; BackupAndRestore writes a
CheckpointManager checkpoint, a part per worker."""

import pathlib
import subprocess
import sys
import zipfile

import h5py
import numpy as np
import pytest

from tests.jobs import job_env, run_job
from tests.workers import common
from tfdist.checkpoint import store


@pytest.fixture(scope="module", params=[2, 3], ids=["2-workers", "3-workers"])
def saved(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"saves-{request.param}")
    return out, run_job("model_save_job.py", out, num_workers=request.param, timeout=300).check()


def test_every_file_saved_on_every_worker_is_whole(saved):
    out, job = saved
    archives = sorted(out.glob("*.keras"))
    assert len(archives) == 10 + 3  # model.save 10 times, ModelCheckpoint each of 3 epochs
    for path in archives:
        with zipfile.ZipFile(path) as archive:
            assert archive.testzip() is None, path
    weights = sorted(out.glob("weights-*.weights.h5"))
    assert len(weights) == 10
    for path in weights:
        with h5py.File(path) as file:
            assert "optimizer" in file or "vars" in file, path
    assert not list(out.glob("**/.tmp*"))  # no temporary file left behind
    # BackupAndRestore of sharded state: a CheckpointManager checkpoint, one part per worker, nothing gathered
    [(step, backup)] = store.committed(str(out / "backup" / "sharded"))
    assert step == 3 * 4 and len(list(pathlib.Path(backup).glob("part-*.npz"))) == len(job.results)


def test_plain_keras_loads_a_saved_model_and_resumes_as_one_device(saved, tmp_path):
    out, job = saved
    np.save(tmp_path / "state.npy", np.concatenate([np.ravel(a) for a in job.results[0]["state"]]))
    script = f"""
import keras, numpy as np
from tests.workers import common
from tfdist.checkpoint import store
model = keras.saving.load_model({str(out / 'model-9.keras')!r})
state = np.concatenate([np.ravel(a) for a in common.checkpoint_state(model)])
assert np.array_equal(state, np.load({str(tmp_path / 'state.npy')!r})), "the loaded state differs"
x, y = common.checkpoint_data()
model.fit(x, y, batch_size=common.CHECKPOINT_BATCH, epochs=1, shuffle=False, verbose=0)
np.save({str(tmp_path / 'resumed.npy')!r}, np.concatenate([np.ravel(a) for a in common.checkpoint_state(model)]))
"""
    done = subprocess.run([sys.executable, "-c", script], env=job_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    one = common.checkpoint_model()
    x, y = common.checkpoint_data()
    one.fit(x, y, batch_size=common.CHECKPOINT_BATCH, epochs=4, shuffle=False, verbose=0)
    want = np.concatenate([np.ravel(a) for a in common.checkpoint_state(one)])
    np.testing.assert_allclose(np.load(tmp_path / "resumed.npy"), want, atol=1e-6)


def test_saved_weights_load_into_a_model_on_one_device(saved):
    out, job = saved
    model = common.checkpoint_model()
    model.optimizer.build(model.trainable_variables)
    model.load_weights(out / "weights-9.weights.h5")
    assert common.checkpoint_state(model) == job.results[0]["state"]

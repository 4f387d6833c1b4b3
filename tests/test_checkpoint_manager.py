"""tfdist.CheckpointManager in one process (logical CPUs as replicas): a checkpoint saved by N replicas, sharded
or not, restores exactly onto M; saves commit atomically, keep the newest, fail with named errors, and export
as a Keras file plain Keras loads. The multi-worker cases run in tests/test_checkpoint_multi_worker.py."""

import os
import shutil
import subprocess
import sys
import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.jobs import job_env
from tfdist import sharding, strategy as strategy_lib
from tfdist.checkpoint import store
from tfdist.errors import CheckpointError

X = np.random.default_rng(0).normal(size=(48, 5)).astype("float32")
Y = np.random.default_rng(1).normal(size=(48, 3)).astype("float32")


def _strategy(replicas: int):
    tf.distribute.MirroredStrategy._collective_key_base += 100000  # one process, several strategies
    if replicas == 1:
        return tf.distribute.get_strategy()
    return strategy_lib.make_strategy("mirrored", devices=f"CPU:[0-{replicas - 1}]")


def _model(strategy, sharded: bool):
    with strategy.scope(), sharding.scoped(sharded):
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(7), keras.layers.Dense(3)])
        model.compile(keras.optimizers.AdamW(0.01, weight_decay=0.01, global_clipnorm=1.0), "mse")
    return model


def _state(model) -> list[np.ndarray]:
    return [np.asarray(v) for v in model.weights] + [np.asarray(v) for v in model.optimizer.variables]


def _assert_state_equal(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


# (replicas, sharded) of the saving and the restoring run
LAYOUTS = [(1, False), (2, True), (2, False), (3, True)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of each saving layout after 2 epochs, with its state."""
    found = {}
    for replicas, sharded in LAYOUTS:
        model = _model(_strategy(replicas), sharded)
        model.fit(X, Y, batch_size=12, epochs=2, verbose=0)
        directory = str(tmp_path_factory.mktemp(f"saved-{replicas}-{sharded}"))
        manager = tfdist.CheckpointManager(directory)
        manager.save(model)
        manager.wait()
        found[replicas, sharded] = (directory, _state(model))
    return found


@pytest.mark.parametrize("source", LAYOUTS, ids=lambda layout: f"from-{layout[0]}{'-sharded' * layout[1]}")
def test_a_checkpoint_restores_exactly_on_any_replica_count(saved, source):
    directory, want = saved[source]
    for replicas, sharded in [(1, False), (2, True), (3, True), (4, True), (2, False)]:
        model = _model(_strategy(replicas), sharded)
        assert tfdist.CheckpointManager(directory).restore(model) == 8
        _assert_state_equal(_state(model), want)


def test_training_resumed_from_a_checkpoint_is_the_uninterrupted_training(tmp_path):
    """Saved after one epoch by 2 sharded replicas, restored onto 3, trained one more: the 2-epoch run's state."""
    uninterrupted = _model(_strategy(1), False)
    uninterrupted.fit(X, Y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    first = _model(_strategy(2), True)
    first.fit(X, Y, batch_size=12, epochs=1, shuffle=False, verbose=0)
    tfdist.CheckpointManager(str(tmp_path), async_save=False).save(first)
    resumed = _model(_strategy(3), True)
    tfdist.CheckpointManager(str(tmp_path)).restore(resumed)
    resumed.fit(X, Y, batch_size=12, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(_state(resumed), _state(uninterrupted)):
        np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("replicas, sharded, jit", [(1, False, False), (1, False, True), (2, True, False)],
                         ids=["one_device", "one_device_xla", "sharded"])
def test_an_async_save_written_after_training_went_on_holds_the_state_of_its_moment(tmp_path, monkeypatch,
                                                                                   replicas, sharded, jit):
    """save() stages without copying (the variables' buffers are copied on their next write): the part written
    while more steps train still holds the state at the save."""
    model = _model(_strategy(replicas), sharded)
    model.jit_compile = jit
    model.fit(X, Y, batch_size=12, epochs=1, shuffle=False, verbose=0)
    at_save = _state(model)
    trained, write_part = threading.Event(), store.write_part

    def write_after_training(*args):
        assert trained.wait(120)
        write_part(*args)

    monkeypatch.setattr(store, "write_part", write_after_training)
    manager = tfdist.CheckpointManager(str(tmp_path))
    manager.save(model)
    model.fit(X, Y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    assert not np.array_equal(_state(model)[0], at_save[0])
    trained.set()
    manager.wait()
    restored = _model(_strategy(replicas), sharded)
    manager.restore(restored)
    _assert_state_equal(_state(restored), at_save)


def test_no_part_of_a_sharded_checkpoint_holds_another_replicas_shard(saved):
    directory, _ = saved[3, True]
    manifest = store.read_manifest(store.committed(directory)[-1][1])
    sharded = [v["key"] for v in manifest["variables"] if v["sharded"]]
    assert sharded and manifest["workers"] == 1
    with np.load(store.part_path(store.committed(directory)[-1][1], 0)) as part:
        assert all(f"{key}/{r}" in part.files for key in sharded for r in range(3))
        assert not any(key in part.files for key in sharded)  # shards only: no whole slot was gathered


def test_a_save_that_fails_before_its_commit_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    model = _model(_strategy(1), False)
    model.fit(X, Y, batch_size=12, epochs=1, verbose=0)
    manager = tfdist.CheckpointManager(str(tmp_path))
    first = manager.save(model)
    manager.wait()
    model.fit(X, Y, batch_size=12, epochs=1, verbose=0)

    def crash(*args, **kwargs):
        raise OSError("the machine went down here")

    monkeypatch.setattr(store, "commit", crash)
    manager.save(model)
    with pytest.raises(CheckpointError, match=r"Saving the checkpoint of step 8 into .* failed on worker 0: "
                                              r"OSError: the machine went down here"):
        manager.wait()
    assert manager.latest == first
    monkeypatch.undo()
    manager.save(model)
    manager.wait()
    assert [os.path.basename(p) for _, p in store.committed(str(tmp_path))] == ["step-4", "step-8"]
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".partial")]  # the failed one removed


def test_the_newest_checkpoints_are_kept(tmp_path):
    model = _model(_strategy(1), False)
    manager = tfdist.CheckpointManager(str(tmp_path), max_to_keep=2)
    for _ in range(4):
        model.fit(X, Y, batch_size=12, epochs=1, verbose=0)
        manager.save(model)
    manager.wait()
    assert [step for step, _ in store.committed(str(tmp_path))] == [12, 16]


def test_an_empty_directory_restores_nothing(tmp_path):
    assert tfdist.CheckpointManager(str(tmp_path / "none")).restore(_model(_strategy(1), False)) is None


def test_two_managers_on_one_directory_is_a_named_error(tmp_path):
    model = _model(_strategy(1), False)
    model.fit(X, Y, batch_size=12, epochs=1, verbose=0)
    first, second = tfdist.CheckpointManager(str(tmp_path)), tfdist.CheckpointManager(str(tmp_path))
    first.save(model)
    first.wait()
    second.save(model)
    second.wait()
    first.save(model)
    with pytest.raises(CheckpointError, match=r"Another CheckpointManager \(\w+\) writes .* now: two jobs or two "
                                              r"managers save into one directory\. Give each its own directory\."):
        first.wait()


@pytest.mark.parametrize("arguments, message", [
    ({"directory": "gs://bucket/ckpt"}, r"CheckpointManager writes to a local or mounted filesystem .* received "
                                        r"directory='gs://bucket/ckpt'"),
    ({"max_to_keep": 0}, r"max_to_keep must be a positive int or None \(keep all\); received max_to_keep=0"),
])
def test_bad_arguments_are_named(tmp_path, arguments, message):
    with pytest.raises(ValueError, match=message):
        tfdist.CheckpointManager(**{"directory": str(tmp_path), **arguments})


def test_a_checkpoint_of_another_model_is_a_named_error(saved):
    directory, _ = saved[1, False]
    with _strategy(1).scope():
        other = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4), keras.layers.Dense(3)])
        other.compile(keras.optimizers.AdamW(0.01), "mse")
    with pytest.raises(CheckpointError, match=r"model/0 \(.*kernel\) was saved as float32\(5, 7\); this model's "
                                              r"model/0 \(.*kernel\) is float32\(5, 4\): it was saved for another"):
        tfdist.CheckpointManager(directory).restore(other)


def test_a_full_disk_fails_the_save_and_keeps_the_previous_checkpoint(tmp_path):
    disk = tmp_path / "small"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        model = _model(_strategy(1), False)
        manager = tfdist.CheckpointManager(str(disk))
        kept = manager.save(model)
        manager.wait()
        with _strategy(1).scope():
            large = keras.Sequential([keras.Input((5,)), keras.layers.Dense(300_000)])
        too_large = tfdist.CheckpointManager(str(disk))
        too_large.save(large)
        with pytest.raises(CheckpointError, match=r"failed on worker 0: OSError: \[Errno 28\] No space left .*: "
                                                  r"the filesystem of .* is full\. A save needs room for one more "
                                                  r"checkpoint beside those kept \(max_to_keep=3;"):
            too_large.wait()
        assert manager.latest == kept
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)  # -l: even while a failed write holds a file


def test_tfdist_checkpoint_export_writes_a_file_plain_keras_loads_and_resumes(saved, tmp_path):
    directory, want = saved[3, True]
    out = tmp_path / "model.keras"
    done = subprocess.run([sys.executable, "-m", "tfdist.cli", "checkpoint", "export", directory, str(out)],
                          env=job_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"wrote {out}" in done.stdout
    np.save(tmp_path / "want.npy", np.concatenate([w.ravel() for w in want]))
    script = f"""
import keras, numpy as np
model = keras.saving.load_model({str(out)!r})
got = np.concatenate([np.asarray(v).ravel() for v in model.weights] +
                     [np.asarray(v).ravel() for v in model.optimizer.variables])
assert np.array_equal(got, np.load({str(tmp_path / 'want.npy')!r})), "the state differs"
print("loaded", type(model.optimizer).__name__, int(model.optimizer.iterations.numpy()))
"""
    loaded = subprocess.run([sys.executable, "-c", script], env=job_env(), capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0 and "loaded AdamW 8" in loaded.stdout, loaded.stderr[-2000:]


def test_export_names_what_is_missing(tmp_path):
    done = subprocess.run([sys.executable, "-m", "tfdist.cli", "checkpoint", "export", str(tmp_path), "out.keras"],
                          env=job_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert f"no committed checkpoint in {str(tmp_path)!r}" in done.stderr


def test_a_rerun_removes_the_partial_checkpoints_a_killed_run_left(tmp_path):
    """A job killed while it wrote leaves its .partial-<token>-N folder; the next run's manager (another token)
    removes it at its first commit, so the staged copies of dead runs do not fill the disk."""
    stale = tmp_path / ".partial-deadbeef0000-3"
    stale.mkdir()
    (stale / "part-0.npz").write_bytes(b"x" * 1000)
    (tmp_path / ".partial-deadbeef0000-2.replaced").mkdir()  # a commit of the same step killed half way
    model = _model(_strategy(1), False)
    manager = tfdist.CheckpointManager(str(tmp_path))
    manager.save(model)
    manager.wait()
    assert sorted(os.listdir(tmp_path)) == [".owner", "step-0"]


def test_a_save_older_than_the_newest_checkpoint_is_a_named_error_and_removes_nothing(tmp_path):
    """A run that did not restore saves step 4 where step 8 is: it would not be the latest (restore reads step 8)
    and max_to_keep=1 removed it at once, while save returned its path."""
    ahead = _model(_strategy(1), False)
    ahead.fit(X, Y, batch_size=12, epochs=2, verbose=0)
    kept = tfdist.CheckpointManager(str(tmp_path), max_to_keep=1).save(ahead)
    behind = _model(_strategy(1), False)
    behind.fit(X, Y, batch_size=12, epochs=1, verbose=0)
    manager = tfdist.CheckpointManager(str(tmp_path), max_to_keep=1)
    manager.save(behind)
    with pytest.raises(CheckpointError, match=r"step 4 is older than the newest checkpoint in .* \(step-8\): .*"
                                              r"manager\.restore\(model\) before training, or save into another "
                                              r"directory"):
        manager.wait()
    assert manager.latest == kept and [s for s, _ in store.committed(str(tmp_path))] == [8]


def test_a_restore_whose_checkpoint_another_manager_removes_meanwhile_reads_the_newer_one(tmp_path, monkeypatch):
    """Another process's manager commits step 8 and removes step 4 (max_to_keep=1) between this restore's choice of
    step 4 and its read: the restore reads step 8 instead of failing with FileNotFoundError."""
    model = _model(_strategy(1), False)
    model.fit(X, Y, batch_size=12, epochs=1, verbose=0)
    writer = tfdist.CheckpointManager(str(tmp_path), max_to_keep=1, async_save=False)
    writer.save(model)
    read_manifest = store.read_manifest

    def save_first(path):
        monkeypatch.setattr(store, "read_manifest", read_manifest)
        model.fit(X, Y, batch_size=12, epochs=1, verbose=0)
        writer.save(model)
        return read_manifest(path)

    monkeypatch.setattr(store, "read_manifest", save_first)
    restored = _model(_strategy(1), False)
    assert tfdist.CheckpointManager(str(tmp_path)).restore(restored) == 8
    _assert_state_equal(_state(restored), _state(model))


def test_metadata_whose_checkpoint_another_manager_removes_meanwhile_reads_the_newer_one(tmp_path, monkeypatch):
    """As for restore: another process's manager commits step 8 and removes step 4 (max_to_keep=1) between
    metadata()'s choice of step 4 and its read. It failed with FileNotFoundError; it returns step 8's metadata."""
    model = _model(_strategy(1), False)
    model.fit(X, Y, batch_size=12, epochs=1, verbose=0)
    writer = tfdist.CheckpointManager(str(tmp_path), max_to_keep=1, async_save=False)
    writer.save(model, metadata={"epoch": 1})
    read_manifest = store.read_manifest

    def save_first(path):
        monkeypatch.setattr(store, "read_manifest", read_manifest)
        model.fit(X, Y, batch_size=12, epochs=1, verbose=0)
        writer.save(model, metadata={"epoch": 2})
        return read_manifest(path)

    monkeypatch.setattr(store, "read_manifest", save_first)
    assert tfdist.CheckpointManager(str(tmp_path)).metadata() == {"epoch": 2}


def test_metadata_of_a_checkpoint_that_was_removed_is_a_named_error(tmp_path):
    """An explicit path that max_to_keep removed failed with a bare FileNotFoundError of its manifest."""
    model = _model(_strategy(1), False)
    manager = tfdist.CheckpointManager(str(tmp_path), max_to_keep=1, async_save=False)
    first = manager.save(model, metadata={"epoch": 0})
    assert manager.metadata(first) == {"epoch": 0}
    model.fit(X, Y, batch_size=12, epochs=1, verbose=0)
    manager.save(model, metadata={"epoch": 1})
    with pytest.raises(CheckpointError) as error:
        manager.metadata(first)
    assert f"no committed checkpoint at {first!r}" in str(error.value)
    assert f"the newest is {str(tmp_path / 'step-4')!r}" in str(error.value)


def test_a_committed_checkpoint_missing_a_part_is_a_named_error(tmp_path):
    """A part removed by hand (or never copied): restore raised a bare FileNotFoundError."""
    model = _model(_strategy(1), False)
    manager = tfdist.CheckpointManager(str(tmp_path), async_save=False)
    path = manager.save(model)
    os.remove(store.part_path(path, 0))
    with pytest.raises(CheckpointError) as error:
        manager.restore(_model(_strategy(1), False))
    assert f"{path} is the newest committed checkpoint, but worker 0 cannot open it" in str(error.value)
    assert "part-0.npz" in str(error.value) and "move it away" in str(error.value)


def test_saves_called_from_several_threads_at_once_each_commit(tmp_path):
    model = _model(_strategy(1), False)
    model.fit(X, Y, batch_size=12, epochs=1, verbose=0)
    manager, errors = tfdist.CheckpointManager(str(tmp_path)), []

    def save():
        try:
            manager.save(model)
        except Exception as error:  # noqa: BLE001 - the test reports it
            errors.append(error)

    threads = [threading.Thread(target=save) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    manager.wait()
    assert not errors and sorted(os.listdir(tmp_path)) == [".owner", "step-4"]


def test_a_manager_whose_folder_a_second_manager_removed_mid_write_names_the_second(tmp_path, monkeypatch):
    """Manager B's first save claims the directory and removes the partial folders of others, A's among them while A
    writes: A's save fails with the two-managers error, not a FileNotFoundError of its part."""
    model = _model(_strategy(1), False)
    first, second = tfdist.CheckpointManager(str(tmp_path)), tfdist.CheckpointManager(str(tmp_path), async_save=False)
    first.save(model)
    first.wait()
    writing, go, savez = threading.Event(), threading.Event(), np.savez

    def held(*args, **kwargs):
        if threading.current_thread().name == "tfdist-checkpoint-write":
            writing.set()
            assert go.wait(120)
        savez(*args, **kwargs)

    monkeypatch.setattr(np, "savez", held)
    model.fit(X, Y, batch_size=12, epochs=1, verbose=0)
    first.save(model)
    assert writing.wait(120)
    second.save(model)
    go.set()
    with pytest.raises(CheckpointError, match=r"Another CheckpointManager \(\w+\) writes .* now: two jobs or two "
                                              r"managers save into one directory\. Give each its own directory\."):
        first.wait()
    assert [s for s, _ in store.committed(str(tmp_path))] == [0, 4]


def test_a_crash_while_the_same_step_is_committed_again_keeps_that_step(tmp_path, monkeypatch):
    """The second save of step 4 moves the first aside, then renames itself into place: a crash between the two
    renames left no step-4 (nothing at all with max_to_keep=1), and the next run's claim removed the one aside."""
    model = _model(_strategy(1), False)
    model.fit(X, Y, batch_size=12, epochs=1, verbose=0)
    want = _state(model)
    manager = tfdist.CheckpointManager(str(tmp_path), max_to_keep=1, async_save=False)
    manager.save(model)
    replace = os.replace

    def crash_before_the_new_one_is_in_place(source, target):
        if os.path.basename(source).startswith(".partial-") and os.path.basename(target) == "step-4":
            raise OSError("the machine went down here")
        replace(source, target)

    monkeypatch.setattr(os, "replace", crash_before_the_new_one_is_in_place)
    with pytest.raises(CheckpointError, match="the machine went down here"):
        manager.save(model)
    monkeypatch.undo()
    rerun = tfdist.CheckpointManager(str(tmp_path), max_to_keep=1, async_save=False)
    restored = _model(_strategy(1), False)
    assert rerun.restore(restored) == 4
    _assert_state_equal(_state(restored), want)
    rerun.save(restored)
    assert rerun.latest == str(tmp_path / "step-4") and sorted(os.listdir(tmp_path)) == [".owner", "step-4"]
    shutil.copytree(tmp_path / "step-4", tmp_path / "step-4.aside")  # a crash after the new one was in place
    assert rerun.latest == str(tmp_path / "step-4")
    restored.fit(X, Y, batch_size=12, epochs=1, verbose=0)
    rerun.save(restored)
    assert sorted(os.listdir(tmp_path)) == [".owner", "step-8"]  # max_to_keep removed step 4 and its aside


def test_a_failed_save_nobody_waited_for_is_reported_at_exit(tmp_path):
    """The last async save of a script fails after save returned, and the script ends without wait: the error was
    lost (nothing printed) while the user believed the checkpoint written."""
    script = f"""
import keras, tfdist
from tfdist.checkpoint import store

def full(*args):
    raise OSError(28, "No space left on device")

store.write_part = full
model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
tfdist.CheckpointManager({str(tmp_path)!r}).save(model)
"""
    done = subprocess.run([sys.executable, "-c", script], env=job_env(), capture_output=True, text=True, timeout=300)
    assert (f"tfdist: CheckpointManager({str(tmp_path)!r}): its last save failed and nothing waited for it: Saving "
            f"the checkpoint of step 0 into {tmp_path} failed on worker 0: OSError: [Errno 28] No space left on "
            "device") in done.stderr


def test_a_manager_saves_again_after_its_directory_was_removed(tmp_path):
    """BackupAndRestore removes its backup_dir at the end of fit; its manager (sharded state) saved into it again
    in the next fit and failed: 'Another CheckpointManager (None) writes ...' (the claim went with the directory)."""
    model = _model(_strategy(1), False)
    manager = tfdist.CheckpointManager(str(tmp_path / "backup"), async_save=False)
    manager.save(model)
    shutil.rmtree(tmp_path / "backup")
    model.fit(X, Y, batch_size=12, epochs=1, verbose=0)
    assert manager.save(model) == manager.latest == str(tmp_path / "backup" / "step-4")


def test_fits_preemption_hint_names_the_managers_the_process_made(tmp_path, monkeypatch):
    """Without BackupAndRestore, fit's start hint says nothing is saved at a stop, unless a CheckpointManager exists:
    then what it saved before the stop is kept, and the hint says so and names its directory."""
    from tfdist.checkpoint import manager as manager_lib
    from tfdist.keras_fixes import preemption as preemption_fix

    monkeypatch.setattr(manager_lib, "_directories", [])
    assert "stops at an agreed step but nothing is saved; add BackupAndRestore(DIR)" in preemption_fix._no_backup_hint()
    directory = str(tmp_path / "ckpt")
    tfdist.CheckpointManager(directory)
    hint = preemption_fix._no_backup_hint()
    assert "nothing is saved" not in hint
    assert f"only what tfdist.CheckpointManager({directory!r}) saved before it is kept" in hint
    assert "the steps since its last save are lost" in hint and "add BackupAndRestore(DIR)" in hint

"""tfdist.CheckpointManager on real workers, with the optimizer state sharded.

    checkpoint_job.py OUT DIR save EPOCHS [async|sync]   fit EPOCHS epochs, then save into DIR
    checkpoint_job.py OUT DIR resume EPOCHS              restore DIR's newest checkpoint, fit EPOCHS more
    checkpoint_job.py OUT DIR resume_save EPOCHS         the same, then save
    checkpoint_job.py OUT DIR backup_twice EPOCHS        fit twice with one BackupAndRestore (DIR/backup); no manager
    checkpoint_job.py OUT DIR racing EPOCHS              fit, save; restore while another job commits step-99
                                                         between worker 0's look and worker 1's (OUT/read<rank>)
    checkpoint_job.py OUT DIR claim_fails EPOCHS         fit; save with worker 0's claim of DIR failing, then again
    checkpoint_job.py OUT DIR removed EPOCHS             fit, save, fit, save (OUT: its state), fit; restore while
                                                         another job commits the second save and removes the first
                                                         between worker 0's read and worker 1's
    checkpoint_job.py OUT DIR killed EPOCHS              save once, fit an epoch, save again with each part's
                                                         write held until the test kills it (OUT/writing<rank>: pid)

Writes worker<rank>.json: the state after restoring (resume) and at the end (weights and whole optimizer state).
"""

import os
import pathlib
import shutil
import sys
import time

import tfdist
from tests.workers import common
from tfdist.checkpoint import store

out_dir, directory, mode, epochs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
with tfdist.scope(shard_optimizer_state=True) as strategy:
    pass
model = common.checkpoint_model(strategy, sharded=True)
x, y = common.checkpoint_data()
manager = tfdist.CheckpointManager(directory, async_save=sys.argv[5:] != ["sync"])
payload = {"workers": tfdist.num_workers()}
if mode in ("resume", "resume_save"):
    payload["restored_step"] = manager.restore(model)
    payload["restored"] = common.checkpoint_state(model)
if mode == "backup_twice":  # the backup's sharded manager saves again after the first fit removed backup_dir
    import keras

    backup = keras.callbacks.BackupAndRestore(os.path.join(directory, "backup"))
    for _ in range(2):
        model.fit(x, y, batch_size=common.CHECKPOINT_BATCH, epochs=epochs, shuffle=False, verbose=0,
                  callbacks=[backup])
else:
    model.fit(x, y, batch_size=common.CHECKPOINT_BATCH, epochs=epochs, shuffle=False, verbose=0)
if mode == "killed":
    manager.save(model)
    manager.wait()
    model.fit(x, y, batch_size=common.CHECKPOINT_BATCH, epochs=1, shuffle=False, verbose=0)
    write_part = store.write_part

    def held(checkpoint, worker, arrays):  # the worst moment: the job is killed while every part is written
        os.makedirs(checkpoint, exist_ok=True)  # the partial folder is there, the part not yet
        pathlib.Path(out_dir, f"writing{worker}").write_text(str(os.getpid()))
        time.sleep(600)
        write_part(checkpoint, worker, arrays)

    store.write_part = held
if mode == "claim_fails":
    claim, began = store.claim, time.monotonic()

    def refused(directory, token):
        store.claim = claim
        raise PermissionError(13, "Permission denied", os.path.join(directory, ".owner"))

    store.claim = refused
    try:
        manager.save(model)
        manager.wait()
    except tfdist.CheckpointError as error:
        payload["first"] = str(error)
    payload["first_seconds"] = time.monotonic() - began
if mode in ("save", "killed", "resume_save", "racing", "claim_fails"):
    manager.save(model)
    manager.wait()
if mode == "removed":
    from tfdist.checkpoint import manager as manager_module

    manager.save(model)
    model.fit(x, y, batch_size=common.CHECKPOINT_BATCH, epochs=1, shuffle=False, verbose=0)
    newer, hidden = manager.save(model), os.path.join(directory, ".another-jobs")
    manager.wait()
    payload["saved"] = common.checkpoint_state(model)
    model.fit(x, y, batch_size=common.CHECKPOINT_BATCH, epochs=1, shuffle=False, verbose=0)  # not saved
    opened, reader, read_manifest = pathlib.Path(out_dir, "opened"), manager_module._Reader, store.read_manifest
    if tfdist.rank() == 0:
        os.replace(newer, hidden)  # the first save is the newest when worker 0 chooses

        class Reader(reader):  # says when worker 0 has opened every part of the checkpoint it chose
            def __init__(self, checkpoint, *args):
                super().__init__(checkpoint, *args)
                opened.write_text(os.path.basename(checkpoint))

        manager_module._Reader = Reader
    else:
        def another_job_commits_and_removes(path):  # once worker 0 has read path: the newer one commits, path goes
            store.read_manifest = read_manifest
            deadline = time.monotonic() + 60
            while not opened.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            os.replace(hidden, newer)
            shutil.rmtree(path)
            return read_manifest(path)

        store.read_manifest = another_job_commits_and_removes
    payload["restored_step"] = tfdist.CheckpointManager(directory).restore(model)
if mode == "racing":
    read_manifest, committed = store.read_manifest, pathlib.Path(out_dir, "committed")

    def another_job_commits_meanwhile(path):  # worker 0 has chosen path: a newer one commits now
        store.read_manifest = read_manifest
        if tfdist.rank() == 0:
            shutil.copytree(path, os.path.join(directory, ".copy"))
            os.replace(os.path.join(directory, ".copy"), os.path.join(directory, "step-99"))
            committed.write_text("1")
        pathlib.Path(out_dir, f"read{tfdist.rank()}").write_text(os.path.basename(path))
        return read_manifest(path)

    store.read_manifest = another_job_commits_meanwhile
    if tfdist.rank() == 1:
        deadline = time.monotonic() + 60
        while not committed.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    payload["restored_step"] = tfdist.CheckpointManager(directory).restore(model)
payload["state"] = common.checkpoint_state(model)
common.write_result(out_dir, payload)

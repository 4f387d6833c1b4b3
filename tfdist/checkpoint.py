"""Checkpoint callbacks that work on several workers and never leave a broken file.

Keras 3's ``ModelCheckpoint`` and ``BackupAndRestore`` have no notion of a chief: every
worker writes the same path, and non-chiefs crash with FileExistsError on the backup
directory (tensorflow#38635, #31070, #40374). Every worker must still take part in a save,
since reading distributed variables can involve collectives. So, as tf-keras 2 did, the
chief writes the real files while every other worker writes into its own
``workertemp_<rank>`` directory, which it deletes right after.

Writes are atomic: the file is written under a temporary name in the same directory and
moved into place with ``os.replace``, so a worker killed mid-save leaves the previous
complete file. Paths must be on a local or mounted filesystem.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
from typing import Callable, Iterator

import keras

from tfdist import collectives, topology


def atomic_write(write: Callable[[str], None], path: str) -> None:
    """Calls ``write(temp_path)`` and moves the result to ``path`` in one step.

    The temporary name keeps ``path``'s ending (Keras checks ``.keras``, ``.weights.h5``).
    Leftovers of earlier interrupted writes to ``path`` are removed first.
    """
    directory, name = os.path.split(os.path.abspath(path))
    for stale in glob.glob(os.path.join(glob.escape(directory), f".tmp*-{glob.escape(name)}")):
        os.remove(stale)
    temp = os.path.join(directory, f".tmp{os.getpid()}-{name}")
    try:
        write(temp)
        os.replace(temp, path)
    finally:
        if os.path.exists(temp):
            os.remove(temp)


@contextlib.contextmanager
def worker_directory(directory: str) -> Iterator[str]:
    """Yields where this worker writes: ``directory`` on the chief, else a temp dir deleted after."""
    if topology.is_chief():
        os.makedirs(directory, exist_ok=True)
        yield directory
        return
    temp = os.path.join(directory, f"workertemp_{topology.rank()}")
    shutil.rmtree(temp, ignore_errors=True)
    os.makedirs(temp)
    try:
        yield temp
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def _check_local(path: str, argument: str) -> None:
    if "://" in str(path):
        raise ValueError(f"tfdist checkpoints write atomically with os.replace, which needs a local or "
                         f"mounted filesystem; received {argument}={path!r}. Mount the bucket, or use "
                         "Keras' own callback on one worker.")


class ModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """``keras.callbacks.ModelCheckpoint`` for several workers, with atomic writes.

    Takes Keras' arguments. Use it on every worker: all of them save (TensorFlow needs
    them to), only the chief's file appears at ``filepath``, and only the chief prints.
    Put ``MetricAverageCallback`` before it when ``save_best_only`` monitors values that
    could differ between workers.
    """

    def __init__(self, filepath, *args, **kwargs):
        super().__init__(filepath, *args, **kwargs)
        _check_local(self.filepath, "filepath")
        if not topology.is_chief():
            self.verbose = 0

    def _save_model(self, epoch, batch, logs):
        filepath = self._get_file_path(epoch, batch, logs or {})
        if os.path.isdir(filepath):
            raise IsADirectoryError(f"ModelCheckpoint needs a file path, but filepath={filepath!r} is an "
                                    "existing directory; add a file name such as 'ckpt.keras'.")
        if not self._should_save_model(epoch, batch, logs, filepath):
            return
        save = self.model.save_weights if self.save_weights_only else self.model.save
        with worker_directory(os.path.dirname(os.path.abspath(filepath))) as directory:
            atomic_write(lambda path: save(path, overwrite=True), os.path.join(directory, os.path.basename(filepath)))
        if self.verbose > 0:
            topology.print(f"\nEpoch {epoch + 1}: finished saving model to {filepath}")


class BackupAndRestore(keras.callbacks.BackupAndRestore):
    """``keras.callbacks.BackupAndRestore`` that works on a multi-worker cluster.

    Takes Keras' arguments. The chief keeps ``latest.weights.h5`` (optimizer state
    included) and ``training_metadata.json`` in ``backup_dir``; other workers write to
    ``backup_dir/workertemp_<rank>`` and delete it. On a restart (``tfdist run
    --max-restarts``), every worker restores the chief's files, so ``backup_dir`` must be on
    storage all workers see, and ``fit`` resumes at the epoch after the last completed one.
    """

    def __init__(self, backup_dir, *args, **kwargs):
        super().__init__(backup_dir, *args, **kwargs)
        _check_local(backup_dir, "backup_dir")

    def _save_model(self):
        with worker_directory(self.backup_dir) as directory:
            weights = os.path.join(directory, os.path.basename(self._weights_path))
            metadata = os.path.join(directory, os.path.basename(self._training_metadata_path))
            if self.double_checkpoint:
                for current in (weights, metadata):
                    if os.path.exists(current):
                        atomic_write(lambda path, src=current: shutil.copyfile(src, path), f"{current}.bkp")
            atomic_write(lambda path: self.model.save_weights(path, overwrite=True), weights)
            state = json.dumps({"epoch": self._current_epoch, "batch": self._last_batch_seen})
            atomic_write(lambda path: _write_text(path, state), metadata)

    def on_train_end(self, logs=None):
        collectives.barrier()  # every worker's last save is done before the chief deletes the directory
        if topology.is_chief():
            super().on_train_end(logs)


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)

"""Keras' own callbacks, as users pass them, made safe on every worker (tensorflow#38635, #31070, #40374).

Under a MultiWorkerMirroredStrategy of several workers (rank from the model's strategy):

* ``ModelCheckpoint``, ``BackupAndRestore``: the chief writes the named files, every other
  worker writes into a private temporary directory it deletes (``tfdist.atomic_files``); writes
  to local paths are atomic. ``BackupAndRestore`` restores the chief's files on every
  worker, a backup taken mid-epoch (``save_freq=N``) resumes at the next batch of
  that epoch, not at its start (a ``tfdist.data`` dataset with the records not yet read,
  whatever the worker count: it records the counts that trained the epoch), and the epoch
  it restored ends with its ``fit`` (Keras 3.15 keeps it in ``model._initial_epoch``: a later ``fit`` of the model, with any callbacks,
  started at that epoch and trained nothing when it asked for fewer epochs; on one device too). With
  sharded optimizer state the backup is a ``tfdist.CheckpointManager`` checkpoint (``backup_dir/sharded``):
  each worker writes its own shards, and it restores onto any number of workers.
* ``TensorBoard``, ``CSVLogger``: other workers write to a private temporary place,
  deleted when training ends; only the chief's files appear.
* ``EarlyStopping``, ``ReduceLROnPlateau``, ``ModelCheckpoint(save_best_only=True)``:
  the monitored value is averaged over the workers before the decision, so every
  worker decides the same on the same epoch (an epoch-end ``stop_training`` on any one
  worker stops every worker: ``tfdist.keras_fixes.preemption``).

Under any other strategy they behave as Keras wrote them, apart from atomic local writes.
"""

from __future__ import annotations

import json
import numbers
import os
import shutil
import tempfile
import time

import keras
import tensorflow as tf
from keras.src.callbacks.backup_and_restore import BackupAndRestore
from keras.src.callbacks.csv_logger import CSVLogger
from keras.src.callbacks.early_stopping import EarlyStopping
from keras.src.callbacks.model_checkpoint import ModelCheckpoint
from keras.src.callbacks.reduce_lr_on_plateau import ReduceLROnPlateau
from keras.src.callbacks.tensorboard import TensorBoard
from keras.src.trainers.epoch_iterator import EpochIterator
from packaging.version import Version

from tfdist import atomic_files, events, preemption, process_group
from tfdist import fit_start
from tfdist.checkpoint.manager import CheckpointManager
from tfdist.keras_fixes import callback_state, sharded_state
from tfdist.patching import Patch

patch = Patch(
    "callbacks", "tensorflow#38635",
    without="Keras' ModelCheckpoint, BackupAndRestore, TensorBoard and CSVLogger race on one path from every "
            "worker, and EarlyStopping/ReduceLROnPlateau may decide differently per worker (a hang).")

STEPS_DONE = "steps_done_in_epoch"  # tfdist's keys in training_metadata.json
LAYOUTS = "data_layouts_in_epoch"
_REPORTS_LAST_BATCH = Version(keras.__version__) >= Version("3.11")


def strategy_of(model) -> tf.distribute.Strategy | None:
    """The strategy ``model`` was built under; None for a stand-in that is no Keras model (Keras' callbacks take any
    object with the attributes they use, and Keras' own tests pass one): one worker, as with no strategy."""
    return getattr(model, "distribute_strategy", None)


def _workers(model) -> tuple[int, int]:
    """(this worker's rank, number of workers) of the strategy ``model`` was built under."""
    strategy = strategy_of(model)
    return process_group.worker_rank(strategy), process_group.num_workers(strategy)


def sum_over_workers(value: float, model) -> float:
    """``value`` summed over the workers of the strategy ``model`` was built under (a collective)."""
    group = process_group.for_strategy(strategy_of(model))
    return float(group.allreduce(tf.constant([value], tf.float64), op="sum", device="CPU").numpy()[0])


def _agree_on(model, logs: dict | None, key: str) -> None:
    """Replaces ``logs[key]`` with its mean over the workers, when there are several (as Horovod's
    MetricAverageCallback would): later callbacks see the mean too."""
    if logs and isinstance(logs.get(key), numbers.Real) and _workers(model)[1] > 1:
        logs[key] = sum_over_workers(float(logs[key]), model) / _workers(model)[1]


# ModelCheckpoint ---------------------------------------------------------------------------------

@patch.replaces(ModelCheckpoint, "_should_save_model", ("self", "epoch", "batch", "logs", "filepath"))
def _decide_like_every_worker(original, self, epoch, batch, logs, filepath):
    """save_best_only on the averaged monitor; only the chief prints."""
    if self.save_best_only:
        _agree_on(self.model, logs, self.monitor)
    verbose = self.verbose
    self.verbose = verbose if _workers(self.model)[0] == 0 else 0
    try:
        return original(self, epoch, batch, logs, filepath)
    finally:
        self.verbose = verbose


@patch.replaces(ModelCheckpoint, "_save_model", ("self", "epoch", "batch", "logs"))
def _save_on_every_worker_keep_the_chiefs(original, self, epoch, batch, logs):
    filepath = self._get_file_path(epoch, batch, logs or {})
    if not atomic_files.is_local(filepath):
        return original(self, epoch, batch, logs)
    if os.path.isdir(filepath):
        raise IsADirectoryError(f"ModelCheckpoint needs a file path, but filepath={filepath!r} is an "
                                "existing directory; add a file name such as 'ckpt.keras'.")
    if not self._should_save_model(epoch, batch, logs, filepath):
        return
    save = self.model.save_weights if self.save_weights_only else self.model.save
    rank, began = _workers(self.model)[0], time.time()
    with atomic_files.worker_directory(os.path.dirname(os.path.abspath(filepath)), rank) as directory:
        atomic_files.atomic_write(lambda path: save(path, overwrite=True),
                                os.path.join(directory, os.path.basename(filepath)))
    events.span("save", f"ModelCheckpoint {os.path.basename(filepath)}", began)
    if self.verbose > 0 and rank == 0:
        print(f"\nEpoch {epoch + 1}: finished saving model to {filepath}")


# BackupAndRestore --------------------------------------------------------------------------------

@patch.replaces(BackupAndRestore, "on_epoch_begin", ("self", "epoch", "logs"))
def _track_epoch(original, self, epoch, logs=None):
    self._current_epoch = epoch  # Keras sets it only at epoch end: a mid-epoch backup must know its epoch
    self._tfdist_steps_done = 0
    restored = getattr(self, "_tfdist_restored", None)  # the runs that trained part of a resumed epoch
    self._tfdist_layouts = list(restored.layouts) if restored is not None and restored.epoch == epoch else []
    original(self, epoch, logs)


@patch.replaces(BackupAndRestore, "on_train_batch_end", ("self", "batch", "logs"))
def _track_steps(original, self, batch, logs=None):
    # With steps_per_execution=K, Keras >= 3.11 reports a call's last batch, earlier Keras its first.
    self._tfdist_steps_done = batch + (1 if _REPORTS_LAST_BATCH else self.model.steps_per_execution)
    original(self, batch, logs)


@patch.replaces(BackupAndRestore, "on_epoch_end", ("self", "epoch", "logs"))
def _epoch_complete(original, self, epoch, logs=None):
    self._tfdist_steps_done = 0
    original(self, epoch, logs)


@patch.replaces(BackupAndRestore, "_save_model", ("self",))
def _backup_on_every_worker_keep_the_chiefs(original, self):
    rank = _workers(self.model)[0]
    if not atomic_files.is_local(self.backup_dir):
        return original(self) if rank == 0 else None
    began = time.time()
    record = {"epoch": self._current_epoch, "batch": self._last_batch_seen,
              STEPS_DONE: getattr(self, "_tfdist_steps_done", 0), LAYOUTS: _layouts(self),
              callback_state.KEY: callback_state.snapshot(getattr(self, "_tfdist_callbacks", ()))}
    sharded = sharded_state.is_sharded(self.model.optimizer)
    with atomic_files.worker_directory(self.backup_dir, rank) as directory:
        weights = os.path.join(directory, os.path.basename(self._weights_path))
        metadata = os.path.join(directory, os.path.basename(self._training_metadata_path))
        if self.double_checkpoint:
            for current in (weights, metadata):
                if os.path.exists(current):
                    atomic_files.atomic_write(lambda path, src=current: shutil.copyfile(src, path), f"{current}.bkp")
        if sharded:  # each worker writes its shards; the record commits with them (restored from there)
            _sharded_backup(self).save(self.model, metadata=record)
        else:
            atomic_files.atomic_write(lambda path: self.model.save_weights(path, overwrite=True), weights)
        atomic_files.write_text(metadata, json.dumps(record))
    events.span("save", "BackupAndRestore", began, epoch=self._current_epoch,
                steps_done=getattr(self, "_tfdist_steps_done", 0))


@patch.replaces(BackupAndRestore, "on_train_begin", ("self", "logs"))
def _restore_and_resume_mid_epoch(original, self, logs=None):
    original(self, logs)  # Keras restores the weights and the epoch
    path = self._training_metadata_path
    metadata = {}
    if atomic_files.is_local(path) and os.path.exists(path):
        with open(path) as file:
            metadata = json.load(file)
    if atomic_files.is_local(self.backup_dir) and _sharded_backup(self).latest is not None:
        _sharded_backup(self).restore(self.model)  # onto any number of workers, sharded or not
        metadata = _sharded_backup(self).metadata()  # the record that committed with the shards
        self.model._initial_epoch = metadata["epoch"]
    done, layouts, steps = metadata.get(STEPS_DONE, 0), metadata.get(LAYOUTS, []), self.params.get("steps")
    if done and steps and done >= steps:  # saved at an epoch's last step: never replay it empty
        self.model._initial_epoch += 1
        done, layouts = 0, []
    epoch = getattr(self.model, "_initial_epoch", None)
    self._tfdist_restored = fit_start.Resume(epoch, done, tuple(map(tuple, layouts))) if epoch is not None else None
    preemption.resume_at(done, self._tfdist_restored)


def _sharded_backup(callback):
    """The checkpoint manager of a backup of sharded optimizer state (``backup_dir/sharded``): each worker writes
    its own shards, nothing is gathered whole (tfdist.CheckpointManager)."""
    manager = getattr(callback, "_tfdist_manager", None)
    if manager is None:
        manager = CheckpointManager(os.path.join(callback.backup_dir, "sharded"), max_to_keep=1, async_save=False)
        callback._tfdist_manager = manager
    return manager


def _layouts(callback) -> list[list]:
    """The runs that trained the current epoch so far: ``[input pipelines, steps done at its end, global
    batch, split]`` each (``tfdist.data.epochs`` tells from them which records were read); [] unless a tfdist
    dataset trains."""
    layout, done = fit_start.training_layout(), getattr(callback, "_tfdist_steps_done", 0)
    if layout is None or not done:
        return []
    pipelines, global_batch, split = layout
    earlier = [list(run) for run in getattr(callback, "_tfdist_layouts", [])]
    if len(earlier) == 1 and earlier[0][0] == pipelines and earlier[0][2:] == [global_batch, split]:
        earlier = []  # this run went on with the same stream
    return earlier + [[pipelines, done, global_batch, split]]


@patch.replaces(BackupAndRestore, "on_train_end", ("self", "logs"))
def _delete_after_every_worker_is_done(original, self, logs=None):
    self.model._initial_epoch = None  # Keras keeps the restored epoch: every later fit of the model would skip to it
    rank, workers = _workers(self.model)
    if workers > 1:
        process_group.for_strategy(strategy_of(self.model)).barrier()  # every last save is done before the chief deletes
    if rank == 0:
        original(self, logs)
    if workers > 1:
        process_group.for_strategy(strategy_of(self.model)).barrier()  # no worker sees it before it is gone


@patch.replaces(EpochIterator, "_enumerate_iterator", ("self",))
def _skip_steps_the_backup_had_done(original, self):
    """A fit's first training epoch: its ``tfdist.data`` dataset starts where the backup was
    (``tfdist.fit_start``, open until the first batch ends: ``tfdist.keras_fixes.preemption``); after a mid-epoch resume
    (``tfdist.preemption.resume_at``) it consumes its done steps' data, then goes on."""
    resume = preemption.take_resume()
    if resume is None:
        yield from original(self)
        return
    skip, data, epoch = resume
    data = data or fit_start.Resume(epoch)  # a fit from its start: at its first epoch (initial_epoch)
    with fit_start.opened(fit_start.Start(data, self.steps_per_epoch)):
        for item in original(self):  # (step, iterator) before Keras 3.11, (begin, end, iterator) since
            if item[0] + self.steps_per_execution <= skip:
                try:
                    for _ in range(self.steps_per_execution):
                        next(item[-1])
                except (StopIteration, tf.errors.OutOfRangeError):
                    return  # a dataset of unknown length saved at its epoch's last step: that epoch was complete
                continue
            yield item


# TensorBoard and CSVLogger -----------------------------------------------------------------------

@patch.replaces(TensorBoard, "set_model", ("self", "model"))
def _tensorboard_elsewhere_unless_chief(original, self, model):
    if process_group.worker_rank(strategy_of(model)) != 0:
        _drop_private_dir(self, "log_dir")
        self._tfdist_user_value = getattr(self, "_tfdist_user_value", self.log_dir)
        self.log_dir = self._tfdist_private = tempfile.mkdtemp(prefix="tfdist-tensorboard-")
    original(self, model)


@patch.replaces(TensorBoard, "on_train_end", ("self", "logs"))
def _tensorboard_cleanup(original, self, logs=None):
    original(self, logs)
    _drop_private_dir(self, "log_dir")


@patch.replaces(CSVLogger, "on_train_begin", ("self", "logs"))
def _csv_elsewhere_unless_chief(original, self, logs=None):
    if _workers(self.model)[0] != 0:
        self._tfdist_user_value = getattr(self, "_tfdist_user_value", self.filename)
        self._tfdist_private = tempfile.mkdtemp(prefix="tfdist-csv-")
        self.filename = os.path.join(self._tfdist_private, "log.csv")
    original(self, logs)


@patch.replaces(CSVLogger, "on_train_end", ("self", "logs"))
def _csv_cleanup(original, self, logs=None):
    original(self, logs)
    _drop_private_dir(self, "filename")


def _drop_private_dir(callback, attribute: str) -> None:
    """Deletes a non-chief's private output and puts the user's path back."""
    private = getattr(callback, "_tfdist_private", None)
    if private:
        shutil.rmtree(private, ignore_errors=True)
        setattr(callback, attribute, callback._tfdist_user_value)
        callback._tfdist_private = None


# Decisions every worker must take alike ----------------------------------------------------------

@patch.replaces(EarlyStopping, "on_epoch_end", ("self", "epoch", "logs"))
def _early_stopping_on_the_mean(original, self, epoch, logs=None):
    _agree_on(self.model, logs, self.monitor)
    original(self, epoch, logs)


@patch.replaces(ReduceLROnPlateau, "on_epoch_end", ("self", "epoch", "logs"))
def _reduce_lr_on_the_mean(original, self, epoch, logs=None):
    _agree_on(self.model, logs, self.monitor)
    original(self, epoch, logs)

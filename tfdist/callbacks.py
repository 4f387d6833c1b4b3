"""Horovod-style Keras callbacks, working on tf.distribute strategies.

Order callbacks the way Horovod does::

    callbacks = [
        tfdist.callbacks.BroadcastGlobalVariablesCallback(0),
        tfdist.callbacks.MetricAverageCallback(),      # before anything that reads the logs
        tfdist.callbacks.LearningRateWarmupCallback(initial_lr=lr, warmup_epochs=5),
        tfdist.callbacks.Throughput(),
        keras.callbacks.ReduceLROnPlateau(...),
        keras.callbacks.ModelCheckpoint("ckpt.keras"),  # every worker, chief's file kept
    ]

Every callback here runs on every worker (several make collective calls, which all
workers must make in the same order); only printing and file writing are chief-only.
``ModelCheckpoint`` and ``BackupAndRestore`` are Keras' own classes, which tfdist makes
safe on several workers (``tfdist.keras_fixes.callbacks``); they are re-exported here.
"""

from __future__ import annotations

import time
from typing import Callable, Union

import keras
import numpy as np

from tfdist import collectives, ranks
from tfdist.keras_fixes import sharded_state

ModelCheckpoint = keras.callbacks.ModelCheckpoint
BackupAndRestore = keras.callbacks.BackupAndRestore

__all__ = ["BackupAndRestore", "BroadcastGlobalVariablesCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "MetricAverageCallback", "ModelCheckpoint", "Throughput"]

Multiplier = Union[float, Callable[[float], float]]


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Makes every worker's model and optimizer variables equal to worker ``root_rank``'s.

    Broadcasts when training begins (so weights loaded on one worker only reach all) and
    again after the first batch, once the optimizer has created its slot variables, as
    Horovod does. Put it first in the callback list.

    Args:
        root_rank: the worker whose values everyone takes.
    """

    def __init__(self, root_rank: int = 0):
        super().__init__()
        self.root_rank = root_rank
        self._done_after_first_batch = False

    def on_train_begin(self, logs=None):
        self.broadcast()

    def on_train_batch_end(self, batch, logs=None):
        if not self._done_after_first_batch:
            self.broadcast()
            self._done_after_first_batch = True

    def broadcast(self) -> None:
        """Broadcasts now: the model's weights and, once built, the optimizer's variables."""
        variables = list(self.model.weights)
        optimizer = self.model.optimizer
        if optimizer is not None and optimizer.built:  # a sharded optimizer's shards differ by design
            variables += sharded_state.replicated_variables(optimizer)
        values = collectives.broadcast_arrays([np.asarray(v.numpy()) for v in variables], self.root_rank)
        for variable, value in zip(variables, values):
            variable.assign(value)


class MetricAverageCallback(keras.callbacks.Callback):
    """Averages the epoch's logged numbers over all workers, each weighed by its examples, in place.

    Each worker may compute metrics on its own data (tfdist.horovod: its shard; custom metrics,
    values added by other callbacks); afterwards every worker logs the same average. A worker's
    training numbers weigh by the examples it trained on in the epoch, its ``val_`` numbers by
    the examples it validated on (its loss tracker's counts), so the loss and the metrics that
    average over examples are the one-device figures over every worker's examples however
    unevenly the data split (Horovod averages the workers' means); ``weighted_metrics`` average
    over sample weights, which the counts do not see. A worker without a figure (no validation
    data) takes the others'. It must come before the callbacks that read the logs or evaluate
    the model: ReduceLROnPlateau, TensorBoard, EarlyStopping and the checkpoint callbacks (a
    ``save_best_only`` decision that differs between workers would desynchronise their
    collective saves).
    """

    def __init__(self):
        super().__init__()
        self._trained = self._validated = None  # this epoch's examples, read around its validation

    def on_epoch_begin(self, epoch, logs=None):
        self._trained = self._validated = None

    def on_test_begin(self, logs=None):
        self._trained = self._examples()  # before fit's validation resets the trackers

    def on_test_end(self, logs=None):
        self._validated = self._examples()  # before a callback's own evaluate resets them again

    def on_epoch_end(self, epoch, logs=None):
        trained = self._examples() if self._trained is None else self._trained
        validated = self._validated or 0.0
        _average({} if logs is None else logs, lambda key: validated if key.startswith("val_") else trained)

    def _examples(self) -> float:
        """The examples the model's loss tracker counted since its last reset (0 without one)."""
        tracker = getattr(self.model, "_loss_tracker", None)
        return float(np.asarray(tracker.count)) if tracker is not None else 0.0


def _average(logs: dict, examples: Callable[[str], float]) -> None:
    """Every worker's numeric ``logs`` become their average over the workers, each weighed by ``examples(key)``
    (a plain mean where no worker counted any); a key some workers lack averages over those that have it."""
    mine = {k for k, v in logs.items() if np.ndim(v) == 0 and np.issubdtype(np.asarray(v).dtype, np.number)}
    keys = _every_workers_keys(mine)
    present = np.array([k in mine for k in keys], np.float64)
    values = np.array([float(logs[k]) if k in mine else 0.0 for k in keys], np.float64)
    weights = np.array([examples(k) if k in mine else 0.0 for k in keys], np.float64)
    sums = collectives.allreduce(np.concatenate([np.where(weights > 0, values * weights, 0.0), weights, values,
                                                 present]), op="sum")
    weighed, total, plain, having = np.split(sums, 4)
    averaged = np.where(total > 0, weighed / np.where(total > 0, total, 1.0), plain / np.where(having > 0, having, 1))
    logs.update({k: float(v) for k, v in zip(keys, averaged)})


def _every_workers_keys(mine: set[str]) -> list[str]:
    """The union of every worker's keys, sorted (one allgather of their names)."""
    names = np.frombuffer("".join(f"\n{k}" for k in sorted(mine)).encode() or b"\n", np.uint8).astype(np.int32)
    gathered = collectives.allgather(names)
    return sorted(k for k in bytes(gathered.astype(np.uint8)).decode().split("\n") if k)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets ``learning_rate = initial_lr * multiplier(epoch)`` for epochs in [start_epoch, end_epoch).

    Args:
        initial_lr: the base learning rate (usually already scaled, ``tfdist.scale_lr(lr)``).
        multiplier: a number, or a function of the epoch.
        start_epoch: first epoch (0-based) the schedule applies to.
        end_epoch: epoch at which it stops applying; None for never.
        staircase: True sets the rate once per epoch with the integer epoch; False sets it
            every batch with the fractional epoch ``epoch + batch / steps_per_epoch``.
        steps_per_epoch: batches per epoch, for ``staircase=False``; None takes fit's count.
        momentum_correction: when the rate changes, scale the optimizer's momentum
            buffers by new_rate / old_rate (Goyal et al.; Horovod's default), so momentum
            gathered at the old rate does not overshoot at the new one.

    The epoch's final rate is added to the logs as ``lr`` (as Horovod does).

    Raises:
        ValueError: a non-positive ``initial_lr``, or epochs out of order.
    """

    def __init__(self, initial_lr: float, multiplier: Multiplier, start_epoch: int = 0,
                 end_epoch: int | None = None, staircase: bool = True, steps_per_epoch: int | None = None,
                 momentum_correction: bool = False):
        super().__init__()
        if not (isinstance(initial_lr, (int, float)) and initial_lr > 0):
            raise ValueError(f"initial_lr must be a positive number; received initial_lr={initial_lr!r}.")
        if end_epoch is not None and end_epoch <= start_epoch:
            raise ValueError(f"end_epoch must be after start_epoch; received start_epoch={start_epoch}, "
                             f"end_epoch={end_epoch}.")
        self.initial_lr = float(initial_lr)
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.steps_per_epoch = steps_per_epoch
        self.momentum_correction = momentum_correction
        self._epoch = 0

    def _applies(self, epoch: int) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _set_learning_rate(self, epoch: float) -> None:
        optimizer = self.model.optimizer
        new_lr = self.initial_lr * self.multiplier(epoch)
        if self.momentum_correction:
            _correct_momentum(optimizer, float(keras.ops.convert_to_numpy(optimizer.learning_rate)), new_lr)
        optimizer.learning_rate = new_lr

    def on_train_begin(self, logs=None):
        optimizer = self.model.optimizer
        if isinstance(getattr(optimizer, "_learning_rate", None), keras.optimizers.schedules.LearningRateSchedule):
            raise ValueError(f"{type(self).__name__} sets the learning rate itself, but the optimizer uses the "
                             f"schedule {optimizer._learning_rate!r}; give the optimizer a float learning_rate.")
        if not self.staircase:
            self.steps_per_epoch = self.steps_per_epoch or self.params.get("steps")
            if not self.steps_per_epoch:
                raise ValueError(f"{type(self).__name__} with staircase=False needs steps_per_epoch, and fit "
                                 "does not know it (the dataset has unknown length): pass steps_per_epoch=N.")

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        if self.staircase and self._applies(epoch):
            self._set_learning_rate(epoch)

    def on_train_batch_begin(self, batch, logs=None):
        if not self.staircase and self._applies(self._epoch):
            self._set_learning_rate(self._epoch + batch / self.steps_per_epoch)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))


def _correct_momentum(optimizer, old_lr: float, new_lr: float) -> None:
    """Scales the momentum buffers by ``new_lr / old_lr``.

    Keras keeps the rate inside the velocity (``m = momentum * m - lr * g``), so this is
    Horovod's one-batch ``momentum * new_lr / old_lr`` (exactly so for SGD without
    Nesterov, and for RMSprop's momentum). Optimizers without momentum are left alone.
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    buffers = getattr(inner, "momentums", None) or getattr(inner, "_momentums", None)
    if not buffers or not getattr(inner, "momentum", 0) or old_lr in (0.0, new_lr):
        return
    ratio = new_lr / old_lr
    for buffer in buffers:
        for copy in sharded_state.each_copy(buffer):  # each replica's shard when the state is sharded
            copy.assign(copy * ratio)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Goyal et al.'s gradual warmup: from ``initial_lr / size()`` to ``initial_lr``, per batch.

    During epoch e (fractional), the rate is
    ``initial_lr / size() * (e * (size() - 1) / warmup_epochs + 1)``; after the last warmup
    epoch it is exactly ``initial_lr``.

    Args:
        initial_lr: the rate to reach, usually ``tfdist.scale_lr(base_lr)``.
        warmup_epochs: epochs the warmup lasts.
        steps_per_epoch: batches per epoch; None takes fit's count.
        verbose: 1 prints (on the chief) when the warmup ends.
        momentum_correction: see ``LearningRateScheduleCallback``.
    """

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, steps_per_epoch: int | None = None,
                 verbose: int = 0, momentum_correction: bool = False):
        if not (isinstance(warmup_epochs, int) and warmup_epochs >= 1):
            raise ValueError(f"warmup_epochs must be an int >= 1; received warmup_epochs={warmup_epochs!r}.")
        super().__init__(initial_lr, self._warmup, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, steps_per_epoch=steps_per_epoch, momentum_correction=momentum_correction)
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def _warmup(self, epoch: float) -> float:
        size = self._job_size()
        return 1.0 / size * (epoch * (size - 1) / self.warmup_epochs + 1)

    def _job_size(self) -> int:
        """How many times larger the final rate is than the first (replicas in sync)."""
        return ranks.size()

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.warmup_epochs - 1:
            self.model.optimizer.learning_rate = self.initial_lr
        super().on_epoch_end(epoch, logs)
        if epoch == self.warmup_epochs - 1 and self.verbose:
            ranks.print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {self.initial_lr:g}.")


class Throughput(keras.callbacks.Callback):
    """Adds ``examples_per_sec`` and ``step_time_sec`` to each epoch's logs; prints them on the chief.

    The first batch of each epoch (tracing, warm-up) is timed apart and left out, unless it
    is the only one. Examples are global (all workers): ``batch_size`` times the steps when
    given, else the count Keras' loss tracker keeps of the examples it saw (so ``compile``
    needs a loss).

    Args:
        batch_size: the global batch size, or None to count examples.
        verbose: 1 prints one line per epoch on the chief.
    """

    def __init__(self, batch_size: int | None = None, verbose: int = 1):
        super().__init__()
        self.batch_size = batch_size
        self.verbose = verbose
        self._first = self._end = None

    def _examples_seen(self) -> float:
        tracker = getattr(self.model, "_loss_tracker", None)
        count = 0.0 if tracker is None else float(tracker.count.numpy())
        if not count:
            raise ValueError("Throughput() counts examples with Keras' loss tracker, but this model's train_step "
                             "does not update it; pass Throughput(batch_size=GLOBAL_BATCH).")
        return count

    def _mark(self) -> tuple[float, float, int]:
        examples = self._steps * self.batch_size if self.batch_size else self._examples_seen()
        return time.perf_counter(), examples, self._steps

    def on_epoch_begin(self, epoch, logs=None):
        self._start = (time.perf_counter(), 0.0, 0)
        self._first = self._end = None
        self._steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self._steps = batch + 1
        if self._first is None:
            self._first = self._mark()

    def on_test_begin(self, logs=None):
        if self._end is None and self._first is not None:  # before evaluate resets the tracker
            self._end = self._mark()

    def on_epoch_end(self, epoch, logs=None):
        end = self._end or self._mark()
        start = self._first if end[2] > 1 else self._start
        seconds = end[0] - start[0]
        steps = end[2] - start[2]
        stats = {"examples_per_sec": (end[1] - start[1]) / seconds, "step_time_sec": seconds / steps}
        if logs is not None:
            logs.update(stats)
        if self.verbose:
            ranks.print(f"Epoch {epoch + 1}: {stats['examples_per_sec']:.1f} examples/s, "
                           f"{1000 * stats['step_time_sec']:.2f} ms/step")

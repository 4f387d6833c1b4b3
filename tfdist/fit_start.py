"""Where a fit's training data starts: the state between a restored backup and the dataset that trains.

``BackupAndRestore`` restores a position (``Resume``: the epoch, the steps of it done, and the input
pipeline counts that did them) into the fit's session (``tfdist.preemption.resume_at``); a fit from its
start has one too (its first epoch). When the fit enumerates its first training epoch,
``tfdist.keras_fixes.callbacks`` opens a window (``opened``) until its first batch ends (``close``); a
repeating ``tfrecord_dataset`` whose iterator starts in it takes the position (``take``) and starts there,
and tells which pipeline count, global batch and split of the epoch train now (``training_layout``), which the
next backup records. Standard library only (``tfdist.data.epochs`` works out the records).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Iterator


@dataclasses.dataclass(frozen=True)
class Resume:
    """A fit's start: ``epoch`` (Keras' count), ``steps`` of it done before, and ``layouts``: for each run that
    trained part of it, ``(input pipelines, steps done when it stopped, global batch, split)``, in order (empty:
    unknown; split: how the dataset cut an epoch among its pipelines; older backups wrote fewer fields)."""

    epoch: int
    steps: int = 0
    layouts: tuple[tuple[int, ...], ...] = ()


@dataclasses.dataclass(frozen=True)
class Start:
    """What the first training epoch's dataset is told: the restored position (None: a fit from the start) and
    the fit's steps per epoch (None: one pass over the data)."""

    resume: Resume | None
    steps_per_epoch: int | None


_lock = threading.Lock()
_open: Start | None = None
_training: tuple[int, int, str] | None = None


@contextlib.contextmanager
def opened(start: Start) -> Iterator[None]:
    """The fit's first training epoch, until its first batch ends (``close``): a repeating dataset whose iterator
    starts within takes ``start``."""
    global _open, _training
    with _lock:
        _open, _training = start, None
    try:
        yield
    finally:
        close()


def close() -> None:
    """No later iterator takes the position (the first training step has pulled its data, or the epoch ended)."""
    global _open
    if _open is not None:
        with _lock:
            _open = None


def take(pipelines: int, global_batch: int, split: str) -> Start | None:
    """The open window's start (None when none is open); ``pipelines``, ``global_batch`` and ``split`` (how it cuts
    an epoch among pipelines): the taker's. Every
    iterator that starts in the window takes it: the training data's (one per input pipeline of this process,
    or datasets zipped together), which the first step pulls."""
    global _training
    with _lock:
        if _open is not None:
            _training = (pipelines, global_batch, split)
        return _open


def training_layout() -> tuple[int, int, str] | None:
    """``(input pipelines, global batch, split)`` of the dataset training in the current fit (None: not a tfdist
    reader)."""
    return _training

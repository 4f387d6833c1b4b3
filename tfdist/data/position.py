"""Where a fit's training data starts: the state between a restored backup and the dataset that trains.

``BackupAndRestore`` restores a position (``Resume``: the epoch, the steps of it done, and the input
pipeline counts that did them) into the fit's session (``tfdist.preemption.resume_at``). When the fit
enumerates its first training epoch, ``tfdist.keras_fixes.callbacks`` opens a window (``opened``) for its
duration; the repeating ``tfrecord_dataset`` whose iterator starts first in that window takes the position
(``take``) and starts there; it also tells which pipeline count trains now (``training_pipelines``), which
the next backup records. Nothing here runs TensorFlow.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Iterator


@dataclasses.dataclass(frozen=True)
class Resume:
    """A fit's start: ``epoch`` (Keras' count), ``steps`` of it done before, and ``layouts``: for each run that
    trained part of it, ``(input pipelines, steps done when it stopped)``, in order (empty: unknown)."""

    epoch: int
    steps: int = 0
    layouts: tuple[tuple[int, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class Start:
    """What the first training epoch's dataset is told: the restored position (None: a fit from the start) and
    the fit's steps per epoch (None: one pass over the data)."""

    resume: Resume | None
    steps_per_epoch: int | None


_lock = threading.Lock()
_open: Start | None = None
_training_pipelines: int | None = None


@contextlib.contextmanager
def opened(start: Start) -> Iterator[None]:
    """The fit's first training epoch: the first repeating dataset whose iterator starts within takes ``start``."""
    global _open, _training_pipelines
    with _lock:
        _open, _training_pipelines = start, None
    try:
        yield
    finally:
        close()


def close() -> None:
    """No later iterator takes the position (the first training step has pulled its data)."""
    global _open
    with _lock:
        _open = None


def take(pipelines: int) -> Start | None:
    """The open window's start, once (None when none is open); ``pipelines``: the taker's count."""
    global _open, _training_pipelines
    with _lock:
        start, _open = _open, None
        if start is not None:
            _training_pipelines = pipelines
        return start


def training_pipelines() -> int | None:
    """The input pipeline count of the dataset training in the current fit (None: not a tfdist reader)."""
    return _training_pipelines

"""EarlyStopping's and ReduceLROnPlateau's counters in BackupAndRestore's backup, so a restored fit goes on with them.

Keras 3's BackupAndRestore saves the weights, the optimizer and the epoch; every callback's
``on_train_begin`` then resets its own counters, so after a preemption EarlyStopping waits its
whole patience again and ReduceLROnPlateau its whole wait: the resumed job stops (or lowers the
rate) later than one never interrupted. tfdist writes those counters into the backup's training
metadata (key ``"callbacks"``, ``tfdist.keras_fixes.callbacks``) and sets them back once every
callback's ``on_train_begin`` has run (``tfdist.keras_fixes.preemption``). A backup holds them as
they were when it saved: Keras runs callbacks in list order, so one listed after BackupAndRestore
is saved as of the epoch before (list BackupAndRestore last to keep every epoch end). EarlyStopping's
``best_weights`` (``restore_best_weights=True``) are not kept: they start again from the restore.
"""

from __future__ import annotations

import json
import os
from typing import Sequence

from keras.src.callbacks.callback import Callback
from keras.src.callbacks.early_stopping import EarlyStopping
from keras.src.callbacks.reduce_lr_on_plateau import ReduceLROnPlateau

from tfdist import atomic_files

KEY = "callbacks"
_COUNTERS = ((EarlyStopping, ("wait", "stopped_epoch", "best", "best_epoch")),
             (ReduceLROnPlateau, ("wait", "cooldown_counter", "best")))


def _kept(callbacks: Sequence[Callback]):
    """(key, callback, attribute names) of each callback whose counters are kept, keyed by class and position."""
    for index, callback in enumerate(callbacks):
        for kind, names in _COUNTERS:
            if isinstance(callback, kind):
                yield f"{index}:{type(callback).__name__}", callback, names


def snapshot(callbacks: Sequence[Callback]) -> dict:
    """The counters of ``callbacks`` as JSON-ready values."""
    return {key: {name: None if getattr(callback, name, None) is None else float(getattr(callback, name))
                  for name in names}
            for key, callback, names in _kept(callbacks)}


def restore(callbacks: Sequence[Callback], metadata_path: str) -> None:
    """Sets the counters saved in the training metadata at ``metadata_path`` (if any) back on ``callbacks``."""
    if not (atomic_files.is_local(metadata_path) and os.path.exists(metadata_path)):
        return
    with open(metadata_path) as file:
        saved = json.load(file).get(KEY, {})
    for key, callback, names in _kept(callbacks):
        for name, value in saved.get(key, {}).items():
            if name in names:
                setattr(callback, name, value if value is None or name == "best" else int(value))

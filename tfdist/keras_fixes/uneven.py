"""``fit``/``evaluate`` on per-worker data of different lengths: every worker runs the longest worker's step count.

Keras 3 takes an epoch's step count from the local dataset's cardinality
(``EpochIterator._num_batches``). Under MultiWorkerMirroredStrategy each worker then stops
after its own batches while the others still call collectives: the job dies with
"Collective instance ... expected ... data_type" or hangs. Here the workers agree on the
count once per iterator (one small all-gather): the most batches any worker has, or
unknown when one worker's is unknown. A worker out of data gets empty batches from
TensorFlow's distributed iterator (it all-reduces "has data" every step), which add zero
to the gradients and metrics.
"""

from __future__ import annotations

import tensorflow as tf
from keras.src.backend.tensorflow.trainer import TFEpochIterator
from keras.src.trainers.epoch_iterator import EpochIterator

from tfdist import process_group
from tfdist.patching import Patch

patch = Patch(
    "uneven_data", "keras#20585 follow-up: per-worker data of different lengths (tfdist UPSTREAM.md)",
    without="fit/evaluate on per-worker datasets of different lengths under MultiWorkerMirroredStrategy stop "
            "each worker at its own length and fail with a collective mismatch (or hang).")


@patch.replaces(TFEpochIterator, "__init__", ("self", "distribute_strategy", "args", "kwargs"))
def _agree_on_steps(original, self, distribute_strategy=None, *args, **kwargs):
    original(self, distribute_strategy, *args, **kwargs)
    if not process_group.is_multi_worker(self._distribute_strategy) or self.steps_per_epoch:
        return
    mine = -1 if self._num_batches is None else int(self._num_batches)
    counts = process_group.for_strategy(self._distribute_strategy).allgather(tf.constant([mine], tf.int64),
                                                                           device="CPU").numpy()
    self._tfdist_num_batches = None if (counts < 0).any() else int(counts.max())
    self._num_batches = self._tfdist_num_batches


@patch.replaces(EpochIterator, "reset", ("self",))
def _keep_the_agreed_steps(original, self):
    original(self)
    if hasattr(self, "_tfdist_num_batches"):
        self._num_batches = self._tfdist_num_batches

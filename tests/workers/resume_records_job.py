"""Which records a fit trains on, when a job resumes mid-epoch on another worker count (issue 43).

The model is a counter: one zero-initialised Embedding row per record, the loss the row's value, SGD with
learning rate 1, so each time a record is trained on its row falls by exactly 1 / global batch. Arguments:
``OUT PATTERN RECORDS GLOBAL_BATCH STOP [EPOCHS [SEED [HOW]]]`` where STOP is ``EPOCH:STEP`` or ``-`` (train to
the end); HOW is ``exit`` (the default: the chief dies once the backup of that step of that epoch is written) or
``sigterm`` (the chief sends SIGTERM to ``tfdist run`` after that step: every worker saves at an agreed step and
exits 85). EPOCHS defaults to 2, SEED to 5. Every worker writes its rows.
"""

import os
import signal
import sys

import tfdist
from tests.workers import common

out_dir, pattern, records, global_batch, stop = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
EPOCHS, SEED, HOW = (int(sys.argv[6]) if len(sys.argv) > 6 else 2), (int(sys.argv[7]) if len(sys.argv) > 7 else 5), (
    sys.argv[8] if len(sys.argv) > 8 else "exit")
with tfdist.scope() as strategy:
    pass
import keras  # noqa: E402  (after the strategy: TF must not start first)
import tensorflow as tf  # noqa: E402

from tfdist import data  # noqa: E402

tf.random.set_seed(100 + tfdist.rank())  # each worker's own global seed: the reader must not depend on it


class DieAfterBackup(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if stop != "-" and (self.epoch, batch + 1) == tuple(map(int, stop.split(":"))) and tfdist.rank() == 0:
            if HOW == "sigterm":
                os.kill(os.getppid(), signal.SIGTERM)  # tfdist run forwards it: an agreed stop, saved, exit 85
            else:
                os._exit(3)  # BackupAndRestore, before this callback, has written this step's backup


with strategy.scope():
    ids = keras.Input((), dtype="int64")
    model = keras.Model(ids, keras.layers.Embedding(records, 1, embeddings_initializer="zeros")(ids))
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss=lambda y, rows: rows)
dataset = data.distribute(strategy, lambda ctx: data.tfrecord_dataset(
    pattern, batch_size=global_batch, input_context=ctx, repeat=True, seed=SEED, features=["label"],
    parse_fn=lambda batch: (batch["label"], tf.zeros_like(batch["label"], "float32"))))
backup = keras.callbacks.BackupAndRestore(os.path.join(out_dir, "backup"), save_freq=1)
model.fit(dataset, epochs=EPOCHS, steps_per_epoch=records // global_batch, verbose=0,
          callbacks=[backup, DieAfterBackup()])
common.write_result(out_dir, {"rows": model.get_weights()[0][:, 0].tolist(), "workers": tfdist.size()})

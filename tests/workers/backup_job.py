"""A 2-worker job with BackupAndRestore: the first attempt dies after epoch 2 of 4.

Run with ``tfdist run --max-restarts 1``: attempt 0 (TFDIST_RESTART=0) exits after the
backup of epoch 2; attempt 1 restores it and trains epochs 3-4.
"""

import json
import os
import sys

import tfdist
from tests.workers import common

out_dir = sys.argv[1]
with tfdist.scope() as strategy:
    pass
import keras  # noqa: E402  (after the strategy: TF must not start first)
import tensorflow as tf  # noqa: E402

from tfdist import callbacks as cbs  # noqa: E402

attempt = int(os.environ["TFDIST_RESTART"])
backup_dir = os.path.join(out_dir, "backup")


class Record(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epochs = []

    def on_train_begin(self, logs=None):
        self.start_weights = [w.tolist() for w in self.model.get_weights()]

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(epoch)
        if attempt == 0 and epoch == 1:
            state = {"weights": [w.tolist() for w in self.model.get_weights()],
                     "backup_files": sorted(os.listdir(backup_dir))}
            common.write_result(out_dir, {"attempt0": state})
            os._exit(3)


with strategy.scope():
    model = common.equivalence_model()
x, y = common.regression_data(64)
record = Record()
history = model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), epochs=4, verbose=0,
                    callbacks=[cbs.BackupAndRestore(backup_dir), record])
previous = json.loads(open(os.path.join(out_dir, f"worker{tfdist.rank()}.json")).read())
common.write_result(out_dir, {**previous, "attempt": attempt, "epochs": record.epochs,
                              "history_len": len(history.history["loss"]), "start_weights": record.start_weights,
                              "backup_dir_exists": os.path.exists(backup_dir)})

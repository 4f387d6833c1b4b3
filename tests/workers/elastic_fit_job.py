"""Keras fit under an elastic job: `elastic_fit_job.py OUT_DIR EPOCHS [sgd|adam]`.

The equivalence model (its SGD, or Adam(0.01): optimizer state a restore must bring back), 48 examples at a global batch of 12 whatever the worker count (6 per
worker on 2, 4 on 3), Keras' own BackupAndRestore (every epoch, in the shared OUT_DIR/backup),
then a pause of PAUSE seconds per epoch. Worker 0 appends "EPOCH WORKERS" to OUT_DIR/epochs after
each epoch's backup. SIGTERM (a change of members) lets the epoch finish and its backup be
written, then exits 85 at the pause. Every worker writes its weights (and whether its optimizer
sharded its state: TFDIST_SHARD_OPTIMIZER_STATE=1) to OUT_DIR/worker<rank>.json at the end.
"""

import os
import signal
import sys
import time

import keras
import tensorflow as tf

from tests.workers import common
from tfdist.keras_fixes import sharded_state

EXIT_PREEMPTED, BATCH, EXAMPLES, PAUSE = 85, 12, 48, 1.0
out_dir, epochs, optimizer = sys.argv[1], int(sys.argv[2]), (sys.argv[3:] or ["sgd"])[0]
rank, size = int(os.environ["TFDIST_WORKER_INDEX"]), int(os.environ["TFDIST_NUM_WORKERS"])
stopping = []
signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
strategy = tf.distribute.MultiWorkerMirroredStrategy()


class Record(keras.callbacks.Callback):
    """After BackupAndRestore: notes the epoch (worker 0), then pauses; leaves there when told to stop."""

    def on_epoch_end(self, epoch, logs=None):
        if rank == 0:
            with open(os.path.join(out_dir, "epochs"), "a") as f:
                f.write(f"{epoch} {size}\n")
        until = time.monotonic() + PAUSE
        while time.monotonic() < until:
            if stopping:
                os._exit(EXIT_PREEMPTED)
            time.sleep(0.05)


def data():
    x, y = common.regression_data(EXAMPLES)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)


if __name__ == "__main__":
    with strategy.scope():
        model = common.equivalence_model()
        if optimizer == "adam":
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.fit(data(), epochs=epochs, verbose=0,
              callbacks=[keras.callbacks.BackupAndRestore(os.path.join(out_dir, "backup")), Record()])
    common.write_result(out_dir, {"workers": size, "attempt": int(os.environ["TFDIST_RESTART"]),
                                  "sharded": sharded_state.is_sharded(model.optimizer),
                                  "weights": [w.tolist() for w in model.get_weights()]})

"""Edges of the agreed stop a review found (issue 40), on 2 workers under ``tfdist run``; a small regression model,
8 batches an epoch, 3 epochs.

`plane_edges_job.py OUT_DIR MODE`:

* "thread": the strategy is built and fit runs in a thread that is not the main one (Ray Train's way); worker 1's
  callback stops it at epoch 0, batch 2 (the plane never started there: worker 1 stopped alone);
* "slow-epoch-end": the same stop, then each epoch's end takes 8 s with the stop's exchange limited to 5 s
  (``ASKED_TIMEOUT_S``; 120 s by default: a long validation); the end verdict waited on the round's passed deadline;
* "frozen": at epoch 1, batch 2 worker 0 (the store's holder) stops itself (SIGSTOP) and worker 1 sends itself a
  SIGTERM: every store write blocked for ever (the job ran until --timeout).

Each worker writes the optimizer steps it trained.
"""

import os
import signal
import sys
import threading
import time

import numpy as np

import tfdist
from tests.workers import common

out_dir, mode = sys.argv[1], sys.argv[2]


def main():
    from tfdist import preemption

    if mode == "slow-epoch-end":
        preemption.ASKED_TIMEOUT_S = 5.0
    with tfdist.scope():
        import keras
        import tensorflow as tf

        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.01), "mse")
    rank = tfdist.rank()
    with open(os.path.join(out_dir, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    x = np.random.default_rng(0).normal(size=(16 * 8, 6)).astype("float32")
    data = tf.data.Dataset.from_tensor_slices((x, x.sum(1, keepdims=True))).batch(16)

    class Edge(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if mode != "frozen" and rank == 1 and (self.epoch, batch) == (0, 2):
                self.model.stop_training = True  # worker 1's own budget ran out
            elif mode == "frozen" and (self.epoch, batch) == (1, 2):
                if rank == 0:
                    os.kill(os.getpid(), signal.SIGSTOP)
                pid0 = int(open(os.path.join(out_dir, "pid0")).read())
                while open(f"/proc/{pid0}/stat").read().split(")")[1].split()[0] != "T":
                    time.sleep(0.05)
                os.kill(os.getpid(), signal.SIGTERM)

        def on_epoch_end(self, epoch, logs=None):
            if mode == "slow-epoch-end":
                time.sleep(8)

    model.fit(data, epochs=3, verbose=0, callbacks=[Edge(), keras.callbacks.BackupAndRestore(f"{out_dir}/backup")])
    common.write_result(out_dir, {"steps": int(model.optimizer.iterations.numpy())})


if mode == "thread":
    worker = threading.Thread(target=main)
    worker.start()
    worker.join()
else:
    main()

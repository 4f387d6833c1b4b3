"""Edges of the agreed stop in one process (issue 40's review): a small regression model under ``tfdist.scope()``.

`one_process_stops_job.py OUT_DIR MODE`:

* "unknown-length K": 10 batches an epoch of a dataset whose length Keras does not know (a ``filter``), 2 epochs,
  ``steps_per_execution=K``, BackupAndRestore; a SIGTERM at the first epoch's last call (once: a marker file).
  The resumed run crashed in the skip ("generator raised StopIteration");
* "second-signal": a SIGTERM in the last validation, and another during the preemption's save (it took the
  default action: exit 143, not 85);
* "callback-list": a custom loop drives a ``CallbackList`` for a model never compiled (no ``stop_training``).
* "manager-at-stop", "manager-before": no BackupAndRestore; a callback saves through a ``tfdist.CheckpointManager``
  (OUT_DIR/ckpt) at every epoch end; a SIGTERM at the first epoch's last step (its save is the preemption's), or at
  the second epoch's fifth (the last save is 5 steps before). The message said "nothing was saved" in both.

Prints "batches N" (the training batches this run saw) and "returned" when fit returns.
"""

import os
import signal
import sys

import keras
import numpy as np
import tensorflow as tf

import tfdist

out_dir, mode = sys.argv[1], sys.argv[2]
K = int(sys.argv[3]) if len(sys.argv) > 3 else 1
os.makedirs(out_dir, exist_ok=True)
marker = os.path.join(out_dir, "signalled")
with tfdist.scope():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
    if mode != "callback-list":
        model.compile(keras.optimizers.SGD(0.01), "mse", steps_per_execution=K)
x = np.random.default_rng(0).normal(size=(80, 6)).astype("float32")
data = tf.data.Dataset.from_tensor_slices((x, x.sum(1, keepdims=True))).batch(8)


class Signals(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.batches = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.batches += K
        last_call_ends = 9 if K == 1 else ((10 + K - 1) // K) * K - 1  # the batch Keras reports for the last call
        if mode == "unknown-length" and (self.epoch, batch) == (0, last_call_ends) and not os.path.exists(marker):
            open(marker, "w").close()
            print(f"batches {self.batches}", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
        if (mode, self.epoch, batch) in (("manager-at-stop", 0, 9), ("manager-before", 1, 4)):
            os.kill(os.getpid(), signal.SIGTERM)

    def on_test_batch_end(self, batch, logs=None):
        if mode == "second-signal" and self.epoch == 1 and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGTERM)


class SignalWhileSaving(keras.callbacks.BackupAndRestore):
    def _save_model(self):
        if mode == "second-signal" and os.path.exists(marker):
            os.kill(os.getpid(), signal.SIGTERM)
        super()._save_model()


class SaveEachEpoch(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.manager = tfdist.CheckpointManager(os.path.join(out_dir, "ckpt"))

    def on_epoch_end(self, epoch, logs=None):
        self.manager.save(self.model)


if mode == "callback-list":
    callbacks = keras.callbacks.CallbackList([keras.callbacks.Callback()], model=model)
    callbacks.on_train_begin()
    callbacks.on_epoch_begin(0)
    for step in range(3):
        callbacks.on_train_batch_begin(step)
        callbacks.on_train_batch_end(step, {"loss": 1.0})
    callbacks.on_epoch_end(0, {"loss": 1.0})
    callbacks.on_train_end()
else:
    signals = Signals()
    if mode == "unknown-length":
        data = data.filter(lambda features, target: True)
    saving = SaveEachEpoch() if mode.startswith("manager") else SignalWhileSaving(os.path.join(out_dir, "backup"))
    model.fit(data, epochs=2, verbose=0, validation_data=data if mode == "second-signal" else None,
              callbacks=[signals, saving])
    print(f"batches {signals.batches}", flush=True)
print("returned", flush=True)

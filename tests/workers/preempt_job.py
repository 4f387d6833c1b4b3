"""3 epochs of 8 steps with Keras' own BackupAndRestore (default save_freq="epoch") in OUT_DIR/backup.

`preempt_job.py OUT_DIR MODE`: at epoch 1, batch 2 of the first run (no OUT_DIR/signalled yet),
MODE says who is asked to stop: "launcher" (worker 0 SIGTERMs tfdist run), "worker" (worker 1
SIGTERMs itself), "all" (worker 0 SIGTERMs the launcher and every worker), "callback" (a callback
on worker 1 sets model.stop_training); "pydataset" is "launcher" with the batches coming from a
keras.utils.PyDataset(use_multiprocessing=True), whose pool's children the SIGTERM reaches too (it
goes to each worker's process group), and "pydataset-none" the same data, never stopped. Every
worker appends each (epoch, batch) it trained to
OUT_DIR/steps<rank>-<pid>.json as it goes, and writes its final weights and
optimizer.iterations when fit returns.
(Run by tests/test_preemption.py through tests.jobs.run_job, which bounds every job with a timeout.)
"""

import json
import os
import signal
import sys
import time

import keras
import tensorflow as tf

from tests.workers import common
from tfdist.keras_fixes import sharded_state

out_dir, mode = sys.argv[1], sys.argv[2]
source, mode = ("pydataset", mode.removeprefix("pydataset").lstrip("-") or "launcher") \
    if mode.startswith("pydataset") else ("tf.data", mode)
strategy = tf.distribute.MultiWorkerMirroredStrategy()
rank = int(os.environ["TFDIST_WORKER_INDEX"])
EPOCHS, STEPS, AT = 3, 8, (1, 2)
marker = os.path.join(out_dir, "signalled")
with open(os.path.join(out_dir, f"pid{rank}"), "w") as f:
    f.write(str(os.getpid()))


class Inject(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.steps, self.path = [], os.path.join(out_dir, f"steps{rank}-{os.getpid()}.json")

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.steps.append([self.epoch, batch])
        with open(self.path, "w") as f:
            json.dump(self.steps, f)
        if (self.epoch, batch) != AT or os.path.exists(marker) or mode == "none":
            return
        if mode == "callback" and rank == 1:
            self.model.stop_training = True
        elif rank == (1 if mode == "worker" else 0) and mode != "callback":
            open(marker, "w").close()
            targets = {"launcher": [os.getppid()], "worker": [os.getpid()],
                       "all": [os.getppid()] + [int(open(os.path.join(out_dir, f"pid{r}")).read()) for r in (0, 1)]}
            for pid in targets[mode]:
                os.kill(pid, signal.SIGTERM)


class Batches(keras.utils.PyDataset):
    """The same batches, made by a pool of 2 forked processes, slowly: some are always being made."""

    def __init__(self):
        super().__init__(workers=2, use_multiprocessing=True, max_queue_size=2)

    def __len__(self):
        return STEPS

    def __getitem__(self, index):
        time.sleep(0.2)
        part = slice(index * common.GLOBAL_BATCH, (index + 1) * common.GLOBAL_BATCH)
        return x[part], y[part]


with strategy.scope():
    model = common.resumable_model()
x, y = common.regression_data(common.GLOBAL_BATCH * STEPS)
data = Batches() if source == "pydataset" else tf.data.Dataset.from_tensor_slices((x, y)).batch(common.GLOBAL_BATCH)
inject = Inject()
model.fit(data, epochs=EPOCHS, verbose=0, shuffle=False,
          callbacks=[keras.callbacks.BackupAndRestore(os.path.join(out_dir, "backup")), inject])
common.write_result(out_dir, {"weights": [w.tolist() for w in model.get_weights()],
                              "iterations": int(model.optimizer.iterations.numpy()), "steps": inject.steps,
                              "sharded": sharded_state.is_sharded(model.optimizer)})

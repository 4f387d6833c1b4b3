"""A job where worker 1 never joins a collective; tfdist's hang watchdog must stop it, naming it.

`hang_job.py OUT_DIR MODE`, MODE one of
  extra_allreduce: worker 1 traces its first train step slowly (busy for SLOW_TRACE_S, which must
      not be reported), then, after its second step, makes an eager tfdist.allreduce that worker 0 never makes;
  sleep: worker 1 sleeps before fit (as a rank stuck in its input loop or a debugger).
Each worker writes worker<rank>.json (its pid, the watchdog thread); worker 1 writes hang1.json when it hangs.
"""

import json
import os
import pathlib
import sys
import threading
import time

import tfdist
from tests.workers import common

out_dir, mode = sys.argv[1], sys.argv[2]
SLOW_TRACE_S = float(os.environ.get("SLOW_TRACE_S", "0"))
strategy = tfdist.get_strategy()
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

rank = tfdist.rank()


class SlowFirstTrace(keras.Sequential):
    traced = False

    def train_step(self, data):
        if rank == 1 and not SlowFirstTrace.traced:  # runs while train_function traces
            SlowFirstTrace.traced = True
            end = time.monotonic() + SLOW_TRACE_S
            while time.monotonic() < end:
                pass
        return super().train_step(data)


class ExtraAllreduce(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if rank == 1 and batch == 1:
            write("hang", {"at": time.time()})
            tfdist.allreduce(tf.constant(1.0))  # worker 0 makes no such call


with strategy.scope():
    model = SlowFirstTrace([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
x, y = common.regression_data(64)


def write(name: str, payload: dict) -> None:  # by rank: a job started by hand has no launcher's rank variables
    pathlib.Path(out_dir, f"{name}{rank}.json").write_text(json.dumps(payload))


write("worker", {"pid": os.getpid(), "watchdogs": [t.name for t in threading.enumerate() if "watchdog" in t.name]})
if mode == "sleep" and rank == 1:
    write("hang", {"at": time.time()})
    time.sleep(3600)
model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16).repeat(), steps_per_epoch=4, epochs=3, verbose=0,
          callbacks=[ExtraAllreduce()] if mode == "extra_allreduce" else [])
print("finished", flush=True)

"""Jobs where one worker hangs, freezes or spins (tfdist's hang watchdog must stop them, naming it), or is only slow.

`hang_job.py OUT_DIR MODE [RANK [HOW]]`, MODE one of
  extra_allreduce: worker 1, after its second step, makes an eager tfdist.allreduce that worker 0 never makes;
  sleep: worker 1 sleeps before fit (as a rank stuck in its input loop or a debugger);
  spin: worker 1, after its second step, calls a tf.function that loops forever (busy inside one call);
  freeze: worker RANK, after its second step, calls that tf.function and 2 s later freezes (its last state: busy in
      a call), HOW being sigstop (it SIGSTOPs itself) or gil (a thread sleeps in a C call holding Python's lock:
      TensorFlow's own heartbeats go on);
  slow_start: worker 1 computes outside any call for 0.7 S, then traces its first train step for 0.4 S (S: the
      hang timeout), so worker 0 waits in its first step longer than S; after fit worker RANK exits (worker 0 at
      once: its store goes before a peer can read that it exited) and the other stays 1.2 S longer (outside any
      call). Nothing may be reported: the job finishes.
Each worker writes worker<rank>.json (its pid, the watchdog thread; worker 0 in slow_start: its first call's
seconds); the worker that hangs or freezes writes hang<rank>.json then ("at": the time).
"""

import ctypes
import json
import os
import pathlib
import signal
import sys
import threading
import time

import tfdist
from tests.workers import common

out_dir, mode, *rest = sys.argv[1:]
chosen = int(rest[0]) if rest else None  # freeze: the worker that freezes; slow_start: the first to exit
how = rest[1] if len(rest) > 1 else None  # freeze: sigstop or gil
HANG_TIMEOUT = float(os.environ.get("TFDIST_HANG_TIMEOUT", "600"))
strategy = tfdist.get_strategy()
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

rank = tfdist.rank()
first_call = {}  # slow_start: when the first train step began, and its seconds on worker 0


def busy(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


@tf.function
def spin():
    """Loops in the graph for ever: a call that never returns, its CPU busy."""
    return tf.while_loop(lambda i: i >= 0, lambda i: i + 1, [tf.constant(0, tf.int64)])


def freeze() -> None:
    write("hang", {"at": time.time()})
    if how == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        ctypes.PyDLL(None).sleep(600)  # PyDLL: the call keeps Python's lock


class SlowFirstTrace(keras.Sequential):
    traced = False

    def train_step(self, data):
        if mode == "slow_start" and rank == 1 and not SlowFirstTrace.traced:  # runs while train_function traces
            SlowFirstTrace.traced = True
            busy(0.4 * HANG_TIMEOUT)
        return super().train_step(data)


class Misbehave(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if mode == "slow_start" and batch == 0:
            first_call["began"] = time.monotonic()
            if rank == 1:
                busy(0.7 * HANG_TIMEOUT)

    def on_train_batch_end(self, batch, logs=None):
        if mode == "slow_start" and rank == 0:
            first_call.setdefault("seconds", time.monotonic() - first_call["began"])
        if batch != 1:
            return
        if mode == "extra_allreduce" and rank == 1:
            write("hang", {"at": time.time()})
            tfdist.allreduce(tf.constant(1.0))  # worker 0 makes no such call
        elif mode == "spin" and rank == 1:
            write("hang", {"at": time.time()})
            spin()
        elif mode == "freeze" and rank == chosen:
            threading.Timer(2.0, freeze).start()
            spin()


with strategy.scope():
    model = SlowFirstTrace([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
x, y = common.regression_data(64)


def write(name: str, payload: dict) -> None:  # by rank: a job started by hand has no launcher's rank variables
    pathlib.Path(out_dir, f"{name}{rank}.json").write_text(json.dumps(payload))


def write_worker(**more) -> None:
    watchdogs = [t.name for t in threading.enumerate() if "watchdog" in t.name]
    write("worker", {"pid": os.getpid(), "watchdogs": watchdogs, **more})


write_worker()
if mode == "sleep" and rank == 1:
    write("hang", {"at": time.time()})
    time.sleep(3600)
model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16).repeat(), steps_per_epoch=4, epochs=3, verbose=0,
          callbacks=[Misbehave()])
if mode == "slow_start":
    write_worker(first_call_s=first_call.get("seconds"))
    if rank != chosen:
        time.sleep(1.2 * HANG_TIMEOUT)  # the other worker has exited meanwhile: gone, not silent
print("finished", flush=True)
if mode == "slow_start" and rank == chosen == 0:
    os._exit(0)

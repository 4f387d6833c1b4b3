"""Edges of the agreed stop that its everyday cases do not walk (issue 40), one MODE per job.

`stop_edges_job.py OUT_DIR MODE`, on 2 workers:

* "two-fits": a callback on worker 0 sets model.stop_training at the last batch of a first fit
  (6 steps); a second fit of 20 steps follows. Writes each fit's steps and the final weights.
* "disagree": a callback on worker 1 sets model.stop_training at batch 2; worker 0 SIGTERMs itself
  once its own report of that request is in the store (so the report says "no signal"). Fit has
  a BackupAndRestore in OUT_DIR/backup.
* "loop", "elastic": a custom loop of 6 steps with tfdist.should_stop and tfdist.exit_if_preempted
  (or an hvd.elastic.run of 6 committed steps), then "post-loop work": worker 0 SIGTERMs worker 1
  and both sleep 60 s. Worker 1 must end at once (the signal's default action).
* "unanswered": at batch 3, worker 1 SIGSTOPs itself; worker 0 SIGTERMs itself once worker 1 is
  stopped and its own report is in the store: its agreed stop waits for worker 1's report.
"""

import json
import os
import signal
import sys
import time

import tfdist

out_dir, mode = sys.argv[1], sys.argv[2]
with tfdist.scope() as strategy:
    pass
import keras  # noqa: E402  (after the strategy)
import tensorflow as tf  # noqa: E402

from tests.workers import common  # noqa: E402
from tfdist import kvstore  # noqa: E402

rank = tfdist.rank()
with open(os.path.join(out_dir, f"pid{rank}"), "w") as f:
    f.write(str(os.getpid()))


def pid_of(worker: int) -> int:
    return int(open(os.path.join(out_dir, f"pid{worker}")).read())


def wait_until(condition, seconds: float = 30.0) -> None:
    end = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > end:
            raise TimeoutError(f"worker {rank}: timed out waiting")
        time.sleep(0.05)


def reported(worker: int) -> bool:
    """Whether worker's answer to a stop request is in the store (its session is 1: the job's first fit)."""
    return any(kvstore.get(f"tfdist/stop/{n}/report/{worker}", 100) for n in (0, 1))


class Steps(keras.callbacks.Callback):
    """Counts the steps of one fit; at batch ``at`` calls ``then(self)`` on the workers ``on``."""

    def __init__(self, at=None, on=(), then=None):
        super().__init__()
        self.done, self.at, self.on, self.then = 0, at, on, then

    def on_train_batch_end(self, batch, logs=None):
        self.done += 1
        if batch == self.at and rank in self.on:
            self.then(self)


def data(steps: int):
    x, y = common.regression_data(common.GLOBAL_BATCH * steps)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(common.GLOBAL_BATCH)


def post_loop_work() -> None:
    """After training: worker 0 SIGTERMs worker 1 (as a scheduler would); both go on working."""
    open(os.path.join(out_dir, f"loop-done{rank}"), "w").close()
    if rank == 0:
        wait_until(lambda: os.path.exists(os.path.join(out_dir, "loop-done1")))
        os.kill(pid_of(1), signal.SIGTERM)
        open(os.path.join(out_dir, "signalled"), "w").close()
    time.sleep(60)


def stop_training(callback):
    callback.model.stop_training = True


if mode == "two-fits":
    with strategy.scope():
        model = common.resumable_model()
    first, second = Steps(at=5, on=(0,), then=stop_training), Steps()
    model.fit(data(6), epochs=1, verbose=0, callbacks=[first])
    model.fit(data(20), epochs=1, verbose=0, callbacks=[second])
    common.write_result(out_dir, {"steps": [first.done, second.done], "weights": [w.tolist() for w in model.get_weights()],
                                  "iterations": int(model.optimizer.iterations.numpy())})

elif mode == "disagree":
    def signal_myself_once_reported(callback):
        wait_until(lambda: reported(0))
        os.kill(os.getpid(), signal.SIGTERM)

    with strategy.scope():
        model = common.resumable_model()
    model.fit(data(8), epochs=3, verbose=0, callbacks=[
        Steps(at=2, on=(1,), then=stop_training), Steps(at=2, on=(0,), then=signal_myself_once_reported),
        keras.callbacks.BackupAndRestore(os.path.join(out_dir, "backup"))])
    common.write_result(out_dir, {"returned": True})

elif mode in ("loop", "elastic"):
    with strategy.scope():
        model = common.equivalence_model()
        optimizer = keras.optimizers.SGD(learning_rate=0.05)
        optimizer.build(model.trainable_variables)

    train_step = common.sgd_train_step(strategy, model, optimizer)
    iterator = iter(strategy.experimental_distribute_dataset(data(6)))
    if mode == "loop":
        for step in range(6):
            train_step(next(iterator))
            if tfdist.should_stop(step + 1):
                break
        tfdist.exit_if_preempted()
    else:
        from tfdist import horovod as hvd

        hvd.init()

        @hvd.elastic.run
        def train(state):
            for step in range(state.step, 6):
                train_step(next(iterator))
                state.step = step + 1
                state.commit()

        train(hvd.elastic.ObjectState(step=0))
    post_loop_work()

elif mode == "unanswered":
    def freeze(callback):
        os.kill(os.getpid(), signal.SIGSTOP)

    def signal_myself_once_worker_1_is_frozen(callback):
        wait_until(lambda: open(f"/proc/{pid_of(1)}/stat").read().split(")")[1].split()[0] == "T")
        os.kill(os.getpid(), signal.SIGTERM)
        open(os.path.join(out_dir, "signalled"), "w").close()
        wait_until(lambda: reported(0))

    with strategy.scope():
        model = common.resumable_model()
    model.fit(data(8), epochs=3, verbose=0, callbacks=[
        Steps(at=3, on=(1,), then=freeze), Steps(at=3, on=(0,), then=signal_myself_once_worker_1_is_frozen)])

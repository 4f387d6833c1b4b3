"""Edges of the agreed stop that its everyday cases do not walk (issue 40), one MODE per job.

`stop_edges_job.py OUT_DIR MODE`, on 2 workers:

* "sequence" (exit 0): three fits in a row. (1) A callback on worker 0 sets model.stop_training at
  the last batch of a 6-step fit; a 20-step fit follows and must train 20 steps. (2) Worker 0 alone
  fits a local probe model (outside the job's strategy). (3) A 3-epoch fit of the job whose
  callback, on every worker, fits a local probe model at batch 1 (a fit inside a fit); worker 1
  sets stop_training at epoch 1, batch 2: every worker stops after that same step.
* "disagree": a callback on worker 1 sets model.stop_training at batch 2; worker 0 SIGTERMs itself
  once its own report of that request is in the store (so the report says "no signal"). Fit has
  a BackupAndRestore in OUT_DIR/backup.
* "probes": worker 0 fits a local probe model first; the job's fit (BackupAndRestore) fits a local
  probe inside a callback at batch 1; at epoch 1, batch 2 worker 0 SIGTERMs the launcher.
* "last-validation": fit 1 (2 epochs of 8 steps, validation, BackupAndRestore in OUT_DIR/backup1):
  worker 0 SIGTERMs the launcher during the last epoch's validation (first run only); then fit 2
  (4 steps). Writes the iterations after each fit.
* "loop", "elastic": a custom loop of 6 steps with tfdist.should_stop and tfdist.exit_if_preempted
  (or an hvd.elastic.run of 6 committed steps), then "post-loop work": worker 0 SIGTERMs worker 1
  and both sleep 60 s. Worker 1 must end at once (the signal's default action).
* "unanswered" ("unanswered-elastic"): at step 3 of a fit (of an hvd.elastic.run), worker 1 SIGSTOPs
  itself once worker 0 is past that step too (a worker frozen as soon as its own step ends may hold
  the answer its peer's last collective of the step still waits for, in its stopped gRPC threads);
  worker 0 SIGTERMs itself once worker 1 is stopped and its own report is in the store: its agreed
  stop waits for worker 1's report.
* "blocked": at batch 3 worker 1 sleeps 40 s in a callback; worker 0 SIGTERMs itself and goes on
  into step 4, where it waits for worker 1 inside TensorFlow.

Every mode marks OUT_DIR/signalled when it sends its signal.
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
marker = os.path.join(out_dir, "signalled")
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
    """Whether worker's answer to a stop request of the job's first session is in the store."""
    return any(kvstore.get(f"tfdist/stop/{n}/report/{worker}", 100) for n in (0, 1))


def freeze_once_worker_0_is_past_this_step() -> None:
    wait_until(lambda: os.path.exists(os.path.join(out_dir, "worker0-past")))
    os.kill(os.getpid(), signal.SIGSTOP)


def signal_myself_once_worker_1_is_frozen() -> None:
    open(os.path.join(out_dir, "worker0-past"), "w").close()
    wait_until(lambda: open(f"/proc/{pid_of(1)}/stat").read().split(")")[1].split()[0] == "T")
    kill(os.getpid())


def kill(pid: int, sig=signal.SIGTERM) -> None:
    open(marker, "w").close()
    os.kill(pid, sig)


class Steps(keras.callbacks.Callback):
    """Counts the steps of one fit; at (epoch, batch) ``at`` calls ``then(self)`` on the workers ``on``."""

    def __init__(self, at=None, on=(), then=None):
        super().__init__()
        self.done, self.epoch, self.at, self.on, self.then = 0, 0, at, on, then

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.done += 1
        if (self.epoch, batch) == self.at and rank in self.on:
            self.then(self)


def data(steps: int):
    x, y = common.regression_data(common.GLOBAL_BATCH * steps)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(common.GLOBAL_BATCH)


def stop_training(callback):
    callback.model.stop_training = True


def fit_a_local_probe(callback=None):
    """A fit outside the job's strategy (no scope): a session of this worker alone."""
    probe = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
    probe.compile(keras.optimizers.SGD(0.01), "mse")
    x, y = common.regression_data(32)
    probe.fit(x, y, batch_size=8, epochs=1, verbose=0)


def job_model():
    with strategy.scope():
        return common.resumable_model()


def post_loop_work() -> None:
    """After training: worker 0 SIGTERMs worker 1 (as a scheduler would); both go on working."""
    open(os.path.join(out_dir, f"loop-done{rank}"), "w").close()
    if rank == 0:
        wait_until(lambda: os.path.exists(os.path.join(out_dir, "loop-done1")))
        kill(pid_of(1))
    time.sleep(60)


if mode == "sequence":
    model = job_model()
    first, second = Steps(at=(0, 5), on=(0,), then=stop_training), Steps()
    model.fit(data(6), epochs=1, verbose=0, callbacks=[first])
    model.fit(data(20), epochs=1, verbose=0, callbacks=[second])
    if rank == 0:
        fit_a_local_probe()
    nested = job_model()
    third = Steps(at=(1, 2), on=(1,), then=stop_training)
    nested.fit(data(8), epochs=3, verbose=0, callbacks=[Steps(at=(0, 1), on=(0, 1), then=fit_a_local_probe), third])
    common.write_result(out_dir, {"steps": [first.done, second.done, third.done],
                                  "weights": [w.tolist() for w in model.get_weights()],
                                  "iterations": int(model.optimizer.iterations.numpy()),
                                  "nested_weights": [w.tolist() for w in nested.get_weights()]})

elif mode == "disagree":
    def signal_myself_once_reported(callback):
        wait_until(lambda: reported(0))
        kill(os.getpid())

    job_model().fit(data(8), epochs=3, verbose=0, callbacks=[
        Steps(at=(0, 2), on=(1,), then=stop_training), Steps(at=(0, 2), on=(0,), then=signal_myself_once_reported),
        keras.callbacks.BackupAndRestore(os.path.join(out_dir, "backup"))])
    common.write_result(out_dir, {"returned": True})

elif mode == "probes":
    if rank == 0:
        fit_a_local_probe()
    job_model().fit(data(8), epochs=3, verbose=0, callbacks=[
        Steps(at=(0, 1), on=(0, 1), then=fit_a_local_probe),
        Steps(at=(1, 2), on=(0,), then=lambda callback: kill(os.getppid())),
        keras.callbacks.BackupAndRestore(os.path.join(out_dir, "backup"))])
    common.write_result(out_dir, {"returned": True})

elif mode == "last-validation":
    class SignalDuringTheLastValidation(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_test_batch_end(self, batch, logs=None):
            if rank == 0 and self.epoch == 1 and not os.path.exists(marker):  # its first validation call
                kill(os.getppid())

    model = job_model()
    model.fit(data(8), epochs=2, verbose=0, validation_data=data(4),
              callbacks=[SignalDuringTheLastValidation(), keras.callbacks.BackupAndRestore(os.path.join(out_dir, "backup1"))])
    after_first = int(model.optimizer.iterations.numpy())
    model.fit(data(4), epochs=1, verbose=0)
    common.write_result(out_dir, {"iterations": [after_first, int(model.optimizer.iterations.numpy())]})

elif mode in ("loop", "elastic", "unanswered-elastic"):
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
                if step == 3 and mode == "unanswered-elastic":
                    freeze_or_signal()
                state.step = step + 1
                state.commit()

        def freeze_or_signal():
            if rank == 1:
                freeze_once_worker_0_is_past_this_step()
                return
            signal_myself_once_worker_1_is_frozen()
            wait_until(lambda: kvstore.get("tfdist/stop/1/report/0", 100))

        train(hvd.elastic.ObjectState(step=0))
    post_loop_work()

elif mode == "unanswered":
    def freeze(callback):
        freeze_once_worker_0_is_past_this_step()

    def signal_and_report(callback):
        signal_myself_once_worker_1_is_frozen()
        wait_until(lambda: reported(0))

    job_model().fit(data(8), epochs=3, verbose=0, callbacks=[
        Steps(at=(0, 3), on=(1,), then=freeze), Steps(at=(0, 3), on=(0,), then=signal_and_report)])

elif mode == "blocked":
    job_model().fit(data(8), epochs=3, verbose=0, callbacks=[
        Steps(at=(0, 3), on=(1,), then=lambda callback: time.sleep(40)),
        Steps(at=(0, 3), on=(0,), then=lambda callback: kill(os.getpid()))])

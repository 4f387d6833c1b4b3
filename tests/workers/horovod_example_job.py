"""Runs an example script as ``python SCRIPT ARGS`` would, and records what a Horovod user checks.

    python tests/workers/horovod_example_job.py OUT_DIR SCRIPT [ARGS...]

Before running SCRIPT (as ``__main__``, with runpy), it wraps a few things, without
changing what they do:

* ``keras.Model.fit`` gets one more callback, which records each batch's loss, the
  examples this process's loss tracker counted, the learning rate, and the weights when
  training begins;
* ``keras.Model.__init__`` remembers the models the script builds;
* ``tfdist.horovod.elastic``: each commit (rank 0 logs them to ``commits-attempt<A>.json``
  as it goes), and the state ``hvd.elastic.run`` hands to the training function.

``HOROVOD_TEST_KILL=rank:fit:epoch:batch`` SIGKILLs that rank at the start of that batch
of its fit call number ``fit`` (0-based), in the first attempt only. At the end,
``worker<rank>.json`` holds the records and a hash of the last model's weights.
"""

import hashlib
import json
import os
import pathlib
import runpy
import signal
import sys

import keras

from tests.workers import common

out_dir, script, *script_args = sys.argv[1:]
rank = int(os.environ.get("TFDIST_WORKER_INDEX") or os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("PMI_RANK") or "0")
attempt = int(os.environ.get("TFDIST_RESTART", "0"))
kill = os.environ.get("HOROVOD_TEST_KILL")
kill = [int(part) for part in kill.split(":")] if kill else None
record = {"fits": [], "attempt": attempt}
models = []


def weights_hash(model) -> str:
    digest = hashlib.sha256()
    for weight in model.get_weights():
        digest.update(weight.tobytes())
    return digest.hexdigest()


class Recorder(keras.callbacks.Callback):
    def __init__(self, index):
        super().__init__()
        self.index = index
        self.fit = {"batches": [], "epoch_logs": [], "lr_end": []}
        record["fits"].append(self.fit)

    def on_train_begin(self, logs=None):
        self.fit["start_weights"] = weights_hash(self.model)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if kill and attempt == 0 and kill == [rank, self.index, self.epoch, batch]:
            os.kill(os.getpid(), signal.SIGKILL)
        self.lr = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))

    def on_train_batch_end(self, batch, logs=None):
        self.fit["batches"].append({"epoch": self.epoch, "batch": batch, "loss": float(logs["loss"]), "lr": self.lr,
                                    "seen": float(self.model._loss_tracker.count.numpy())})

    def on_epoch_end(self, epoch, logs=None):
        self.fit["epoch_logs"].append({k: float(v) for k, v in (logs or {}).items()})
        self.fit["lr_end"].append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))


original_fit = keras.Model.fit


def recorded_fit(self, *args, **kwargs):
    kwargs["callbacks"] = list(kwargs.get("callbacks") or []) + [Recorder(len(record["fits"]))]
    return original_fit(self, *args, **kwargs)


original_init = keras.Model.__init__


def remembering_init(self, *args, **kwargs):
    original_init(self, *args, **kwargs)
    models.append(self)


keras.Model.fit = recorded_fit
keras.Model.__init__ = remembering_init

from tfdist.horovod import elastic  # noqa: E402  (after the wraps above; imports TensorFlow)

original_commit, original_run = elastic.State.commit, elastic.run
commits = []


def logged_commit(self):
    original_commit(self)
    if rank == 0 and hasattr(self, "model"):
        commits.append({"epoch": self.epoch, "batch": self.batch, "weights": weights_hash(self.model)})
        pathlib.Path(out_dir, f"commits-attempt{attempt}.json").write_text(json.dumps(commits))


def recording_run(func):
    def with_record(state, *args, **kwargs):
        record["resumed"] = {"epoch": state.epoch, "batch": state.batch, "weights": weights_hash(state.model)}
        return func(state, *args, **kwargs)

    return original_run(with_record)


elastic.State.commit, elastic.run = logged_commit, recording_run

sys.argv = [script, *script_args]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")
record["final_weights"] = weights_hash(models[-1]) if models else None
common.write_result(out_dir, record)
